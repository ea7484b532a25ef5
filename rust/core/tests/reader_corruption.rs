//! A flipped bit anywhere in a shard is detected where the format says it must be: file header
//! (not a shard), frame header and key (a damaged region, or a disagreement with the index),
//! payload (a corrupt record, never returned), index and trailer (the shard is scanned instead).

mod reader_common;

use layertap_core::codec::Codec;
use layertap_core::format::FILE_HEADER_FIXED_LEN;
use layertap_core::reader::{Problem, ShardReader};
use layertap_core::Error;
use reader_common::*;
use std::path::Path;

/// Which part of a shard a byte belongs to.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Region {
    FileHeader,
    /// Bytes no one interprets (header, frame and payload padding).
    Padding,
    FrameHeader(usize),
    Payload(usize),
    Index,
    Trailer,
}

fn region_of(shard: &BuiltShard, at: u64) -> Region {
    let header_end = (FILE_HEADER_FIXED_LEN + shard.meta_json.len() + 4) as u64;
    if at < header_end {
        return Region::FileHeader;
    }
    for (i, e) in shard.entries.iter().enumerate() {
        let key_end = e.frame_offset + 48 + e.key.len() as u64;
        let payload_end = shard.payload_offsets[i] + e.stored_len;
        if (e.frame_offset..key_end).contains(&at) {
            return Region::FrameHeader(i);
        }
        if (shard.payload_offsets[i]..payload_end).contains(&at) {
            return Region::Payload(i);
        }
    }
    let len = shard.bytes.len() as u64;
    if at >= shard.data_end && at < len.saturating_sub(32) {
        return Region::Index;
    }
    if at >= shard.data_end {
        return Region::Trailer;
    }
    Region::Padding
}

fn records() -> Vec<RecordSpec> {
    vec![
        RecordSpec::sample("rec-a", Codec::None, 2, 1),
        RecordSpec::sample("rec-b", Codec::Zstd, 3, 2),
        RecordSpec::sample("rec-c", Codec::Bp16Zstd, 2, 3),
    ]
}

fn expect_corrupt<T: std::fmt::Debug>(
    res: layertap_core::Result<T>,
    path: &Path,
    shard: &BuiltShard,
    i: usize,
) {
    match res {
        Err(Error::CorruptRecord {
            path: p,
            offset,
            key,
            ..
        }) => {
            assert_eq!(p, path);
            assert_eq!(offset, shard.entries[i].frame_offset);
            assert_eq!(key.as_deref(), Some(shard.entries[i].key.as_str()));
        }
        other => panic!("record {i}: expected CorruptRecord, got {other:?}"),
    }
}

/// Every record that reads returns exactly what was written; `broken` lists the original
/// indices of records whose reads (and checks) must fail.
fn check_records(
    r: &ShardReader,
    path: &Path,
    shard: &BuiltShard,
    present: &[usize],
    read_broken: &[usize],
    check_broken: &[usize],
) {
    let want: Vec<_> = present.iter().map(|&i| shard.entries[i].clone()).collect();
    assert_eq!(r.entries(), &want[..]);
    for (pos, &i) in present.iter().enumerate() {
        if read_broken.contains(&i) {
            expect_corrupt(r.read(pos, true), path, shard, i);
            expect_corrupt(r.raw(pos, true), path, shard, i);
        } else {
            assert_eq!(
                r.read(pos, true).unwrap().bytes.as_slice(),
                &shard.raws[i][..]
            );
            assert_eq!(&*r.raw(pos, true).unwrap(), &shard.raws[i][..]);
        }
        if check_broken.contains(&i) {
            expect_corrupt(r.check(pos), path, shard, i);
        } else {
            r.check(pos).unwrap();
        }
    }
}

