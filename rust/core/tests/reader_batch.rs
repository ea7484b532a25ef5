//! A batch's records read together (`reader::read_batch`, what `layertap.torch` reads batches
//! through): on every record of the shared vectors, from all the shards at once, on one thread
//! and on several, the placed tensor (zeros after it in a longer row) and the others hold the
//! bytes `ShardReader::read` gives, or the record is refused with its reason; and the stored
//! payloads copied out as the file holds them (`reader::read_stored_batch`, what the Dataset's
//! GPU decoding stages its batches through); and a batch of fewer records than threads, whose
//! large exp-huf block and checksum spread over the threads left.

mod reader_common;

use layertap_core::codec::Codec;
use layertap_core::format::crc32c;
use layertap_core::reader::{read_batch, read_stored_batch, BatchRead, ShardReader, StoredRead};
use layertap_core::Dtype;
use layertap_core::Error;
use reader_common::{build_shard, write_file, RecordSpec};
use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
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

/// A reader of each shared vector that opens as a shard.
fn vector_readers() -> Vec<ShardReader> {
    vectors()
        .iter()
        .filter_map(|p| ShardReader::open(p).ok())
        .collect()
}

#[test]
fn a_batch_of_every_vector_reads_as_the_shard_reader_reads_each_record() {
    let readers = vector_readers();
    // Every record, with a row as long as its hidden_states (or 16 bytes, where it has none or
    // is corrupt: nothing is placed there).
    let mut wanted = Vec::new();
    for r in &readers {
        for i in 0..r.len() {
            let want = r.read(i, true);
            let len = want
                .as_ref()
                .ok()
                .and_then(|rec| {
                    rec.header
                        .tensors
                        .iter()
                        .find(|t| t.spec.name == "hidden_states")
                })
                .map_or(16, |t| t.range.len());
            wanted.push((r, i, want, len));
        }
    }
    for threads in [1, 3] {
        // Rows 8 bytes longer than the tensor on the second pass: zeros after it.
        let pad = if threads == 1 { 0 } else { 8 };
        let mut rows: Vec<Vec<u8>> = wanted.iter().map(|w| vec![0xEE; w.3 + pad]).collect();
        let mut batch: Vec<BatchRead<'_>> = wanted
            .iter()
            .zip(rows.iter_mut())
            .map(|((r, i, _, _), row)| BatchRead {
                reader: r,
                index: *i,
                dst: row,
                result: None,
            })
            .collect();
        read_batch(&mut batch, "hidden_states", true, threads);
        let (mut placed, mut corrupt) = (0, 0);
        for (b, (r, i, want, _)) in batch.iter().zip(&wanted) {
            let got = b.result.as_ref().expect("every result is set");
            match (want, got) {
                (Ok(rec), Ok(p)) => {
                    assert_eq!(p.header.metadata, rec.header.metadata);
                    for (k, t) in p.header.tensors.iter().enumerate() {
                        let whole = &rec.bytes.as_slice()[rec.header.tensors[k].range.clone()];
                        if p.placed == Some(k) {
                            let (data, zeros) = b.dst.split_at(whole.len());
                            assert_eq!(data, whole, "{:?} #{i}", r.path());
                            assert!(zeros.iter().all(|&z| z == 0) && zeros.len() == pad);
                            placed += 1;
                        } else {
                            assert_eq!(&p.rest[t.range.clone()], whole, "{:?} #{i}", r.path());
                        }
                    }
                }
                (
                    Err(Error::CorruptRecord { reason, .. }),
                    Err(Error::CorruptRecord { reason: r2, .. }),
                ) => {
                    assert_eq!(reason, r2);
                    corrupt += 1;
                }
                (w, g) => panic!("{:?} #{i}: {w:?} against {g:?}", r.path()),
            }
        }
        assert!(
            placed >= 20 && corrupt >= 1,
            "{placed} placed, {corrupt} corrupt"
        );
    }
}

