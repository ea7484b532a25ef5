//! The writer with `direct: true` (O_DIRECT through aligned bounce buffers, the partial last
//! block through the page cache): same files as without, records reported only once all their
//! bytes are in the file, nothing past the last frame, and a page cache that stays coherent
//! with what is on the disk. Run on the test's temporary directory's file system (ext4 here);
//! where that refuses O_DIRECT the writer falls back, and the tests check that it says so.

mod writer_support;

use layertap_core::format::{self, FileHeader, FrameHeader};
use layertap_core::writer::{Completion, Durability, IoMode, ShardWriter, WriterConfig};
use layertap_core::Codec;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use writer_support::*;

/// Whether `dir`'s file system takes O_DIRECT (what the writer should report in `stats`).
fn takes_o_direct(dir: &Path) -> bool {
    let probe = dir.join("probe");
    let ok = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_DIRECT)
        .open(&probe)
        .is_ok();
    let _ = std::fs::remove_file(&probe);
    if !ok {
        eprintln!(
            "NOTE: {} refuses O_DIRECT; the writer falls back to buffered writes",
            dir.display()
        );
    }
    ok
}

fn direct_config(io: IoMode, codec: Codec) -> WriterConfig {
    WriterConfig {
        direct: true,
        ..config(io, codec)
    }
}

/// Record `i` of the tests: sizes from a few hundred bytes to several chunks of 64 KiB, never
/// a multiple of the 4 KiB block.
fn sized(i: u64) -> (u64, u64) {
    let tokens = match i % 7 {
        0 => 700 + i, // ~90 KiB: more than a batch
        3 => 3,       // a few hundred bytes
        _ => 20 + i * 3,
    };
    (tokens, 32)
}

fn write_records(w: &ShardWriter, n: u64, flush_every: u64) -> Vec<Completion> {
    let mut done = Vec::new();
    for i in 0..n {
        let (tokens, hidden) = sized(i);
        w.submit(record(&format!("k{i}"), tokens, hidden, i))
            .unwrap();
        if flush_every > 0 && i % flush_every == flush_every - 1 {
            w.flush().unwrap();
        }
        done.extend(w.poll().unwrap());
    }
    w.close().unwrap();
    done.extend(w.poll().unwrap());
    done
}

fn check_records(dir: &Path, n: u64) {
    let recs = read_records(dir);
    assert_eq!(recs.len() as u64, n);
    for (i, r) in recs.iter().enumerate() {
        let (tokens, hidden) = sized(i as u64);
        assert_eq!(r.key, format!("k{i}"));
        assert_eq!(
            r.tensors,
            record_tensors(tokens, hidden, i as u64),
            "record {i}"
        );
    }
}

#[test]
fn every_codec_round_trips_with_rotation_on_both_backends() {
    for io in io_modes() {
        for codec in Codec::ALL {
            let dir = tempfile::tempdir().unwrap();
            let cfg = WriterConfig {
                shard_size: 300 << 10,
                ..direct_config(io, codec)
            };
            let w = ShardWriter::open(dir.path(), cfg).unwrap();
            assert_eq!(
                w.stats().unwrap().direct,
                takes_o_direct(dir.path()),
                "{io:?} {codec}"
            );
            let done = write_records(&w, 60, 9);
            assert_eq!(
                done.iter().map(|c| c.seq).collect::<Vec<_>>(),
                (0..60).collect::<Vec<_>>()
            );
            let shards = read_dir(dir.path());
            assert!(shards.len() >= 2, "{io:?} {codec}: rotated");
            assert!(
                shards.iter().all(|s| s.index.is_some()),
                "every shard complete"
            );
            assert_eq!(w.stats().unwrap().shards_closed, shards.len() as u64);
            check_records(dir.path(), 60);
        }
    }
}

#[test]
fn direct_and_buffered_write_the_same_bytes() {
    for io in io_modes() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        for (dir, direct) in [(&a, true), (&b, false)] {
            let writer_id = Some("w".to_string());
            let cfg = WriterConfig {
                direct,
                writer_id,
                shard_size: 200 << 10,
                ..config(io, Codec::None)
            };
            write_records(&ShardWriter::open(dir.path(), cfg).unwrap(), 40, 5);
        }
        let (pa, pb) = (shard_paths(a.path()), shard_paths(b.path()));
        assert!(pa.len() >= 2 && pa.len() == pb.len());
        for (x, y) in pa.iter().zip(&pb) {
            let (x, y) = (std::fs::read(x).unwrap(), std::fs::read(y).unwrap());
            // Headers differ only in shard_id and creation time (same length); frames, index and
            // trailer are the same bytes.
            let hx = FileHeader::decode(&x).unwrap().1 as usize;
            assert_eq!(FileHeader::decode(&y).unwrap().1 as usize, hx);
            assert!(x[hx..] == y[hx..], "{io:?}: same frames, index and trailer");
        }
    }
}

