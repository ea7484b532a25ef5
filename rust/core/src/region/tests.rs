//! The region sink against a real writer: records read back with the schema's names, leases
//! that refuse overlapping writes until reaped, and a bad record that costs only itself.

use super::*;
use crate::codec::Codec;
use crate::reader::ShardReader;
use crate::record;
use crate::writer::{Durability, WriterConfig};

const POOL: usize = 4096;

/// A sink over a fresh pool of `POOL` bytes (bf16 rows `[2, 4]`: 16 bytes a token), layout
/// blocks of 4 tokens, row numbers `blk * 8 + off * 2 + layer`.
fn sink() -> RegionSink {
    let mut pool = vec![0u8; POOL];
    let base = pool.as_mut_ptr();
    let layout = Layout::new(4, 4, Some((8, 2)), vec![0, 1]).unwrap();
    let meta = BTreeMap::from([(record::MODEL.to_owned(), "tiny".to_owned())]);
    // SAFETY: the vector's buffer does not move when the vector does, and it is owned by the
    // sink from here on; nothing else writes it.
    unsafe {
        RegionSink::new(
            Box::new(pool),
            base,
            POOL,
            Dtype::BF16,
            vec![2, 4],
            meta,
            layout,
        )
    }
    .unwrap()
}

fn writer(dir: &std::path::Path) -> ShardWriter {
    let cfg = WriterConfig {
        codec: Codec::None,
        durability: Durability::None,
        ..WriterConfig::default()
    };
    ShardWriter::open(dir, cfg).unwrap()
}

fn request(key: &str, n: u64) -> Request {
    Request {
        key: key.into(),
        request_id: format!("id-{key}"),
        num_tokens: n,
        num_prompt_tokens: n - 1,
        extras: None,
    }
}

/// Fills two requests (3 and 2 tokens, blocks [1] and [0]) at ids 1024, indices 2048.
fn fill_two(sink: &RegionSink) -> Result<u64> {
    sink.fill(1024, 2048, &[3, 2], |i, ids, blocks| {
        for (t, id) in ids.iter_mut().enumerate() {
            *id = (i * 100 + t) as i64;
        }
        blocks.push(1 - i as u64);
        Ok::<(), Error>(())
    })
}

