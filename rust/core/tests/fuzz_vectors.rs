//! A mutation fuzzer of the reader that runs on stable Rust (cargo-fuzz needs nightly): files of
//! tests/vectors mutated by proptest (bits flipped, fields set to edge values, ranges cut,
//! repeated, inserted, and checksums made right again so that the mutations reach the decoding
//! behind them), then opened, read, checked, recovered and read again. Nothing may panic, hang
//! (a watchdog allows [`CASE_LIMIT`] a case) or allocate more than the file's size justifies
//! ([`allowed_allocation`]).
//!
//! `LAYERTAP_FUZZ_SECONDS` (default 15) is how long it runs; benches/fuzz/README.md has the long
//! runs. A failure prints the shrunk input, and writes it to `target/fuzz-failure-*.lts`.

use layertap_core::format::{crc32c, crc32c_append, FRAME_MAGIC, TRAILER_LEN, TRAILER_MAGIC};
use layertap_core::reader::{is_torn_empty, ShardReader};
use layertap_core::recover::recover;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// The largest allocation of each thread

struct Tracking;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every call is handed to the system allocator unchanged; the thread-local counter is a
// const-initialised Cell, which neither allocates nor has a destructor.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's layout, as GlobalAlloc::alloc requires.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: `ptr` was allocated by us (so by System) with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by us (so by System) with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

fn note(size: usize) {
    let _ = LARGEST.try_with(|m| m.set(m.get().max(size)));
}

#[global_allocator]
static ALLOCATOR: Tracking = Tracking;

// ---------------------------------------------------------------------------------------------
// Mutations

/// How much longer than its stored payload a record may claim to be once decoded (the reader's
/// `ZSTD_MAX_RATIO`: one 4-byte RLE block of zstd holds 128 KiB).
const ZSTD_MAX_RATIO: u64 = 32 << 10;
/// A case taking longer than this is a hang.
const CASE_LIMIT: Duration = Duration::from_secs(120);

#[derive(Debug, Clone)]
enum Mutation {
    Flip {
        at: usize,
        bit: u8,
    },
    Byte {
        at: usize,
        value: u8,
    },
    /// A little-endian u64/u32/u16 field set to an edge value.
    Field {
        at: usize,
        width: u8,
        value: u64,
    },
    Cut {
        at: usize,
    },
    Remove {
        at: usize,
        len: usize,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    /// Bytes `[from, from + len)` written again at `to` (a frame repeated, moved over another).
    Copy {
        from: usize,
        len: usize,
        to: usize,
    },
    /// Checksums made right again: the mutations before it reach what the checksums protect.
    Repair,
}

fn edge_value() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(7),
        Just(8),
        Just(48),
        Just(255),
        Just(0xFFFF),
        Just(u32::MAX as u64),
        Just(1 << 32),
        Just(1 << 40),
        Just(u64::MAX),
        Just(u64::MAX - 7),
        any::<u64>(),
        0u64..5000,
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), any::<u8>()).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        2 => (any::<usize>(), any::<u8>()).prop_map(|(at, value)| Mutation::Byte { at, value }),
        4 => (any::<usize>(), prop_oneof![Just(2u8), Just(4), Just(8)], edge_value())
            .prop_map(|(at, width, value)| Mutation::Field { at, width, value }),
        1 => any::<usize>().prop_map(|at| Mutation::Cut { at }),
        1 => (any::<usize>(), 1usize..200).prop_map(|(at, len)| Mutation::Remove { at, len }),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..64))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        1 => (any::<usize>(), 1usize..600, any::<usize>())
            .prop_map(|(from, len, to)| Mutation::Copy { from, len, to }),
        3 => Just(Mutation::Repair),
    ]
}

