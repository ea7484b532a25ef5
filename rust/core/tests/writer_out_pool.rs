//! The compression threads' output buffers are recycled (`writer/out_pool.rs`): writing large
//! records costs no page fault per page written once the writer is warm, and a buffer reused
//! for another record never mixes records up, whatever their sizes and however they are
//! written (buffered or `O_DIRECT`, io_uring or pwrite).
//!
//! Minor faults are counted for the whole process (`getrusage(RUSAGE_SELF)`), so the tests of
//! this file run one at a time (`SERIAL`), and the measured records' buffers are made before
//! counting and shared between records (no fault of the test's own in the count).

mod writer_support;

use layertap_core::blob::TensorSpec;
use layertap_core::fp8::Lossy;
use layertap_core::writer::{Durability, RecordInput, ShardWriter, TensorInput, WriterConfig};
use layertap_core::{Codec, Dtype};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use writer_support::*;

static SERIAL: Mutex<()> = Mutex::new(());

/// Minor page faults of this process so far, all threads.
fn minor_faults() -> u64 {
    // SAFETY: `rusage` is plain data (integers) that getrusage fills in; all zeros is valid.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: the pointer is valid for writes of one `rusage` for the whole call.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &raw mut usage) };
    assert_eq!(rc, 0, "getrusage: {}", std::io::Error::last_os_error());
    u64::try_from(usage.ru_minflt).unwrap()
}

/// `elems` bf16 values shaped like activations: roughly normal (a sum of four uniform bytes)
/// with random low bits, so the exponents repeat and the mantissas do not (bp16-zstd stores
/// them in about 0.7 of their size, zstd in about 0.85).
fn activations(seed: u64, elems: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(2 * elems);
    for _ in 0..elems {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let sum: u64 = (0..4).map(|i| (x >> (8 * i)) & 0xff).sum();
        let fine = ((x >> 32) & 0xffff) as f32 / 65536.0;
        let v = (sum as f32 - 510.0 + fine) / 64.0;
        out.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
    }
    out
}

/// What a fault count writes: records of `tokens` x `hidden` bf16 hidden states (and their
/// token ids), `warm_up` of them before counting and `measured` while counting.
struct Run {
    codec: Codec,
    lossy: Option<Lossy>,
    tokens: u64,
    hidden: u64,
    warm_up: usize,
    measured: usize,
}

/// Records of 2048 x 8192 bf16, 32 MiB, about an 8B model's (~33 MB): their output buffers are
/// larger than glibc's largest mmap threshold (32 MiB), so a fresh buffer per record is always
/// a fresh `mmap`. (Records of 8 MiB fault too, but by how much depends on where glibc's
/// dynamic threshold stands: from 8,000 to 30,000 faults for 77,000 pages written in three
/// runs of the same test.)
const LARGE: (u64, u64) = (2048, 8192);

/// A record of `tokens` x `hidden` bf16 hidden states and its token ids, from shared buffers.
fn big_record(
    key: &str,
    (tokens, hidden): (u64, u64),
    hs: &Arc<Vec<u8>>,
    ids: &Arc<Vec<u8>>,
) -> RecordInput {
    let hs_spec = TensorSpec {
        name: "hidden_states".into(),
        dtype: Dtype::BF16,
        shape: vec![tokens, hidden],
    };
    let ids_spec = TensorSpec {
        name: "token_ids".into(),
        dtype: Dtype::I64,
        shape: vec![tokens],
    };
    RecordInput {
        key: key.into(),
        tensors: vec![
            TensorInput::new(hs_spec, hs.clone()),
            TensorInput::new(ids_spec, ids.clone()),
        ],
        metadata: BTreeMap::new(),
        num_tokens: tokens as u32,
    }
}

/// Records a test keeps in flight at most: a producer the writer keeps up with, as it keeps up
/// with an engine. (A burst of more records than the pool keeps buffers for, all in flight at
/// once, is written partly into fresh buffers: see `writer/out_pool.rs`.)
const IN_FLIGHT: usize = 4;

/// Submits records `from..to` (`make(i)` builds record `i`), at most [`IN_FLIGHT`] in flight,
/// and waits until all are written.
fn write_records(w: &ShardWriter, from: usize, to: usize, make: impl Fn(usize) -> RecordInput) {
    let mut written = 0;
    for i in from..to {
        while i - from - written >= IN_FLIGHT {
            written += w.poll_wait(None).unwrap().len();
        }
        w.submit(make(i)).unwrap();
    }
    w.flush().unwrap();
    written += w.poll().unwrap().len();
    assert_eq!(written, to - from);
}