fn pool_i64(sink: &RegionSink, at: usize, n: usize) -> Vec<i64> {
    // SAFETY: test only: the range lies in the pool and nothing writes it meanwhile.
    let bytes = unsafe { std::slice::from_raw_parts((sink.pool.base + at) as *const u8, n * 8) };
    bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn records_read_back_with_the_schema_names() {
    let dir = tempfile::tempdir().unwrap();
    let w = writer(dir.path());
    let s = sink();
    assert_eq!(fill_two(&s).unwrap(), 5);
    assert_eq!(pool_i64(&s, 1024, 5), [0, 1, 2, 100, 101]);
    assert_eq!(
        pool_i64(&s, 2048, 10),
        [8, 9, 10, 11, 12, 13, 0, 1, 2, 3],
        "row numbers of block 1 then block 0"
    );
    let mut second = request("b", 2);
    second.extras = Some(Extras {
        metadata: BTreeMap::from([("sample".to_owned(), "7".to_owned())]),
        loss_mask: Some(vec![0, 1]),
    });
    let failures = s
        .submit(&mut &w, 9, 0, 1100, 0, 1024, &[request("a", 3), second])
        .unwrap();
    assert!(failures.is_empty());
    w.flush().unwrap();
    assert_eq!(
        s.reap(&w, Some(Duration::from_secs(10))).unwrap(),
        (vec![9], 2)
    );
    assert_eq!(s.live_regions(), 0);
    w.close().unwrap();

    let shard = std::fs::read_dir(dir.path())
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let r = ShardReader::open(&shard).unwrap();
    let rec = r.read(1, true).unwrap();
    let names: Vec<_> = rec
        .header
        .tensors
        .iter()
        .map(|t| t.spec.name.as_str())
        .collect();
    assert_eq!(
        names,
        [record::HIDDEN_STATES, record::TOKEN_IDS, record::LOSS_MASK]
    );
    assert_eq!(rec.header.tensors[0].spec.shape, [2, 2, 4]);
    assert_eq!(
        rec.tensor_data(&rec.header.tensors[1]),
        [100i64.to_le_bytes(), 101i64.to_le_bytes()].concat()
    );
    let m = &rec.header.metadata;
    assert_eq!(m[record::NUM_TOKENS], "2");
    assert_eq!(m[record::REQUEST_ID], "id-b");
    assert_eq!(m[record::NUM_PROMPT_TOKENS], "1");
    assert_eq!(m[record::MODEL], "tiny");
    assert_eq!(m[record::KEY], "b");
    assert_eq!(m["sample"], "7");
}

/// A record whose bytes the writer's compression threads cannot read until [`Gate::open`]: the
/// writer writes in submission order, so every record submitted after it stays in the writer
/// (and its region leased) until then, however soon the test asks.
#[derive(Clone, Default)]
struct Gate(Arc<(Mutex<bool>, parking_lot::Condvar)>);

struct Gated(Gate);

impl crate::writer::RecordBuffer for Gated {
    fn bytes(&self) -> &[u8] {
        self.0.wait_on_worker();
        &[0u8; 8]
    }
}

/// A gated buffer whose compression thread panics once the gate opens: the encoder turns the
/// panic into an error that fails the writer.
struct GatedFailure(Gate);

impl crate::writer::RecordBuffer for GatedFailure {
    fn bytes(&self) -> &[u8] {
        if self.0.wait_on_worker() {
            panic!("a record that fails the writer (test)");
        }
        &[0u8; 8]
    }
}

impl Gate {
    /// On a compression thread, waits until the gate opens and returns true. Only the
    /// compression threads wait: `submit` reads the length on the caller's thread.
    fn wait_on_worker(&self) -> bool {
        let on_worker = std::thread::current()
            .name()
            .is_some_and(|n| n.starts_with("layertap-zstd"));
        let (open, cv) = &*self.0;
        let mut open = open.lock();
        while on_worker && !*open {
            cv.wait(&mut open);
        }
        on_worker
    }

    fn record(&self) -> crate::writer::RecordInput {
        record_of("gate", Gated(self.clone()))
    }

    /// A record that fails the writer once the gate opens.
    fn failing_record(&self) -> crate::writer::RecordInput {
        record_of("failing", GatedFailure(self.clone()))
    }

    fn open(&self) {
        *(self.0).0.lock() = true;
        (self.0).1.notify_all();
    }

    /// Opens the gate when dropped: declared after the writer, it opens before the writer's
    /// `close` waits for the gated record, so a test that fails early fails instead of hanging.
    fn opens_on_drop(&self) -> OpensOnDrop {
        OpensOnDrop(self.clone())
    }
}

struct OpensOnDrop(Gate);

impl Drop for OpensOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

/// A record of one 8-byte tensor `x` under `key`.
fn record_of(key: &str, data: impl crate::writer::RecordBuffer) -> crate::writer::RecordInput {
    let spec = crate::blob::TensorSpec {
        name: "x".into(),
        dtype: Dtype::U8,
        shape: vec![8],
    };
    crate::writer::RecordInput {
        key: key.into(),
        tensors: vec![crate::writer::TensorInput::new(spec, data)],
        metadata: BTreeMap::new(),
        num_tokens: 0,
    }
}

/// Region 1, pool bytes `[start, start + nbytes)`, submitted (hidden states at `hidden_offset`,
/// `fill_two`'s requests) behind a gated record: leased until the gate opens. Bind both, after
/// the writer, so that the gate opens before the writer's `close` waits for it.
fn leased_behind_a_gate(
    w: &ShardWriter,
    s: &RegionSink,
    start: usize,
    nbytes: usize,
    hidden_offset: usize,
) -> (Gate, OpensOnDrop) {
    let gate = Gate::default();
    let opens = gate.opens_on_drop();
    w.submit(gate.record()).unwrap();
    fill_two(s).unwrap();
    let reqs = [request("a", 3), request("b", 2)];
    s.submit(&mut &*w, 1, start, nbytes, hidden_offset, 1024, &reqs)
        .unwrap();
    (gate, opens)
}

#[test]
fn a_leased_region_is_not_written_until_reaped() {
    let dir = tempfile::tempdir().unwrap();
    let w = writer(dir.path());
    let s = sink();
    let (gate, _opens) = leased_behind_a_gate(&w, &s, 1024, 1024, 1024);
    let err = fill_two(&s).unwrap_err().to_string();
    assert!(
        err.contains("overlap a region the writer still reads"),
        "{err}"
    );
    let err = s
        .submit(&mut &w, 2, 1500, 16, 1500, 1500, &[])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("submit: region: bytes 1500..1516 overlap"),
        "{err}"
    );
    assert_eq!(s.live_regions(), 1);
    gate.open();
    w.flush().unwrap();
    assert_eq!(s.reap(&w, None).unwrap().0, [1]);
    fill_two(&s).unwrap();
}

#[test]
fn bad_ranges_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let w = writer(dir.path());
    let s = sink();
    let none = |_: usize, _: &mut [i64], _: &mut Vec<u64>| Ok::<(), Error>(());
    let err = s.fill(POOL - 8, 0, &[2], none).unwrap_err().to_string();
    assert!(err.contains("outside the pool of 4096 bytes"), "{err}");
    let err = s.fill(4, 2048, &[1], none).unwrap_err().to_string();
    assert!(err.contains("not aligned to 8"), "{err}");
    let err = s.fill(0, 8, &[2], none).unwrap_err().to_string();
    assert!(err.contains("overlap"), "{err}");
    let err = s.fill(0, 1024, &[5], |_, _, b: &mut Vec<u64>| {
        b.push(0);
        Ok::<(), Error>(())
    });
    assert!(err
        .unwrap_err()
        .to_string()
        .contains("5 tokens but 1 blocks of 4"));
    let err = s
        .submit(&mut &w, 0, 0, 40, 0, 16, &[request("a", 3)])
        .unwrap_err();
    assert!(err.to_string().contains("outside the region"), "{err}");
    assert_eq!(s.live_regions(), 0);
}

