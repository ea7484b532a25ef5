//! One record decoded from its payload alone (`reader::decode_payload`, `reader::read_payload`,
//! what `layertap.follow` and the Mooncake backend read through): on every record of the shared
//! vectors, the same blob and header as `ShardReader::read`, or a reason where it finds the
//! record corrupt; a payload the file ends before is refused, not read past.

use layertap_core::reader::{decode_payload, read_payload, PayloadInfo, ShardReader};
use layertap_core::Error;
use std::fs::File;
use std::path::PathBuf;

fn vectors() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/vectors");
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "lts"))
        .collect();
    out.sort();
    out
}

#[test]
fn payloads_decode_as_the_shard_reader_reads_them() {
    let (mut same, mut corrupt) = (0, 0);
    for path in vectors() {
        let Ok(reader) = ShardReader::open(&path) else {
            continue;
        };
        let file = File::open(&path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        for (i, e) in reader.entries().iter().enumerate() {
            let info = PayloadInfo {
                key: &e.key,
                codec: e.codec,
                raw_len: e.raw_len,
                payload_crc: Some(e.payload_crc),
            };
            let at = e.payload_offset();
            let stored = &bytes[at as usize..(at + e.stored_len) as usize];
            let decoded = decode_payload(stored, &info);
            let read = read_payload(&file, at, e.stored_len, &info);
            match reader.read(i, true) {
                Ok(record) => {
                    let (blob, header) = decoded.unwrap();
                    assert_eq!(
                        blob.as_slice(),
                        record.bytes.as_slice(),
                        "{path:?} {}",
                        e.key
                    );
                    assert_eq!(header, record.header);
                    let (mapped, header) = read.unwrap();
                    assert_eq!(mapped.as_slice(), record.bytes.as_slice());
                    assert_eq!(header, record.header);
                    same += 1;
                }
                Err(Error::CorruptRecord { reason, .. }) => {
                    assert_eq!(decoded.unwrap_err(), reason, "{path:?} {}", e.key);
                    assert_eq!(read.unwrap_err(), reason);
                    corrupt += 1;
                }
                Err(other) => panic!("{path:?}: {other}"),
            }
        }
    }
    assert!(same >= 20 && corrupt >= 1, "{same} read, {corrupt} corrupt");
}

#[test]
fn a_payload_past_the_end_of_the_file_is_refused() {
    let path = vectors()
        .into_iter()
        .find(|p| p.ends_with("exp-huf.lts"))
        .unwrap();
    let reader = ShardReader::open(&path).unwrap();
    let e = reader.entries().last().unwrap();
    let file = File::open(&path).unwrap();
    let info = PayloadInfo {
        key: &e.key,
        codec: e.codec,
        raw_len: e.raw_len,
        payload_crc: None,
    };
    let past = file.metadata().unwrap().len() - e.payload_offset() + 1;
    let err = read_payload(&file, e.payload_offset(), past, &info).unwrap_err();
    assert_eq!(err, "payload is cut off by the end of the file");
}
