//! State shared by the caller's side of a writer and its threads: the in-flight byte budget,
//! counters, the records written but not yet polled, and the first error.

use super::config::Backend;
use crate::error::{Error, Result};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A record the writer has written (returned by [`ShardWriter::poll`](super::ShardWriter::poll)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// What `submit` returned for it.
    pub seq: u64,
    /// The record key.
    pub key: String,
    /// The shard file holding it.
    pub shard: PathBuf,
    /// Offset of its frame in the shard.
    pub offset: u64,
    /// Payload length as stored.
    pub stored_len: u64,
    /// Payload length decoded.
    pub raw_len: u64,
}

/// Counters of a writer.
#[derive(Debug, Clone, PartialEq)]
pub struct Stats {
    /// Records accepted by `submit`.
    pub records_submitted: u64,
    /// Records whose bytes are all in their shard.
    pub records_written: u64,
    /// Raw (decoded) bytes of the records written.
    pub bytes_in: u64,
    /// Stored payload bytes of the records written.
    pub bytes_stored: u64,
    /// `bytes_in / bytes_stored` (0 before any record is written).
    pub ratio: f64,
    /// Records submitted and not yet written.
    pub queue_depth: u64,
    /// Raw bytes submitted and not yet written.
    pub inflight_bytes: u64,
    /// Time `submit` spent waiting for the in-flight budget.
    pub blocked_seconds: f64,
    /// Shards completed (index and trailer written).
    pub shards_closed: u64,
    /// The I/O backend in use.
    pub backend: Backend,
    /// Whether record data goes to the open (or last) shard with `O_DIRECT`: false when not
    /// asked for, or when the file system refused it.
    pub direct: bool,
    /// Compression threads.
    pub threads: u64,
    /// Time the compression threads spent encoding and checksumming, summed over threads:
    /// with `threads` and the wall time it tells whether compression is the bottleneck.
    pub encode_seconds: f64,
}

#[derive(Default)]
struct State {
    inflight_bytes: u64,
    records_submitted: u64,
    records_written: u64,
    bytes_in: u64,
    bytes_stored: u64,
    blocked: Duration,
    shards_closed: u64,
    direct: bool,
    completions: VecDeque<Completion>,
    /// The first error of the writer's threads, until a call returns it.
    error: Option<Error>,
    /// Why the writer failed; stays set once the error was returned.
    failure: Option<String>,
}

/// The shared part of a writer.
pub(crate) struct Shared {
    state: Mutex<State>,
    /// Signalled when records are written (which frees budget), when budget of abandoned
    /// records is freed, and when the writer fails.
    budget_freed: Condvar,
    max_inflight: u64,
    /// Nanoseconds the compression threads spent encoding (an atomic: added to once per
    /// record, outside the state lock).
    encode_nanos: AtomicU64,
}

impl Shared {
    pub fn new(max_inflight: u64) -> Shared {
        Shared {
            state: Mutex::new(State::default()),
            budget_freed: Condvar::new(),
            max_inflight,
            encode_nanos: AtomicU64::new(0),
        }
    }

