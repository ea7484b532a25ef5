//! The reader returns what was written: complete shards (index), open shards (scan), torn tails,
//! private mappings, growing files, files that are not shards.

mod reader_common;

use layertap_core::codec::Codec;
use layertap_core::reader::{is_being_written, Problem, ShardReader, MAP_MIN_BYTES};
use layertap_core::Error;
use reader_common::*;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;

fn assert_reads_back(r: &ShardReader, shard: &BuiltShard, count: usize) {
    assert_eq!(r.entries(), &shard.entries[..count]);
    for i in 0..count {
        assert_eq!(&*r.raw(i, true).unwrap(), &shard.raws[i][..], "raw({i})");
        assert_eq!(
            &*r.raw(i, false).unwrap(),
            &shard.raws[i][..],
            "raw({i}, verify=false)"
        );
        let rec = r.read(i, true).unwrap();
        assert_eq!(rec.bytes.as_slice(), &shard.raws[i][..], "read({i})");
        assert_eq!(rec.key, shard.entries[i].key);
        assert_eq!(rec.offset, shard.entries[i].frame_offset);
        assert_eq!(rec.header.metadata["key"], shard.entries[i].key);
        r.check(i).unwrap();
    }
}

#[test]
fn complete_shard_reads_back_through_its_index() {
    let dir = tempfile::tempdir().unwrap();
    let shard = build_shard(&mixed_records(), true);
    let path = write_file(dir.path(), "w-000000.lts", &shard.bytes);
    let r = ShardReader::open(&path).unwrap();
    assert!(r.is_complete());
    assert!(!r.index_unusable());
    assert_eq!(r.problems(), &[]);
    assert_eq!(r.torn_tail_bytes(), 0);
    assert_eq!(r.meta_json(), shard.meta_json);
    assert_eq!(r.shard_id(), [0x5a; 16]);
    assert_eq!(r.header_len(), shard.header_len);
    assert_eq!(r.file_len(), shard.bytes.len() as u64);
    assert_eq!(r.data_end(), shard.data_end);
    assert_eq!(r.path(), path);
    assert_reads_back(&r, &shard, 5);
}

#[test]
fn tensors_are_where_the_header_says() {
    let dir = tempfile::tempdir().unwrap();
    let specs = mixed_records();
    let shard = build_shard(&specs, true);
    let r = ShardReader::open(write_file(dir.path(), "s.lts", &shard.bytes)).unwrap();
    for (i, spec) in specs.iter().enumerate() {
        let rec = r.read(i, true).unwrap();
        let got: Vec<_> = rec
            .header
            .tensors
            .iter()
            .map(|t| {
                (
                    t.spec.name.clone(),
                    t.spec.dtype,
                    t.spec.shape.clone(),
                    rec.tensor_data(t).to_vec(),
                )
            })
            .collect();
        assert_eq!(got, spec.tensors, "record {i}");
        assert_eq!(rec.header.metadata.get("model"), spec.metadata.get("model"));
    }
}

#[test]
fn open_shard_is_scanned() {
    let dir = tempfile::tempdir().unwrap();
    let shard = build_shard(&mixed_records(), false);
    let r = ShardReader::open(write_file(dir.path(), "s.lts", &shard.bytes)).unwrap();
    assert!(!r.is_complete());
    assert!(!r.index_unusable());
    assert_eq!(r.problems(), &[]);
    assert_eq!(r.torn_tail_bytes(), 0);
    assert_eq!(r.data_end(), shard.data_end);
    assert_reads_back(&r, &shard, 5);
}

#[test]
fn torn_tail_is_measured_and_never_returned() {
    let dir = tempfile::tempdir().unwrap();
    let shard = build_shard(&mixed_records(), false);
    // The last record's frame cut in its payload, as a writer that died mid-write leaves it.
    let cut = shard.payload_offsets[4] as usize + 3;
    let path = write_file(dir.path(), "s.lts", &shard.bytes[..cut]);
    let r = ShardReader::open(&path).unwrap();
    let torn = (cut as u64) - shard.entries[4].frame_offset;
    assert_eq!(r.torn_tail_bytes(), torn);
    assert_eq!(
        r.problems(),
        &[Problem::TornTail {
            offset: shard.entries[4].frame_offset,
            len: torn
        }]
    );
    assert_eq!(r.problems()[0].kind(), "torn_tail");
    assert_reads_back(&r, &shard, 4);

    // Garbage that is not even a frame header is a torn tail too.
    let mut bytes = shard.bytes.clone();
    bytes.extend_from_slice(&[0xee; 13]);
    let r = ShardReader::open(write_file(dir.path(), "g.lts", &bytes)).unwrap();
    assert_eq!(r.torn_tail_bytes(), 13);
    assert_reads_back(&r, &shard, 5);
}