/// Writes `run`'s records with two compression threads; returns the minor faults and the
/// stored bytes of the measured ones.
fn faults_of_measured_records(run: &Run, dir: &std::path::Path) -> (u64, u64) {
    let shape = (run.tokens, run.hidden);
    let hidden: Vec<Arc<Vec<u8>>> = (0..3)
        .map(|s| Arc::new(activations(s, (run.tokens * run.hidden) as usize)))
        .collect();
    let ids = Arc::new(bytes(99, 8 * run.tokens as usize));
    let cfg = WriterConfig {
        codec: run.codec,
        lossy: run.lossy,
        threads: Some(2),
        durability: Durability::None,
        ..Default::default()
    };
    let w = ShardWriter::open(dir, cfg).unwrap();
    let make = |i: usize| big_record(&format!("r{i}"), shape, &hidden[i % hidden.len()], &ids);
    write_records(&w, 0, run.warm_up, make);
    let (faults_before, stored_before) = (minor_faults(), w.stats().unwrap().bytes_stored);
    write_records(&w, run.warm_up, run.warm_up + run.measured, make);
    let (faults_after, stored_after) = (minor_faults(), w.stats().unwrap().bytes_stored);
    w.close().unwrap();
    (faults_after - faults_before, stored_after - stored_before)
}

/// Runs `run` and checks that the measured records fault in far fewer pages than they write.
fn check_few_faults(run: &Run) {
    let dir = tempfile::tempdir().unwrap();
    let (faults, stored) = faults_of_measured_records(run, dir.path());
    let pages = stored / 4096;
    let what = match run.lossy {
        Some(l) => format!("{} {}", run.codec, l.name()),
        None => run.codec.to_string(),
    };
    eprintln!(
        "{what}: {faults} minor faults while writing {} records, {stored} bytes stored \
         ({pages} pages)",
        run.measured
    );
    // A fresh output buffer per record faults in every page it is written to: about `pages`
    // faults (and the lossy stage's fp8 values as many again). Recycled buffers are faulted
    // in once, during the warm-up.
    assert!(
        faults < pages / 4,
        "{what}: {faults} minor faults for {pages} pages written"
    );
}

#[test]
fn large_records_are_compressed_into_recycled_buffers() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for codec in [Codec::Bp16Zstd, Codec::Zstd] {
        check_few_faults(&Run {
            codec,
            lossy: None,
            tokens: LARGE.0,
            hidden: LARGE.1,
            warm_up: 6,
            measured: 24,
        });
    }
}

#[test]
fn the_lossy_stage_quantizes_into_recycled_buffers() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Twice the hidden size: the fp8 values (one byte per element) are 32 MiB too.
    check_few_faults(&Run {
        codec: Codec::Bp16Zstd,
        lossy: Some(Lossy::Fp8E4m3),
        tokens: LARGE.0,
        hidden: 2 * LARGE.1,
        warm_up: 6,
        measured: 12,
    });
}

/// Record `i` of the read-back test: sizes that go up and down by large steps, so that a
/// recycled buffer is taken for a record both larger and smaller than the one it held.
fn varied(i: u64) -> (u64, u64) {
    let tokens = [300, 2, 900, 40, 1200, 7, 600, 1][(i % 8) as usize];
    (tokens, 256 + 64 * (i % 3))
}

#[test]
fn recycled_buffers_never_mix_records_up() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut ran = 0;
    for io in io_modes() {
        for direct in [false, true] {
            for codec in [Codec::Bp16Zstd, Codec::Zstd, Codec::ExpHuf] {
                let dir = tempfile::tempdir().unwrap();
                let cfg = WriterConfig {
                    direct,
                    batch_bytes: 256 << 10,
                    ..config(io, codec)
                };
                let w = ShardWriter::open(dir.path(), cfg).unwrap();
                let n = 48;
                for i in 0..n {
                    let (tokens, hidden) = varied(i);
                    w.submit(record(&format!("k{i}"), tokens, hidden, i))
                        .unwrap();
                    if i % 16 == 15 {
                        w.flush().unwrap(); // the pool refills, and the next records reuse it
                    }
                }
                w.close().unwrap();
                let records = read_records(dir.path());
                assert_eq!(records.len(), n as usize, "{io:?} direct={direct} {codec}");
                for (i, r) in (0..n).zip(&records) {
                    let (tokens, hidden) = varied(i);
                    assert_eq!(r.key, format!("k{i}"));
                    assert_eq!(r.header.codec, codec);
                    assert!(
                        r.tensors == record_tensors(tokens, hidden, i),
                        "{io:?} direct={direct} {codec}: record {i} differs"
                    );
                }
                ran += 1;
            }
        }
    }
    eprintln!("{ran} combinations of I/O mode, direct and codec written and read back");
}