#[test]
fn a_refused_record_costs_only_itself() {
    let dir = tempfile::tempdir().unwrap();
    let w = writer(dir.path());
    let s = sink();
    fill_two(&s).unwrap();
    let reqs = [
        request("a", 1),
        request("a", 1),
        request("bad/\0key", 1),
        request("c", 2),
    ];
    let failures = s.submit(&mut &w, 3, 0, 1100, 0, 1024, &reqs).unwrap();
    let refused: Vec<usize> = failures.iter().map(|f| f.0).collect();
    assert_eq!(refused, [1, 2], "{failures:?}");
    w.flush().unwrap();
    assert_eq!(
        s.reap(&w, Some(Duration::from_secs(10))).unwrap(),
        (vec![3], 2)
    );
}

/// Token counts whose sum overflows (`[u64::MAX, 1]` added up to 0 in a release build: every
/// range check passed, the batch was refused for record 0's sake, and the retry of record 1
/// read the 16 bytes before the region), or whose bytes do (`2^60` tokens of 16 bytes), are
/// refused before anything is leased or built.
#[test]
fn token_counts_that_overflow_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let w = writer(dir.path());
    let s = sink();
    let none = |_: usize, _: &mut [i64], _: &mut Vec<u64>| Ok::<(), Error>(());
    let overflows = |e: Error| {
        let text = e.to_string();
        assert!(matches!(e, Error::InvalidInput(_)), "{text}");
        assert!(text.contains("token counts add up to more than"), "{text}");
    };
    for counts in [[u64::MAX, 1], [1, u64::MAX]] {
        overflows(s.fill(0, 1024, &counts, none).unwrap_err());
        let reqs = [request("a", counts[0]), request("b", counts[1])];
        overflows(s.submit(&mut &w, 1, 16, 1024, 16, 528, &reqs).unwrap_err());
    }
    let err = s
        .submit(&mut &w, 2, 0, 1024, 0, 512, &[request("a", 1 << 60)])
        .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidInput(m) if m.contains("outside the region")),
        "{err}"
    );
    assert_eq!(s.live_regions(), 0);
    assert_eq!(w.stats().unwrap().records_submitted, 0, "no record built");
}

/// An empty region is refused: its lease `[0, 0)` passed the overlap test, replaced the live
/// lease of the region at 0 and, dropped, removed it, so `fill` then wrote bytes the writer
/// was reading.
#[test]
fn an_empty_region_is_refused_and_leaves_a_live_lease_alone() {
    let dir = tempfile::tempdir().unwrap();
    let w = writer(dir.path());
    let s = sink();
    let (gate, _opens) = leased_behind_a_gate(&w, &s, 0, POOL, 0);
    let err = s.submit(&mut &w, 2, 0, 0, 0, 0, &[]).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidInput(m) if m.contains("region 2 is empty")),
        "{err}"
    );
    assert_eq!(s.live_regions(), 1);
    let err = fill_two(&s).unwrap_err().to_string();
    assert!(
        err.contains("overlap a region the writer still reads"),
        "{err}"
    );
    gate.open();
    w.flush().unwrap();
    assert_eq!(s.reap(&w, None).unwrap(), (vec![1], 3));
}

/// Records counted by one `reap` are returned with it when the writer fails during its wait:
/// the error used to be returned instead, and the records already drained from the writer
/// were never counted. The error comes with the next call.
#[test]
fn a_failure_during_reap_keeps_what_it_counted() {
    let dir = tempfile::tempdir().unwrap();
    let w = writer(dir.path());
    let s = sink();
    w.submit(record_of("a", vec![0u8; 8])).unwrap();
    w.flush().unwrap(); // "a" is written, its completion queued
    let gate = Gate::default();
    let _opens = gate.opens_on_drop();
    w.submit(gate.failing_record()).unwrap();
    // A range leased all along and no region given back, so that `reap` waits, polling, until
    // the writer fails.
    let _held = s.leases.lease(9, 2048, 3072).unwrap();
    let reaped = std::thread::scope(|scope| {
        scope.spawn(|| {
            let deadline = Instant::now() + Duration::from_secs(60);
            while w.queued_completions() > 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            gate.open(); // `reap` drained "a": now the writer fails
        });
        s.reap(&w, Some(Duration::from_secs(60)))
    });
    assert_eq!(reaped.unwrap(), (vec![], 1));
    assert!(w.failed());
    let err = s.reap(&w, Some(Duration::ZERO)).unwrap_err();
    assert!(err.to_string().contains("encoder panicked"), "{err}");
}