impl Mutation {
    /// Applies the mutation; positions are taken modulo the length, fields at multiples of 4.
    fn apply(&self, b: &mut Vec<u8>) {
        let n = b.len();
        match self {
            Mutation::Repair => repair(b),
            Mutation::Cut { at } => b.truncate(at % (n + 1)),
            Mutation::Insert { at, bytes } => {
                let s = at % (n + 1);
                b.splice(s..s, bytes.iter().copied());
            }
            _ if n == 0 => {}
            Mutation::Flip { at, bit } => b[at % n] ^= 1 << (bit % 8),
            Mutation::Byte { at, value } => b[at % n] = *value,
            Mutation::Field { at, width, value } => {
                let w = *width as usize;
                let s = (at % n) & !3;
                if s + w <= n {
                    b[s..s + w].copy_from_slice(&value.to_le_bytes()[..w]);
                }
            }
            Mutation::Remove { at, len } => {
                let s = at % n;
                b.drain(s..(s + len).min(n));
            }
            Mutation::Copy { from, len, to } => {
                let s = from % n;
                let piece = b[s..(s + len).min(n)].to_vec();
                let t = to % n;
                let end = (t + piece.len()).min(n);
                b[t..end].copy_from_slice(&piece[..end - t]);
            }
        }
    }
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

fn put_crc(b: &mut [u8], at: usize, crc: u32) {
    if let Some(slot) = b.get_mut(at..at + 4) {
        slot.copy_from_slice(&crc.to_le_bytes());
    }
}

/// Recomputes every checksum a writer would have written over the bytes as they are now: the
/// file header's, each frame header's and payload's (frames found at multiples of 8 by their
/// magic), and the trailer's.
fn repair(b: &mut [u8]) {
    if let Some(meta_len) = u32_at(b, 12) {
        let crc_at = 32 + meta_len as usize;
        if crc_at + 4 <= b.len() {
            let crc = crc32c(&b[..crc_at]);
            put_crc(b, crc_at, crc);
        }
    }
    let mut at = 0;
    while at + 48 <= b.len() {
        if b[at..at + 4] == FRAME_MAGIC {
            let key_len = u16::from_le_bytes([b[at + 6], b[at + 7]]) as usize;
            let stored = u64_at(b, at + 8).unwrap_or(0);
            let payload_at = at + (48 + key_len).next_multiple_of(8);
            if let Some(end) = usize::try_from(stored)
                .ok()
                .and_then(|s| payload_at.checked_add(s))
                .filter(|&e| e <= b.len())
            {
                let crc = crc32c(&b[payload_at..end]);
                put_crc(b, at + 28, crc);
            }
            if at + 48 + key_len <= b.len() {
                let crc = crc32c_append(crc32c(&b[at..at + 44]), &b[at + 48..at + 48 + key_len]);
                put_crc(b, at + 44, crc);
            }
        }
        at += 8;
    }
    if b.len() >= TRAILER_LEN && b[b.len() - 8..] == TRAILER_MAGIC {
        let t = b.len() - TRAILER_LEN;
        let crc = crc32c(&b[t..t + 20]);
        put_crc(b, t + 20, crc);
    }
}

// ---------------------------------------------------------------------------------------------
// What is done with each mutated file

/// The most a reader may allocate at once for a file of `file_len` bytes whose records say
/// `raw_lens`: a few times the file, plus a record's decoded size where the stored size allows
/// it (the reader refuses larger ones before allocating).
fn allowed_allocation(file_len: u64, entries: &[(u64, u64)]) -> u64 {
    let decoded = entries
        .iter()
        .filter(|(stored, raw)| *raw <= stored.saturating_mul(ZSTD_MAX_RATIO))
        .map(|(_, raw)| *raw)
        .max()
        .unwrap_or(0);
    4 * file_len + decoded + (1 << 20)
}

/// Opens, reads and checks every record of `path`; returns the records' `(stored, raw)` lengths.
fn read_all(path: &Path) -> Vec<(u64, u64)> {
    let Ok(r) = ShardReader::open(path) else {
        return Vec::new();
    };
    for i in 0..r.len() {
        if let Ok(rec) = r.read(i, true) {
            assert_eq!(rec.header.metadata.get("key"), Some(&r.entries()[i].key));
            for t in &rec.header.tensors {
                assert!(t.range.end <= rec.bytes.len());
            }
        }
        let _ = r.read(i, false);
        let _ = r.raw(i, false);
        let _ = r.check(i);
    }
    for p in r.problems() {
        let _ = (p.to_string(), p.kind(), p.offset(), p.key());
    }
    let _ = r.is_being_written();
    r.entries()
        .iter()
        .map(|e| (e.stored_len, e.raw_len))
        .collect()
}

/// Everything a case does, on its own thread: the largest allocation it made, and the bound.
fn exercise(path: PathBuf, bytes: Vec<u8>) -> (usize, u64) {
    LARGEST.with(|m| m.set(0));
    let _ = is_torn_empty(&bytes);
    let mut entries = read_all(&path);
    // Recovery, then everything again on the completed shard.
    if recover(&path).is_ok() && path.exists() {
        entries.extend(read_all(&path));
        let again = recover(&path);
        assert!(
            again.as_ref().is_ok_and(|r| r.was_complete || r.removed),
            "recovering a recovered shard again must find it complete: {again:?}"
        );
    }
    let file_len = bytes
        .len()
        .max(std::fs::metadata(&path).map_or(0, |m| m.len() as usize));
    (
        LARGEST.with(|m| m.get()),
        allowed_allocation(file_len as u64, &entries),
    )
}

fn run_case(dir: &Path, bytes: &[u8]) -> Result<(), TestCaseError> {
    // A file of its own: a case given up on (a hang) must not touch the next one's.
    static CASES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = CASES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = dir.join(format!("case-{n}.lts"));
    std::fs::write(&path, bytes).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let owned = bytes.to_vec();
    let worker = std::thread::Builder::new()
        .name("fuzz-case".into())
        .spawn(move || {
            let _ = tx.send(exercise(path, owned));
        })
        .unwrap();
    match rx.recv_timeout(CASE_LIMIT) {
        Ok((largest, allowed)) => {
            worker.join().unwrap();
            let _ = std::fs::remove_file(dir.join(format!("case-{n}.lts")));
            prop_assert!(
                largest as u64 <= allowed,
                "allocated {largest} bytes at once for a file of {} bytes (allowed {allowed})",
                bytes.len()
            );
            Ok(())
        }
        // The worker panicked: its panic is the failure.
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => match worker.join() {
            Err(panic) => Err(TestCaseError::fail(format!(
                "panicked: {}",
                panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            ))),
            Ok(()) => Err(TestCaseError::fail(
                "the case thread ended without a result",
            )),
        },
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(TestCaseError::fail(format!(
            "no result after {CASE_LIMIT:?}: a hang"
        ))),
    }
}

fn vectors() -> Vec<(String, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/vectors");
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "lts"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect();
    out.sort();
    assert!(out.len() >= 10, "tests/vectors has {} shards", out.len());
    out
}

#[test]
fn mutated_vectors_never_panic_hang_or_overallocate() {
    let seconds: u64 = std::env::var("LAYERTAP_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(15);
    let seeds = vectors();
    // On tmpfs where there is one: recovery fsyncs, which the disk would make the slow part.
    let dir = match Path::new("/dev/shm").is_dir() {
        true => tempfile::tempdir_in("/dev/shm"),
        false => tempfile::tempdir(),
    }
    .unwrap();
    let strategy = (0..seeds.len(), prop::collection::vec(mutation(), 1..10));
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let (mut batches, mut cases) = (0u64, 0u64);
    while Instant::now() < deadline {
        // Deterministic batches: the same run finds the same inputs.
        let seed: [u8; 32] = std::array::from_fn(|i| (batches >> (8 * (i % 8))) as u8 ^ i as u8);
        let config = Config {
            cases: 64,
            failure_persistence: None,
            ..Config::default()
        };
        let mut runner =
            TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &seed));
        let result = runner.run(&strategy, |(which, mutations)| {
            let mut bytes = seeds[which].1.clone();
            for m in &mutations {
                m.apply(&mut bytes);
            }
            let outcome = run_case(dir.path(), &bytes);
            if outcome.is_err() {
                let out = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                    .join(format!("../../target/fuzz-failure-{}.lts", seeds[which].0));
                let _ = std::fs::write(out, &bytes);
            }
            outcome
        });
        if let Err(e) = result {
            panic!("batch {batches}: {e}");
        }
        batches += 1;
        cases += 64;
    }
    println!(
        "fuzz_vectors: {cases} cases in {batches} batches over {} seeds in {seconds} s",
        seeds.len()
    );
}
