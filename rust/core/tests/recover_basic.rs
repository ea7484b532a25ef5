//! `recover` turns an open shard into exactly the complete shard its valid records make, keeps
//! everything before the end of the last valid frame, is idempotent, and keeps off shards that
//! are locked, complete or not shards.

mod reader_common;

use layertap_core::codec::Codec;
use layertap_core::format::FILE_HEADER_FIXED_LEN;
use layertap_core::reader::{Problem, ShardReader};
use layertap_core::recover::recover;
use layertap_core::Error;
use reader_common::*;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;

fn records() -> Vec<RecordSpec> {
    vec![
        RecordSpec::sample("r-0", Codec::Zstd, 3, 0),
        RecordSpec::sample("r-1", Codec::None, 2, 1),
        RecordSpec::sample("r-2", Codec::Bp16Zstd, 4, 2),
    ]
}

/// Recovering again changes nothing and reports the shard complete.
fn assert_idempotent(path: &Path, records: u64) {
    let before = std::fs::read(path).unwrap();
    let again = recover(path).unwrap();
    assert!(again.was_complete);
    assert_eq!((again.records, again.truncated_bytes), (records, 0));
    assert_eq!(again.problems, vec![]);
    assert_eq!(std::fs::read(path).unwrap(), before);
}

#[test]
fn torn_tail_is_cut_and_the_footer_written() {
    let dir = tempfile::tempdir().unwrap();
    let recs = records();
    let open = build_shard(&recs, false);
    let mut bytes = open.bytes.clone();
    bytes.extend_from_slice(
        &build_shard(&[RecordSpec::sample("r-3", Codec::None, 9, 3)], false).bytes[200..300],
    );
    let path = write_file(dir.path(), "s.lts", &bytes);
    let report = recover(&path).unwrap();
    assert_eq!(report.path, path);
    assert!(!report.was_complete);
    assert_eq!(report.records, 3);
    assert_eq!(report.truncated_bytes, 100);
    assert_eq!(report.problems, vec![]);
    // Byte for byte the shard a writer would have closed.
    assert_eq!(
        std::fs::read(&path).unwrap(),
        build_shard(&recs, true).bytes
    );
    let r = ShardReader::open(&path).unwrap();
    assert!(r.is_complete());
    for i in 0..3 {
        assert_eq!(r.read(i, true).unwrap().bytes.as_slice(), &open.raws[i][..]);
    }
    assert_idempotent(&path, 3);
}

#[test]
fn recovery_after_a_cut_at_every_offset() {
    // Also covers an interrupted recovery: cuts inside the footer are what a recovery (or a
    // writer closing the shard) killed while appending it leaves behind.
    let dir = tempfile::tempdir().unwrap();
    let recs = records();
    let full = build_shard(&recs, true);
    let header_end = (FILE_HEADER_FIXED_LEN + full.meta_json.len() + 4) as u64;
    for cut in header_end..=full.bytes.len() as u64 {
        let path = write_file(dir.path(), "s.lts", &full.bytes[..cut as usize]);
        let present = (0..recs.len())
            .filter(|&i| full.frame_end(i) <= cut)
            .count();
        let want = build_shard(&recs[..present], true);
        let report = recover(&path).unwrap_or_else(|e| panic!("cut at {cut}: {e}"));
        assert_eq!(
            report.was_complete,
            cut == full.bytes.len() as u64,
            "cut at {cut}"
        );
        assert_eq!(report.records, present as u64, "cut at {cut}");
        if !report.was_complete {
            assert_eq!(
                report.truncated_bytes,
                cut.saturating_sub(want.data_end),
                "cut at {cut}"
            );
        }
        assert_eq!(std::fs::read(&path).unwrap(), want.bytes, "cut at {cut}");
        assert_idempotent(&path, present as u64);
    }
}

#[test]
fn corrupt_records_and_damaged_regions_stay_unindexed() {
    let dir = tempfile::tempdir().unwrap();
    let recs = vec![
        RecordSpec::sample("a", Codec::None, 2, 0),
        RecordSpec::sample("b", Codec::Zstd, 2, 1),
        RecordSpec::sample("c", Codec::None, 2, 2),
        RecordSpec::sample("d", Codec::Zstd, 2, 3),
        RecordSpec::sample("e", Codec::None, 2, 4),
    ];
    let shard = build_shard(&recs, false);
    let mut bytes = shard.bytes.clone();
    bytes[shard.payload_offsets[1] as usize + 5] ^= 0x10; // corrupt record "b"
    let (start, end) = (shard.entries[3].frame_offset, shard.frame_end(3));
    bytes[start as usize..end as usize].fill(0); // record "d" lost
    let path = write_file(dir.path(), "s.lts", &bytes);
    let report = recover(&path).unwrap();
    assert_eq!(report.records, 3);
    assert_eq!(report.truncated_bytes, 0);
    assert_eq!(report.problems.len(), 2);
    assert!(
        matches!(&report.problems[0], Problem::CorruptRecord { offset, key, .. } if *offset == shard.entries[1].frame_offset && key == "b")
    );
    assert_eq!(report.problems[1], Problem::DamagedRegion { start, end });
    let after = std::fs::read(&path).unwrap();
    assert_eq!(
        &after[..bytes.len()],
        &bytes[..],
        "recovery never changes the bytes before the footer"
    );
    let r = ShardReader::open(&path).unwrap();
    assert!(r.is_complete());
    assert_eq!(
        r.lost_in_recovery(),
        2,
        "the trailer keeps what was left out"
    );
    let keys: Vec<_> = r.entries().iter().map(|e| e.key.as_str()).collect();
    assert_eq!(keys, ["a", "c", "e"]);
    for (pos, i) in [0, 2, 4].into_iter().enumerate() {
        assert_eq!(
            r.read(pos, true).unwrap().bytes.as_slice(),
            &shard.raws[i][..]
        );
    }
    assert_idempotent(&path, 3);
}

