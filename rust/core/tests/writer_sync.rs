//! The `fsync`s of the durability policies, done on the writer's sync thread: many shards with
//! durability `OnClose` and every N bytes, both I/O backends, with and without direct I/O;
//! `flush` and `close` return only once the syncs handed to that thread are done (a shard is
//! counted closed only after its `fsync`; its lock is released before, once its trailer is
//! written).
//!
//! That the I/O thread no longer waits for an `fsync` shows only on a disk where one is slow
//! (benches/bench_writer.py prints the longest gap between completions); an `fsync` error is
//! tested on the sync thread itself (`writer::sync`), since no file system here fails one on a
//! regular file on demand.

mod writer_support;

use layertap_core::reader::{is_being_written, ShardReader};
use layertap_core::recover::recover;
use layertap_core::writer::{Durability, IoMode, ShardWriter, WriterConfig};
use layertap_core::Codec;
use std::path::Path;
use writer_support::*;

const POLICIES: [Durability; 2] = [Durability::OnClose, Durability::EveryBytes(8 << 10)];

fn sync_config(io: IoMode, durability: Durability, direct: bool) -> WriterConfig {
    WriterConfig {
        durability,
        direct,
        shard_size: 24 << 10,
        ..config(io, Codec::Zstd)
    }
}

/// Every shard in `dir` is complete, verified by the crate's reader and unlocked; returns the
/// keys in dataset order.
fn check_complete(dir: &Path) -> Vec<String> {
    let mut keys = Vec::new();
    for path in shard_paths(dir) {
        assert!(
            !is_being_written(&path).unwrap(),
            "{path:?} is still locked"
        );
        let reader = ShardReader::open(&path).unwrap();
        assert!(reader.is_complete(), "{path:?} has no footer");
        assert!(
            reader.problems().is_empty(),
            "{path:?}: {:?}",
            reader.problems()
        );
        for i in 0..reader.len() {
            let rec = reader.read(i, true).unwrap(); // checks the CRC and decodes
            keys.push(rec.key.clone());
        }
    }
    keys
}

#[test]
fn many_shards_are_complete_and_synced_after_close() {
    let modes = io_modes();
    eprintln!("backends tested: {}", modes.len());
    for io in modes {
        for durability in POLICIES {
            for direct in [false, true] {
                let what = format!("{io:?} {durability:?} direct={direct}");
                let dir = tempfile::tempdir().unwrap();
                let w = ShardWriter::open(dir.path(), sync_config(io, durability, direct)).unwrap();
                let mut done = Vec::new();
                for i in 0..300u64 {
                    w.submit(record(&format!("k{i}"), 1 + i % 9, 96, i))
                        .unwrap();
                    if i % 37 == 0 {
                        done.extend(w.poll().unwrap());
                    }
                }
                w.close().unwrap();
                done.extend(w.poll().unwrap());
                assert_eq!(
                    done.iter().map(|c| c.seq).collect::<Vec<_>>(),
                    (0..300).collect::<Vec<_>>()
                );
                let shards = shard_paths(dir.path());
                assert!(shards.len() > 20, "{what}: {} shards", shards.len());
                let stats = w.stats().unwrap();
                assert_eq!(stats.records_written, 300, "{what}");
                assert_eq!(
                    stats.shards_closed,
                    shards.len() as u64,
                    "{what}: close waits for every fsync"
                );
                let keys = check_complete(dir.path());
                assert_eq!(
                    keys,
                    (0..300).map(|i| format!("k{i}")).collect::<Vec<_>>(),
                    "{what}"
                );
                // The independent strict reader agrees, payload by payload.
                for (i, r) in read_records(dir.path()).iter().enumerate() {
                    let i = i as u64;
                    assert_eq!(r.tensors, record_tensors(1 + i % 9, 96, i), "{what}");
                }
            }
        }
    }
}