    /// Adds one record's encoding time.
    pub fn add_encode_time(&self, spent: Duration) {
        let nanos = u64::try_from(spent.as_nanos()).unwrap_or(u64::MAX);
        self.encode_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Returns the pending error (once), or `Closed` with its reason if the writer failed
    /// earlier.
    pub fn check(&self) -> Result<()> {
        let mut s = self.state.lock();
        Self::check_locked(&mut s)
    }

    fn check_locked(s: &mut State) -> Result<()> {
        if let Some(e) = s.error.take() {
            return Err(e);
        }
        match &s.failure {
            Some(reason) => Err(Error::Closed(Some(reason.clone()))),
            None => Ok(()),
        }
    }

    /// The pending error, if a call has not returned it yet (for `poll` and `close`, which
    /// still work after a failure).
    pub fn take_error(&self) -> Option<Error> {
        self.state.lock().error.take()
    }

    /// Whether the writer's threads failed.
    pub fn failed(&self) -> bool {
        self.state.lock().failure.is_some()
    }

    /// Waits until `raw` more bytes fit the budget (or nothing else is in flight), then takes
    /// them and counts one submitted record. Fails if the writer fails meanwhile.
    pub fn admit(&self, raw: u64) -> Result<()> {
        let mut s = self.state.lock();
        Self::check_locked(&mut s)?;
        if !self.fits(&s, raw) {
            let start = Instant::now();
            while !self.fits(&s, raw) && s.failure.is_none() {
                self.budget_freed.wait(&mut s);
            }
            s.blocked += start.elapsed();
            Self::check_locked(&mut s)?;
        }
        s.inflight_bytes += raw;
        s.records_submitted += 1;
        Ok(())
    }

    /// Whether `raw` more bytes would be admitted now without waiting (a hint: see
    /// `ShardWriter::admits_now`). Records are admitted one by one, so `raw`, the sum of a
    /// batch, is admitted at once if the first record finds nothing in flight only when the
    /// whole sum fits too; this says no in that case, which costs a release of the
    /// interpreter lock, not correctness.
    pub fn admits(&self, raw: u64) -> bool {
        let s = self.state.lock();
        s.inflight_bytes.saturating_add(raw) <= self.max_inflight
    }

    fn fits(&self, s: &State, raw: u64) -> bool {
        s.inflight_bytes == 0 || s.inflight_bytes.saturating_add(raw) <= self.max_inflight
    }

    /// A record admitted with `was` bytes is `now` bytes long after the lossy stage: it holds
    /// that much from now on, which is what its completion frees.
    pub fn readmit(&self, was: u64, now: u64) {
        if was == now {
            return;
        }
        let mut s = self.state.lock();
        s.inflight_bytes = s.inflight_bytes.saturating_sub(was).saturating_add(now);
        drop(s);
        if now < was {
            self.budget_freed.notify_all();
        }
    }

    /// Records written: queues their completions and frees their budget.
    pub fn written(&self, done: impl IntoIterator<Item = Completion>) {
        let mut s = self.state.lock();
        let mut freed = 0;
        for c in done {
            freed += c.raw_len;
            s.records_written += 1;
            s.bytes_in += c.raw_len;
            s.bytes_stored += c.stored_len;
            s.completions.push_back(c);
        }
        s.inflight_bytes -= freed.min(s.inflight_bytes);
        drop(s);
        self.budget_freed.notify_all();
    }

    /// Frees the budget of records that will not be written (after a failure).
    pub fn abandoned(&self, raw: u64) {
        let mut s = self.state.lock();
        s.inflight_bytes -= raw.min(s.inflight_bytes);
        drop(s);
        self.budget_freed.notify_all();
    }

    /// Whether the shard being written now goes through `O_DIRECT`.
    pub fn set_direct(&self, direct: bool) {
        self.state.lock().direct = direct;
    }

    /// A shard was completed.
    pub fn shard_closed(&self) {
        self.state.lock().shards_closed += 1;
    }

    /// The writer's threads hit `e`: keep it for the next call and refuse work from now on.
    /// Only the first error is kept.
    pub fn fail(&self, e: Error) {
        let mut s = self.state.lock();
        if s.failure.is_none() {
            s.failure = Some(e.to_string());
            s.error = Some(e);
        }
        drop(s);
        self.budget_freed.notify_all();
    }

    /// Waits until a completion is queued, or no record is in flight, or the writer failed, or
    /// `timeout` passed (`None`: no limit).
    pub fn wait_for_completion(&self, timeout: Option<Duration>) {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut s = self.state.lock();
        while s.completions.is_empty()
            && s.records_written < s.records_submitted
            && s.failure.is_none()
        {
            match deadline {
                None => self.budget_freed.wait(&mut s),
                Some(d) => {
                    if self.budget_freed.wait_until(&mut s, d).timed_out() {
                        break;
                    }
                }
            }
        }
    }

    /// Takes the completions queued so far, in sequence order.
    pub fn drain_completions(&self) -> Vec<Completion> {
        self.state.lock().completions.drain(..).collect()
    }

    /// Completions queued and not yet taken.
    #[cfg(test)]
    pub fn queued_completions(&self) -> usize {
        self.state.lock().completions.len()
    }

    /// Whether the first `n` records (sequence numbers below `n`) are written.
    pub fn all_written_upto(&self, n: u64) -> bool {
        self.state.lock().records_written >= n
    }

    /// The counters.
    /// Holds the state lock until the guard is dropped: tests of a lock held at a fork.
    #[cfg(test)]
    pub fn hold_lock(&self) -> impl Sized + '_ {
        self.state.lock()
    }

    pub fn stats(&self, backend: Backend, threads: usize) -> Stats {
        let s = self.state.lock();
        Stats {
            records_submitted: s.records_submitted,
            records_written: s.records_written,
            bytes_in: s.bytes_in,
            bytes_stored: s.bytes_stored,
            ratio: if s.bytes_stored == 0 {
                0.0
            } else {
                s.bytes_in as f64 / s.bytes_stored as f64
            },
            queue_depth: s.records_submitted - s.records_written,
            inflight_bytes: s.inflight_bytes,
            blocked_seconds: s.blocked.as_secs_f64(),
            shards_closed: s.shards_closed,
            backend,
            direct: s.direct,
            threads: threads as u64,
            encode_seconds: self.encode_nanos.load(Ordering::Relaxed) as f64 * 1e-9,
        }
    }
}