#[test]
fn empty_shards() {
    let dir = tempfile::tempdir().unwrap();
    for complete in [false, true] {
        let shard = build_shard(&[], complete);
        let r = ShardReader::open(write_file(dir.path(), "e.lts", &shard.bytes)).unwrap();
        assert_eq!(r.is_complete(), complete);
        assert!(r.is_empty());
        assert_eq!(r.problems(), &[]);
        assert!(matches!(r.raw(0, true), Err(Error::NotFound(_))));
        assert!(matches!(r.read(0, true), Err(Error::NotFound(_))));
        assert!(matches!(r.check(0), Err(Error::NotFound(_))));
    }
}

#[test]
fn large_none_records_get_a_private_mapping() {
    let dir = tempfile::tempdir().unwrap();
    let shard = build_shard(&mixed_records(), true);
    let path = write_file(dir.path(), "s.lts", &shard.bytes);
    let r = ShardReader::open(&path).unwrap();
    assert!(shard.entries[3].stored_len >= MAP_MIN_BYTES);
    let rec = r.read(3, true).unwrap();
    assert!(rec.bytes.is_mapped());
    assert!(
        !r.read(0, true).unwrap().bytes.is_mapped(),
        "small records are copied"
    );
    assert!(
        !r.read(1, true).unwrap().bytes.is_mapped(),
        "decoded records are buffers"
    );
    // Writing into the record changes neither the file nor what later reads return.
    // SAFETY: `rec.bytes` lives until the end of the test and no slice of it is alive here.
    unsafe { std::ptr::write_bytes(rec.bytes.as_mut_ptr(), 0xff, rec.bytes.len()) };
    assert!(rec.bytes.as_slice().iter().all(|&b| b == 0xff));
    assert_eq!(std::fs::read(&path).unwrap(), shard.bytes);
    assert_eq!(
        r.read(3, true).unwrap().bytes.as_slice(),
        &shard.raws[3][..]
    );
    assert_eq!(&*r.raw(3, true).unwrap(), &shard.raws[3][..]);
    // The record outlives the reader.
    drop(r);
    assert_eq!(rec.bytes.len(), shard.raws[3].len());
}

#[test]
fn a_growing_file_is_read_as_it_was_when_opened() {
    let dir = tempfile::tempdir().unwrap();
    let shard = build_shard(&mixed_records(), false);
    let first = shard.frame_end(1) as usize;
    let path = write_file(dir.path(), "s.lts", &shard.bytes[..first + 20]);
    let r = ShardReader::open(&path).unwrap();
    assert_eq!(r.len(), 2);
    // The writer goes on while the reader is open.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    f.write_all(&shard.bytes[first + 20..]).unwrap();
    assert_eq!(r.len(), 2);
    assert_eq!(r.file_len(), first as u64 + 20);
    assert_reads_back(&r, &shard, 2);
    let again = ShardReader::open(&path).unwrap();
    assert_reads_back(&again, &shard, 5);
}