#[test]
fn a_file_cut_inside_its_header_is_a_torn_empty_shard_and_removed() {
    let dir = tempfile::tempdir().unwrap();
    let full = build_shard(&records(), true);
    let crc_end = FILE_HEADER_FIXED_LEN + full.meta_json.len() + 4;
    for cut in 0..crc_end {
        let path = write_file(dir.path(), "s.lts", &full.bytes[..cut]);
        match ShardReader::open(&path) {
            Err(Error::NotAShard { reason, .. }) => {
                assert!(
                    reason.contains("torn empty shard"),
                    "cut at {cut}: {reason}"
                );
            }
            other => panic!("cut at {cut}: {other:?}"),
        }
        let report = recover(&path).unwrap_or_else(|e| panic!("cut at {cut}: {e}"));
        assert!(report.removed && !report.was_complete, "cut at {cut}");
        assert_eq!((report.records, report.truncated_bytes), (0, cut as u64));
        assert!(!path.exists(), "cut at {cut}");
    }
    // A complete header is not torn: recovery completes the shard, as before.
    let path = write_file(dir.path(), "s.lts", &full.bytes[..crc_end]);
    let report = recover(&path).unwrap();
    assert!(!report.removed && report.records == 0);
    assert!(ShardReader::open(&path).unwrap().is_complete());
}

#[test]
fn a_bad_index_is_rewritten() {
    let dir = tempfile::tempdir().unwrap();
    let full = build_shard(&records(), true);
    let mut bytes = full.bytes.clone();
    bytes[full.data_end as usize + 60] ^= 2; // in the index payload
    let path = write_file(dir.path(), "s.lts", &bytes);
    let report = recover(&path).unwrap();
    assert!(!report.was_complete);
    assert_eq!(report.records, 3);
    assert_eq!(
        report.truncated_bytes,
        full.bytes.len() as u64 - full.data_end
    );
    assert_eq!(report.problems, vec![]);
    assert_eq!(std::fs::read(&path).unwrap(), full.bytes);
}

#[test]
fn complete_shards_are_left_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let full = build_shard(&records(), true);
    let path = write_file(dir.path(), "s.lts", &full.bytes);
    let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    let report = recover(&path).unwrap();
    assert!(report.was_complete);
    assert_eq!((report.records, report.truncated_bytes), (3, 0));
    assert_eq!(std::fs::read(&path).unwrap(), full.bytes);
    assert_eq!(std::fs::metadata(&path).unwrap().modified().unwrap(), mtime);
}

#[test]
fn a_locked_shard_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let open = build_shard(&records(), false);
    let mut bytes = open.bytes;
    bytes.extend_from_slice(&[7; 21]);
    let path = write_file(dir.path(), "s.lts", &bytes);

    // Locked through another open file of this process.
    let writer = File::open(&path).unwrap();
    // SAFETY: flock only reads the descriptor, which `writer` keeps open.
    let rc = unsafe { libc::flock(writer.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    assert_eq!(rc, 0);
    match recover(&path) {
        Err(Error::Locked { path: p }) => assert_eq!(p, path),
        other => panic!("{other:?}"),
    }
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
    drop(writer);

    // Locked by another process, as a live writer holds it.
    let mut child = std::process::Command::new("flock")
        .args([
            "--exclusive",
            "--no-fork",
            path.to_str().unwrap(),
            "sleep",
            "30",
        ])
        .spawn()
        .expect("flock(1) from util-linux");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !layertap_core::reader::is_being_written(&path).unwrap() {
        assert!(
            std::time::Instant::now() < deadline,
            "the child never took the lock"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let refused = recover(&path);
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(matches!(refused, Err(Error::Locked { .. })), "{refused:?}");
    assert_eq!(std::fs::read(&path).unwrap(), bytes);

    // Once the writer is gone the shard is recovered.
    let report = recover(&path).unwrap();
    assert_eq!((report.records, report.truncated_bytes), (3, 21));
}

#[test]
fn files_that_are_not_shards_are_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let text = b"not a shard, but it has some bytes in it".to_vec();
    let path = write_file(dir.path(), "x.lts", &text);
    assert!(matches!(recover(&path), Err(Error::NotAShard { .. })));
    assert_eq!(std::fs::read(&path).unwrap(), text);
    assert!(matches!(
        recover(dir.path().join("missing.lts")),
        Err(Error::Io { .. })
    ));
}