/// Every completion means the record's frame is in the file, whole and valid, although it
/// ends inside a block that no direct write has covered yet; and nothing lies past it.
#[test]
fn records_are_reported_once_their_bytes_are_in_the_file() {
    for io in io_modes() {
        let dir = tempfile::tempdir().unwrap();
        let w = ShardWriter::open(dir.path(), direct_config(io, Codec::Zstd)).unwrap();
        for i in 0..25u64 {
            let (tokens, hidden) = sized(i);
            w.submit(record(&format!("k{i}"), tokens, hidden, i))
                .unwrap();
            let got = w
                .poll_wait(Some(std::time::Duration::from_secs(30)))
                .unwrap();
            assert_eq!(
                got.len(),
                1,
                "{io:?}: record {i} is reported without waiting for more"
            );
            let c = &got[0];
            assert_eq!(c.key, format!("k{i}"));
            let bytes = std::fs::read(&c.shard).unwrap();
            let h = FrameHeader::decode(&bytes[c.offset as usize..]).unwrap();
            let end = (c.offset + h.frame_len()) as usize;
            assert_eq!(
                bytes.len(),
                end,
                "{io:?}: the file ends with record {i}'s frame"
            );
            let payload =
                &bytes[c.offset as usize + h.header_len() as usize..][..h.stored_len as usize];
            assert_eq!(format::crc32c(payload), h.payload_crc, "{io:?}: record {i}");
        }
        w.close().unwrap();
        check_records(dir.path(), 25);
    }
}

#[test]
fn durability_modes_with_direct_io() {
    for durability in [
        Durability::None,
        Durability::OnClose,
        Durability::EveryBytes(100 << 10),
    ] {
        for io in io_modes() {
            let dir = tempfile::tempdir().unwrap();
            let cfg = WriterConfig {
                durability,
                shard_size: 250 << 10,
                ..direct_config(io, Codec::Bp16Zstd)
            };
            write_records(&ShardWriter::open(dir.path(), cfg).unwrap(), 30, 4);
            check_records(dir.path(), 30);
        }
    }
}

/// Reads `path` with O_DIRECT: what the disk holds, bypassing the page cache.
fn read_from_disk(path: &Path) -> Vec<u8> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap();
    let len = f.metadata().unwrap().len() as usize;
    let layout =
        std::alloc::Layout::from_size_align(len.next_multiple_of(4096).max(4096), 4096).unwrap();
    // SAFETY: a non-empty layout; freed below with the same layout.
    let buf = unsafe { std::alloc::alloc_zeroed(layout) };
    let mut got = 0;
    while got < len {
        // SAFETY: `buf` holds `layout.size()` bytes; the read stays inside it (whole blocks at a
        // block-aligned offset and address).
        let n = unsafe {
            libc::pread(
                f.as_raw_fd(),
                buf.add(got).cast(),
                layout.size() - got,
                got as libc::off_t,
            )
        };
        assert!(n > 0, "{}", std::io::Error::last_os_error());
        got += n as usize;
    }
    // SAFETY: `len` bytes were read into `buf`, which lives until the dealloc below.
    let out = unsafe { std::slice::from_raw_parts(buf, len) }.to_vec();
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(buf, layout) };
    out
}

/// Small records and flushes make the writer alternate buffered tail writes and direct writes
/// over the same blocks. After closing (fsync), the disk must hold exactly what the page cache
/// shows, and after the file's pages are dropped, the shards still read back exactly.
#[test]
fn page_cache_and_disk_agree_after_mixed_writes() {
    for io in io_modes() {
        let dir = tempfile::tempdir().unwrap();
        if !takes_o_direct(dir.path()) {
            continue; // noted; nothing direct to check
        }
        let cfg = WriterConfig {
            shard_size: 400 << 10,
            ..direct_config(io, Codec::None)
        };
        let w = ShardWriter::open(dir.path(), cfg).unwrap();
        for i in 0..80u64 {
            let (tokens, hidden) = sized(i);
            w.submit(record(&format!("k{i}"), tokens, hidden, i))
                .unwrap();
            if i % 3 == 0 {
                w.flush().unwrap(); // a tail write now, rewritten by the next direct write
            }
            // Readers read the shard through the page cache while it is written.
            for p in shard_paths(dir.path()) {
                let _ = std::fs::read(p).unwrap();
            }
        }
        w.close().unwrap();
        for p in shard_paths(dir.path()) {
            let cached = std::fs::read(&p).unwrap();
            assert_eq!(
                read_from_disk(&p),
                cached,
                "{io:?}: {} on disk and in the page cache",
                p.display()
            );
            let f = std::fs::File::open(&p).unwrap();
            // SAFETY: plain system call on a descriptor we own, open for the whole call.
            let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
            assert_eq!(rc, 0);
        }
        check_records(dir.path(), 80);
    }
}