#[test]
fn being_written_follows_the_lock() {
    let dir = tempfile::tempdir().unwrap();
    let shard = build_shard(&mixed_records(), false);
    let path = write_file(dir.path(), "s.lts", &shard.bytes);
    assert!(!is_being_written(&path).unwrap());
    let r = ShardReader::open(&path).unwrap();
    assert!(!r.is_being_written().unwrap());
    // A writer's lock: another open file holding LOCK_EX.
    let writer = File::open(&path).unwrap();
    // SAFETY: flock only reads the descriptor, which `writer` keeps open.
    let rc = unsafe { libc::flock(writer.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    assert_eq!(rc, 0);
    assert!(is_being_written(&path).unwrap());
    assert!(r.is_being_written().unwrap());
    drop(writer);
    assert!(!is_being_written(&path).unwrap());
    assert!(matches!(
        is_being_written(dir.path().join("missing.lts")),
        Err(Error::Io { .. })
    ));
}

#[test]
fn files_that_are_not_shards() {
    let dir = tempfile::tempdir().unwrap();
    let good = build_shard(&mixed_records(), true).bytes;
    let mut cases: Vec<(&str, Vec<u8>, &str)> = vec![
        // Prefixes of a header: torn empty shards (recover removes them).
        ("empty", vec![], "torn empty shard"),
        (
            "text",
            b"hello, this is not a shard at all, not even close".to_vec(),
            "magic",
        ),
        ("magic only", good[..8].to_vec(), "torn empty shard"),
        ("cut header", good[..40].to_vec(), "torn empty shard"),
    ];
    let mut v2 = good.clone();
    v2[8] = 2;
    cases.push(("version 2", v2, "version 2"));
    let mut flags = good.clone();
    flags[10] = 1;
    cases.push(("flags", flags, "flags"));
    let mut crc = good;
    crc[40] ^= 4;
    cases.push(("header crc", crc, "checksum"));
    let not_object = layertap_core::format::FileHeader {
        shard_id: [1; 16],
        meta_json: "[1, 2]".into(),
    }
    .encode();
    cases.push(("meta array", not_object, "JSON object"));
    for (name, bytes, reason) in cases {
        let path = write_file(dir.path(), "x.lts", &bytes);
        match ShardReader::open(&path) {
            Err(Error::NotAShard { path: p, reason: r }) => {
                assert_eq!(p, path, "{name}");
                assert!(r.contains(reason), "{name}: {r}");
            }
            other => panic!("{name}: {other:?}"),
        }
    }
    assert!(matches!(
        ShardReader::open(dir.path()),
        Err(Error::NotAShard { .. })
    ));
    match ShardReader::open(dir.path().join("missing.lts")) {
        Err(e @ Error::Io { .. }) => assert_eq!(e.raw_os_error(), Some(libc::ENOENT)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn codec_none_length_mismatch_is_corrupt() {
    // A frame that claims raw_len != stored_len for codec none (a broken writer).
    let dir = tempfile::tempdir().unwrap();
    let mut shard = build_shard(&[RecordSpec::sample("k", Codec::None, 2, 0)], false);
    let at = shard.entries[0].frame_offset as usize;
    let mut h = layertap_core::format::FrameHeader::decode(&shard.bytes[at..]).unwrap();
    h.raw_len += 8;
    let enc = h.encode();
    shard.bytes[at..at + enc.len()].copy_from_slice(&enc);
    let r = ShardReader::open(write_file(dir.path(), "s.lts", &shard.bytes)).unwrap();
    assert_eq!(r.len(), 1);
    for res in [
        r.raw(0, true).map(drop),
        r.read(0, true).map(drop),
        r.check(0),
    ] {
        match res {
            Err(Error::CorruptRecord {
                offset,
                key,
                reason,
                ..
            }) => {
                assert_eq!(offset, at as u64);
                assert_eq!(key.as_deref(), Some("k"));
                assert!(reason.contains("decoded"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn large_records_read_into_memory_other_records_left_hold_their_own_bytes() {
    // `read` decodes a compressed record of at least MAP_MIN_BYTES into memory that a dropped
    // record left, its bytes still there: each must come back whole, header included.
    let mut records = Vec::new();
    for (i, tokens) in [3000u64, 12_000, 2100, 6000].into_iter().enumerate() {
        for codec in [Codec::Zstd, Codec::Bp16Zstd, Codec::ExpHuf] {
            let key = format!("r{i}-{codec}");
            records.push(RecordSpec::sample(&key, codec, tokens, i as u64 + 1));
        }
    }
    let shard = build_shard(&records, true);
    assert!(shard
        .raws
        .iter()
        .all(|raw| raw.len() as u64 >= MAP_MIN_BYTES));
    let dir = tempfile::tempdir().unwrap();
    let r = ShardReader::open(write_file(dir.path(), "big.lts", &shard.bytes)).unwrap();
    let order: Vec<usize> = (0..records.len()).chain((0..records.len()).rev()).collect();
    for i in order {
        let rec = r.read(i, true).unwrap();
        assert_eq!(rec.bytes.as_slice(), &shard.raws[i][..], "read({i})");
    }
}