#[test]
fn stored_payloads_of_every_vector_are_copied_as_the_file_holds_them() {
    let readers = vector_readers();
    // What the file holds at each record's payload, read apart from the reader's mapping.
    let mut wanted = Vec::new();
    for r in &readers {
        let file = std::fs::File::open(r.path()).unwrap();
        for (i, e) in r.entries().iter().enumerate() {
            let mut stored = vec![0u8; e.stored_len as usize];
            file.read_exact_at(&mut stored, e.payload_offset()).unwrap();
            let intact = crc32c(&stored) == e.payload_crc;
            wanted.push((r, i, stored, intact));
        }
    }
    for (threads, verify) in [(1, true), (3, true), (3, false)] {
        let mut out: Vec<Vec<u8>> = wanted.iter().map(|w| vec![0xEE; w.2.len()]).collect();
        let mut batch: Vec<StoredRead<'_>> = wanted
            .iter()
            .zip(out.iter_mut())
            .map(|((r, i, _, _), dst)| StoredRead {
                reader: r,
                index: *i,
                dst,
                result: None,
            })
            .collect();
        read_stored_batch(&mut batch, verify, threads);
        let (mut copied, mut mismatched) = (0, 0);
        for (b, (r, i, stored, intact)) in batch.iter().zip(&wanted) {
            assert_eq!(&b.dst[..], &stored[..], "{:?} #{i}", r.path());
            match b.result.as_ref().expect("every result is set") {
                Ok(()) => {
                    assert!(
                        *intact || !verify,
                        "{:?} #{i}: a bad checksum passed",
                        r.path()
                    );
                    copied += 1;
                }
                Err(Error::CorruptRecord { key, reason, .. }) => {
                    assert!(verify && !intact, "{:?} #{i}: {reason}", r.path());
                    assert!(reason.starts_with("payload checksum mismatch"), "{reason}");
                    assert_eq!(key.as_deref(), Some(r.entries()[*i].key.as_str()));
                    mismatched += 1;
                }
                Err(e) => panic!("{:?} #{i}: {e:?}", r.path()),
            }
        }
        assert!(copied >= 20, "{copied} copied");
        assert!(mismatched >= 1 || !verify, "no vector has a bad checksum");
    }
}

#[test]
fn a_stored_payload_needs_a_buffer_of_its_length() {
    let path = vectors()
        .into_iter()
        .find(|p| p.ends_with("bp16-zstd.lts"))
        .unwrap();
    let reader = ShardReader::open(&path).unwrap();
    let n = reader.entries()[0].stored_len as usize;
    for len in [n - 1, n + 1] {
        let mut dst = vec![0u8; len];
        match reader.read_stored(0, true, &mut dst) {
            Err(Error::InvalidInput(m)) => assert!(m.contains("stored_len"), "{m}"),
            other => panic!("a buffer of {len} for {n} bytes: {other:?}"),
        }
    }
}

/// A record whose exp-huf block is coded by column in 64 streams of 2,048 rows (`[512, 4, 256]`
/// bf16, values of a few exponents): enough for the decoder to split its streams over two
/// threads and its rows over up to eight, and its checksum over up to four.
fn wide_record(key: &str) -> RecordSpec {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let hidden: Vec<u8> = (0..512 * 4 * 256)
        .flat_map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            [(state >> 8) as u8, 0x3e + (state & 3) as u8]
        })
        .collect();
    RecordSpec {
        key: key.to_string(),
        codec: Codec::ExpHuf,
        tensors: vec![(
            "hidden_states".into(),
            Dtype::BF16,
            vec![512, 4, 256],
            hidden,
        )],
        metadata: BTreeMap::new(),
    }
}

#[test]
fn one_large_exphuf_record_on_several_threads_reads_as_on_one() {
    let spec = wide_record("wide");
    let data = spec.tensors[0].3.clone();
    let mut shard = build_shard(&[spec], true);
    // The block is coded by column (mode 2) in 64 streams: after the safetensors header, the
    // mode byte, the contexts, 3 reserved bytes, then columns and streams (u32 each).
    let payload = &shard.bytes[shard.payload_offsets[0] as usize..];
    let block = 8 + u64::from_le_bytes(payload[..8].try_into().unwrap()) as usize;
    let field = |at: usize| u32::from_le_bytes(payload[at..at + 4].try_into().unwrap());
    assert_eq!(payload[block], 2, "block mode");
    assert_eq!(
        (field(block + 5), field(block + 9)),
        (256, 64),
        "columns, streams"
    );
    let dir = tempfile::tempdir().unwrap();
    let intact = ShardReader::open(write_file(dir.path(), "wide.lts", &shard.bytes)).unwrap();
    // The same shard with one byte of the payload's middle flipped.
    let middle = shard.payload_offsets[0] + shard.entries[0].stored_len / 2;
    shard.bytes[middle as usize] ^= 0x10;
    let damaged = ShardReader::open(write_file(dir.path(), "damaged.lts", &shard.bytes)).unwrap();
    for threads in [1, 2, 3, 8] {
        let mut row = vec![0xEE; data.len()];
        let mut batch = [BatchRead {
            reader: &intact,
            index: 0,
            dst: &mut row,
            result: None,
        }];
        read_batch(&mut batch, "hidden_states", true, threads);
        let placed = batch[0].result.take().unwrap().unwrap();
        assert_eq!(placed.placed, Some(0), "{threads} threads");
        assert!(
            row == data,
            "{threads} threads: the data does not come back"
        );

        let mut row = vec![0xEE; data.len()];
        let mut batch = [BatchRead {
            reader: &damaged,
            index: 0,
            dst: &mut row,
            result: None,
        }];
        read_batch(&mut batch, "hidden_states", true, threads);
        match batch[0].result.take().unwrap() {
            Err(Error::CorruptRecord { reason, .. }) => {
                assert!(
                    reason.starts_with("payload checksum mismatch"),
                    "{threads} threads: {reason}"
                );
            }
            other => panic!("{threads} threads: a flipped byte read as {other:?}"),
        }
    }
}