#[test]
fn flush_waits_for_the_syncs_of_closed_shards() {
    for io in io_modes() {
        for durability in POLICIES {
            let dir = tempfile::tempdir().unwrap();
            let cfg = WriterConfig {
                writer_id: Some("w".into()),
                ..sync_config(io, durability, false)
            };
            let w = ShardWriter::open(dir.path(), cfg).unwrap();
            for round in 0..3u64 {
                for i in 0..60u64 {
                    let n = round * 60 + i;
                    w.submit(record(&format!("k{n}"), 1 + n % 9, 96, n))
                        .unwrap();
                }
                w.flush().unwrap();
                let shards = shard_paths(dir.path());
                let (open, closed) = shards.split_last().unwrap();
                // Every shard but the open one was handed to the sync thread, which synced,
                // closed and counted it before it answered the flush.
                assert_eq!(
                    w.stats().unwrap().shards_closed,
                    closed.len() as u64,
                    "{io:?} {durability:?}"
                );
                for path in closed {
                    assert!(
                        !is_being_written(path).unwrap(),
                        "{path:?} still locked after flush"
                    );
                    assert!(ShardReader::open(path).unwrap().is_complete());
                }
                assert!(
                    is_being_written(open).unwrap(),
                    "the open shard stays locked"
                );
            }
            assert_eq!(w.poll().unwrap().len(), 180);
            w.close().unwrap();
            assert_eq!(
                w.stats().unwrap().shards_closed,
                shard_paths(dir.path()).len() as u64
            );
            assert_eq!(check_complete(dir.path()).len(), 180);
        }
    }
}

/// A shard is unlocked once its trailer is written, not after its `fsync` on the sync thread:
/// when the first record of a shard is reported, every shard before it is complete, free of
/// its lock, and `recover` leaves it as it is (it refused it while the `fsync` ran).
#[test]
fn a_complete_shard_is_unlocked_before_its_fsync() {
    for io in io_modes() {
        for durability in POLICIES {
            let what = format!("{io:?} {durability:?}");
            let dir = tempfile::tempdir().unwrap();
            let cfg = WriterConfig {
                writer_id: Some("w".into()),
                ..sync_config(io, durability, false)
            };
            let w = ShardWriter::open(dir.path(), cfg).unwrap();
            let mut newest = None;
            for n in 0..60u64 {
                w.submit(record(&format!("k{n}"), 1 + n % 9, 96, n))
                    .unwrap();
                let mut done = Vec::new();
                while done.is_empty() {
                    done = w
                        .poll_wait(Some(std::time::Duration::from_secs(30)))
                        .unwrap();
                }
                let shard = done.last().unwrap().shard.clone();
                if newest.as_ref() == Some(&shard) {
                    continue;
                }
                // The first record of a new shard: the ones before it were just completed.
                for path in shard_paths(dir.path()).iter().filter(|p| **p < shard) {
                    assert!(!is_being_written(path).unwrap(), "{what}: {path:?} locked");
                    let report = recover(path).unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert!(report.was_complete, "{what}: {path:?}");
                }
                newest = Some(shard);
            }
            assert!(shard_paths(dir.path()).len() > 3, "{what}");
            w.close().unwrap();
            assert_eq!(check_complete(dir.path()).len(), 60, "{what}");
        }
    }
}

/// A writer dropped without `close` still completes and syncs every shard before the drop
/// returns (it closes), and a second writer on the same id continues the numbering.
#[test]
fn drop_completes_the_shards_and_a_new_writer_continues() {
    for io in io_modes() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = || WriterConfig {
            writer_id: Some("w".into()),
            ..sync_config(io, Durability::OnClose, false)
        };
        for part in 0..2u64 {
            let w = ShardWriter::open(dir.path(), cfg()).unwrap();
            for i in 0..50u64 {
                let n = part * 50 + i;
                w.submit(record(&format!("k{n}"), 1 + n % 9, 96, n))
                    .unwrap();
            }
            drop(w);
            assert_eq!(check_complete(dir.path()).len() as u64, 50 * (part + 1));
        }
    }
}