fn flip_every_byte(complete: bool) {
    let dir = tempfile::tempdir().unwrap();
    let shard = build_shard(&records(), complete);
    let all: Vec<usize> = (0..shard.entries.len()).collect();
    let last = all.len() - 1;
    let len = shard.bytes.len() as u64;
    let mut seen = std::collections::BTreeSet::new();
    for at in 0..len {
        let mut bytes = shard.bytes.clone();
        bytes[at as usize] ^= 1 << (at % 8);
        let path = write_file(dir.path(), "s.lts", &bytes);
        let region = region_of(&shard, at);
        seen.insert(format!("{region:?}"));
        let ctx = format!("flip at {at} ({region:?}, complete={complete})");
        let r = match (region, ShardReader::open(&path)) {
            (Region::FileHeader, Err(Error::NotAShard { .. })) => continue,
            (Region::FileHeader, other) => panic!("{ctx}: {other:?}"),
            (_, res) => res.unwrap_or_else(|e| panic!("{ctx}: {e}")),
        };
        let without = |i: usize| all.iter().copied().filter(|&k| k != i).collect::<Vec<_>>();
        match (region, complete) {
            (Region::Padding, _) => {
                assert_eq!(r.is_complete(), complete, "{ctx}");
                assert_eq!(r.problems(), &[], "{ctx}");
                check_records(&r, &path, &shard, &all, &[], &[]);
            }
            // The index is trusted for positions; the frame header is checked by check().
            (Region::FrameHeader(i), true) => {
                assert!(r.is_complete(), "{ctx}");
                check_records(&r, &path, &shard, &all, &[], &[i]);
            }
            (Region::Payload(i), true) => {
                assert!(r.is_complete(), "{ctx}");
                check_records(&r, &path, &shard, &all, &[i], &[i]);
            }
            (Region::FrameHeader(i), false) => {
                let e = &shard.entries[i];
                let want = if i < last {
                    Problem::DamagedRegion {
                        start: e.frame_offset,
                        end: shard.entries[i + 1].frame_offset,
                    }
                } else {
                    Problem::TornTail {
                        offset: e.frame_offset,
                        len: len - e.frame_offset,
                    }
                };
                assert_eq!(r.problems(), &[want], "{ctx}");
                check_records(&r, &path, &shard, &without(i), &[], &[]);
            }
            (Region::Payload(i), false) => {
                let e = &shard.entries[i];
                let want = if i < last {
                    assert_eq!(r.problems().len(), 1, "{ctx}");
                    assert!(
                        matches!(&r.problems()[0], Problem::CorruptRecord { offset, key, .. }
                        if *offset == e.frame_offset && *key == e.key),
                        "{ctx}: {:?}",
                        r.problems()
                    );
                    r.problems()[0].clone()
                } else {
                    Problem::TornTail {
                        offset: e.frame_offset,
                        len: len - e.frame_offset,
                    }
                };
                assert_eq!(r.problems(), &[want], "{ctx}");
                check_records(&r, &path, &shard, &without(i), &[], &[]);
            }
            (Region::Index | Region::Trailer, _) => {
                assert!(!r.is_complete(), "{ctx}");
                assert!(r.index_unusable(), "{ctx}");
                assert_eq!(r.torn_tail_bytes(), 0, "{ctx}");
                assert!(
                    matches!(r.problems(), [Problem::BadIndex { offset: Some(o), .. }] if *o == shard.data_end),
                    "{ctx}: {:?}",
                    r.problems()
                );
                check_records(&r, &path, &shard, &all, &[], &[]);
            }
            (Region::FileHeader, _) => unreachable!(),
        }
    }
    // File header, padding, each record's frame header and payload, and index and trailer.
    let footer_regions = if complete { 2 } else { 0 };
    assert_eq!(
        seen.len(),
        2 + 2 * all.len() + footer_regions,
        "regions covered: {seen:?}"
    );
}

#[test]
fn flipped_bits_in_a_complete_shard() {
    flip_every_byte(true);
}

#[test]
fn flipped_bits_in_an_open_shard() {
    flip_every_byte(false);
}

#[test]
fn a_payload_whose_key_differs_from_the_frame_is_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    // Write record "other" under the frame key "mine": checksums are right, the key is not.
    let spec = RecordSpec::sample("other", Codec::Zstd, 2, 0);
    let (raw, stored) = spec.encode();
    let h = layertap_core::format::FrameHeader {
        kind: layertap_core::format::FrameKind::Record,
        codec: Codec::Zstd,
        key: "mine".into(),
        stored_len: stored.len() as u64,
        raw_len: raw.len() as u64,
        num_tokens: 2,
        payload_crc: layertap_core::format::crc32c(&stored),
    };
    let mut bytes = build_shard(&[], false).bytes;
    let at = bytes.len() as u64;
    bytes.extend_from_slice(&h.encode());
    bytes.extend_from_slice(&stored);
    bytes.resize((at + h.frame_len()) as usize, 0);
    let path = write_file(dir.path(), "s.lts", &bytes);
    let r = ShardReader::open(&path).unwrap();
    assert_eq!(r.len(), 1);
    for res in [
        r.raw(0, true).map(drop),
        r.read(0, false).map(drop),
        r.check(0),
    ] {
        match res {
            Err(Error::CorruptRecord {
                offset,
                key,
                reason,
                ..
            }) => {
                assert_eq!(offset, at);
                assert_eq!(key.as_deref(), Some("mine"));
                assert!(reason.contains("\"other\""), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_damaged_region_between_records_is_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let shard = build_shard(&records(), false);
    // Zero the whole of record 1, as a lost write leaves it.
    let mut bytes = shard.bytes.clone();
    let (start, end) = (shard.entries[1].frame_offset, shard.frame_end(1));
    bytes[start as usize..end as usize].fill(0);
    let path = write_file(dir.path(), "s.lts", &bytes);
    let r = ShardReader::open(&path).unwrap();
    assert_eq!(r.problems(), &[Problem::DamagedRegion { start, end }]);
    assert_eq!(r.problems()[0].kind(), "damaged_region");
    check_records(&r, &path, &shard, &[0, 2], &[], &[]);
}
