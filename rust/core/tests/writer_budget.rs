//! The in-flight budget: `submit` blocks (and counts the time) while `max_inflight_bytes` are
//! in flight, a record larger than the budget is admitted alone, and nothing is dropped.

mod writer_support;

use layertap_core::blob::TensorSpec;
use layertap_core::writer::{RecordBuffer, RecordInput, ShardWriter, TensorInput, WriterConfig};
use layertap_core::{Codec, Dtype};
use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;
use writer_support::*;

/// A buffer whose bytes the writer's workers cannot read until the gate opens: it holds a
/// record in flight for as long as the test wants.
struct Gated {
    data: Vec<u8>,
    gate: Arc<(Mutex<bool>, Condvar)>,
}

impl RecordBuffer for Gated {
    fn bytes(&self) -> &[u8] {
        let on_worker = std::thread::current()
            .name()
            .is_some_and(|n| n.starts_with("layertap-zstd"));
        if on_worker {
            let (open, cv) = &*self.gate;
            let mut open = open.lock().unwrap();
            while !*open {
                open = cv.wait(open).unwrap();
            }
        }
        &self.data
    }
}

fn gated_record(key: &str, len: usize, gate: &Arc<(Mutex<bool>, Condvar)>) -> RecordInput {
    let spec = TensorSpec {
        name: "x".into(),
        dtype: Dtype::U8,
        shape: vec![len as u64],
    };
    let data = Gated {
        data: bytes(len as u64, len),
        gate: gate.clone(),
    };
    RecordInput {
        key: key.into(),
        tensors: vec![TensorInput::new(spec, data)],
        metadata: BTreeMap::new(),
        num_tokens: 0,
    }
}

fn open_gate(gate: &Arc<(Mutex<bool>, Condvar)>) {
    *gate.0.lock().unwrap() = true;
    gate.1.notify_all();
}

/// Submits `second` on another thread while `first` is held in flight; checks it blocks until
/// the gate opens.
fn check_blocks(w: &ShardWriter, second: RecordInput, gate: &Arc<(Mutex<bool>, Condvar)>) {
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        s.spawn(move || {
            started_tx.send(()).unwrap();
            tx.send(w.submit(second)).unwrap();
        });
        // The 300 ms start once the thread runs: a thread scheduled late (a loaded machine)
        // would otherwise wait less than the bound below.
        started_rx.recv().unwrap();
        assert!(
            rx.recv_timeout(Duration::from_millis(300)).is_err(),
            "submit must wait for the budget"
        );
        assert!(w.stats().unwrap().inflight_bytes > 0);
        open_gate(gate);
        let seq = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("submit resumes")
            .unwrap();
        assert_eq!(seq, 1);
    });
    // Not the whole 300 ms: the submitting thread may start waiting late on a loaded machine.
    assert!(
        w.stats().unwrap().blocked_seconds >= 0.05,
        "{:?}",
        w.stats().unwrap()
    );
}

#[test]
fn submit_blocks_while_the_budget_is_full() {
    for io in io_modes() {
        for codec in [Codec::None, Codec::Bp16Zstd] {
            let dir = tempfile::tempdir().unwrap();
            let cfg = WriterConfig {
                max_inflight_bytes: 10_000,
                ..config(io, codec)
            };
            let w = ShardWriter::open(dir.path(), cfg).unwrap();
            let gate = Arc::new((Mutex::new(false), Condvar::new()));
            w.submit(gated_record("held", 6000, &gate)).unwrap();
            check_blocks(&w, gated_record("next", 6000, &gate), &gate);
            w.close().unwrap();
            let recs = read_records(dir.path());
            assert_eq!(
                recs.iter().map(|r| r.key.as_str()).collect::<Vec<_>>(),
                ["held", "next"]
            );
            assert_eq!(recs[1].tensors[0].1, bytes(6000, 6000));
        }
    }
}

#[test]
fn a_record_larger_than_the_budget_goes_alone() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = WriterConfig {
        max_inflight_bytes: 1000,
        ..Default::default()
    };
    let w = ShardWriter::open(dir.path(), cfg).unwrap();
    let gate = Arc::new((Mutex::new(false), Condvar::new()));
    // Admitted at once although it is 50 times the budget: nothing else is in flight.
    w.submit(gated_record("huge", 50_000, &gate)).unwrap();
    assert!(w.stats().unwrap().inflight_bytes > 50_000);
    check_blocks(&w, gated_record("small", 10, &gate), &gate);
    w.close().unwrap();
    assert_eq!(read_records(dir.path()).len(), 2);
}

#[test]
fn budget_bounds_inflight_bytes_under_load() {
    for io in io_modes() {
        let dir = tempfile::tempdir().unwrap();
        let budget = 256 << 10;
        let cfg = WriterConfig {
            max_inflight_bytes: budget,
            ..config(io, Codec::Bp16Zstd)
        };
        let w = ShardWriter::open(dir.path(), cfg).unwrap();
        let mut max_seen = 0;
        for i in 0..200u64 {
            w.submit(record(&format!("r{i}"), 16, 256, i)).unwrap();
            max_seen = max_seen.max(w.stats().unwrap().inflight_bytes);
        }
        assert!(max_seen <= budget, "{max_seen} > {budget}");
        w.close().unwrap();
        let s = w.stats().unwrap();
        assert_eq!(
            (s.records_written, s.inflight_bytes, s.queue_depth),
            (200, 0, 0)
        );
        assert_eq!(read_records(dir.path()).len(), 200);
    }
}

/// `admits_now` says whether `submit_prepared` would queue a batch without waiting: yes while
/// the batch fits beside what is in flight, no once it does not (the Python bindings release
/// the interpreter lock only then), and yes again when the budget comes back.
#[test]
fn admits_now_tells_whether_a_prepared_batch_would_wait() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = WriterConfig {
        max_inflight_bytes: 10_000,
        ..Default::default()
    };
    let w = ShardWriter::open(dir.path(), cfg).unwrap();
    let gate = Arc::new((Mutex::new(false), Condvar::new()));
    let small = w
        .prepare_many(vec![
            gated_record("a", 1000, &gate),
            gated_record("b", 1000, &gate),
        ])
        .unwrap();
    assert_eq!(small.len(), 2);
    assert!(small.raw_len() > 2000 && small.raw_len() < 3000);
    assert!(w.admits_now(&small));
    w.submit_prepared(small).unwrap();
    // 2 records held in flight: another 9,000 bytes do not fit beside them.
    let big = w
        .prepare_many(vec![gated_record("c", 9000, &gate)])
        .unwrap();
    assert!(!w.admits_now(&big));
    // Preparing queues nothing: a bad record in the batch refuses it before any budget is taken.
    let bad = w.prepare_many(vec![gated_record("", 10, &gate)]);
    assert!(bad.is_err());
    assert_eq!(w.stats().unwrap().records_submitted, 2);
    open_gate(&gate);
    w.flush().unwrap();
    assert!(w.admits_now(&big));
    w.submit_prepared(big).unwrap();
    w.close().unwrap();
    assert_eq!(read_records(dir.path()).len(), 3);
}
