//! The shard writer: callers submit records, a pool of named threads encodes them
//! (`layertap-zstd-N`) and one I/O thread (`layertap-io`) writes them, in submission order,
//! into shards through io_uring or `pwritev` (on a thread of its own, `layertap-pwrite`). With
//! a durability policy a sync thread (`layertap-sync`) does the `fsync`s, so that the I/O thread
//! never waits for the disk to make a shard durable (see `sync.rs`).
//!
//! ```text
//! submit (caller: checks, budget) -> jobs -> workers (encode, CRC, frame header)
//!     -> I/O thread (reorder by seq, batch, rotate shards, write) -> poll (completions)
//!                                                        \-> sync thread (fsync, close shards)
//! ```
//!
//! Without direct I/O the caller's buffers are not copied on the `none` path: the frame
//! header, the safetensors header and the caller's buffers go to the kernel as one iovec list,
//! and with a durability policy the writer starts writeback of each write at once
//! (`sync_file_range`) so that the disk works while the next ones are copied. With direct
//! I/O (`WriterConfig::direct`) the I/O thread copies records into aligned bounce buffers and
//! writes them with `O_DIRECT` (see `direct.rs`). The writer owns each buffer until the
//! record's bytes are written, copied or encoded, then drops it on one of its threads.
//!
//! Memory is bounded by `max_inflight_bytes` of raw bytes submitted and not yet written:
//! `submit` blocks past it, and nothing is ever dropped. The compression threads encode into
//! buffers recycled once the records are written (`out_pool.rs`: a fresh buffer per large
//! record cost a page fault per page written); the idle ones take at most a quarter of
//! `max_inflight_bytes` more. Errors of the writer's threads are kept and returned by the next
//! call; after one, the writer takes no more records.

mod aligned;
mod batch;
mod config;
mod create;
mod direct;
mod encode;
mod encoded;
mod input;
mod io;
mod io_thread;
mod keys;
mod lossy;
mod out_pool;
mod shard;
mod state;
mod sync;
mod thread_ids;

pub use config::{
    random_writer_id, Backend, Durability, IoMode, WriterConfig, IO_ENV_VAR,
    MAX_SHARD_METADATA_JSON,
};
pub use input::{PreparedBatch, RecordBuffer, RecordInput, TensorInput};
pub use state::{Completion, Stats};

use crate::error::{Error, Result};
use crossbeam_channel::Sender;
use encode::Job;
use encoded::ToIo;
use io_thread::IoSettings;
use parking_lot::Mutex;
use shard::ShardNaming;
use state::Shared;
use std::collections::HashSet;
use std::mem::ManuallyDrop;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use thread_ids::ThreadIds;

/// Writes records into the shards of one dataset directory. See the module docs.
///
/// All methods take `&self` and may be called from several threads. The writer belongs to the
/// process that opened it: in a forked child every call fails.
pub struct ShardWriter {
    inner: ManuallyDrop<Inner>,
}

struct Inner {
    dir: PathBuf,
    writer_id: String,
    backend: Backend,
    /// Compression threads started.
    encoders: usize,
    /// Their OS ids, given by each as it starts.
    encoder_ids: Arc<ThreadIds>,
    /// What the compression threads quantize first (`WriterConfig::lossy`).
    lossy: Option<crate::fp8::Lossy>,
    /// The records' codec (`WriterConfig::codec`): tensors given encoded must be in it.
    codec: crate::format::Codec,
    pid: u32,
    shared: Arc<Shared>,
    submit: Mutex<SubmitSide>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// What submitting needs, under one lock so that sequence numbers follow queue order.
struct SubmitSide {
    keys: keys::KeyMemory,
    next_seq: u64,
    jobs: Option<Sender<Job>>,
    to_io: Option<Sender<ToIo>>,
    closed: bool,
}

impl ShardWriter {
    /// Opens a writer on directory `dir` (created if missing). The first shard is created here,
    /// so that a directory it cannot write or a clash of writer ids fails at once; the next
    /// ones when a record needs them. With a `writer_id`, numbering continues after the
    /// highest shard that id already has in `dir`.
    pub fn open(dir: impl AsRef<Path>, cfg: WriterConfig) -> Result<ShardWriter> {
        cfg.validate()?;
        let mode = IoMode::from_env()?.unwrap_or(cfg.io);
        let dir = dir.as_ref().to_path_buf();
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, "create directory", e))?;
        let writer_id = cfg.writer_id.clone().unwrap_or_else(random_writer_id);
        let first_index = shard::next_shard_index(&dir, &writer_id)?;
        let op = if mode == IoMode::Pwrite {
            "start the pwrite thread"
        } else {
            "io_uring_setup"
        };
        let engine = io::open_engine(mode).map_err(|e| Error::io(&dir, op, e))?;
        let backend = engine.backend();
        let shared = Arc::new(Shared::new(cfg.max_inflight_bytes));

        let (jobs_tx, jobs_rx) = crossbeam_channel::unbounded::<Job>();
        let (io_tx, io_rx) = crossbeam_channel::unbounded::<ToIo>();
        let mut threads = Vec::new();
        let naming = ShardNaming {
            dir: dir.clone(),
            writer_id: writer_id.clone(),
            user_meta: cfg.shard_metadata.clone(),
        };
        let durable = cfg.durability != Durability::None;
        let direct_chunk = cfg.direct.then_some(cfg.batch_bytes);
        let first_shard = shard::OpenShard::create(&naming, first_index, direct_chunk)?;
        if durable {
            shard::fsync_dir(&dir)?; // here, not on the sync thread: open fails at once
        }
        shared.set_direct(first_shard.is_direct());
        let settings = IoSettings {
            naming,
            next_index: first_index + 1,
            shard_size: cfg.shard_size,
            batch_bytes: cfg.batch_bytes,
            durability: cfg.durability,
            direct: cfg.direct,
        };
        let syncer = if durable {
            let (syncer, queue) = sync::queue();
            let sync_shared = shared.clone();
            threads.push(spawn(
                &dir,
                "layertap-sync".into(),
                shared.clone(),
                move || sync::run(queue, &sync_shared),
            )?);
            Some(syncer)
        } else {
            None // nothing is ever fsynced: no sync thread
        };
        let io_shared = shared.clone();
        threads.push(spawn(
            &dir,
            "layertap-io".into(),
            shared.clone(),
            move || io_thread::run(settings, first_shard, engine, io_rx, syncer, io_shared),
        )?);
        // The workers' output buffers, recycled once written (`out_pool.rs`).
        let out_pool = out_pool::OutPool::for_writer(cfg.thread_count(), cfg.max_inflight_bytes);
        let encoder_ids = Arc::new(ThreadIds::default());
        for n in 0..cfg.thread_count() {
            let (rx, tx) = (jobs_rx.clone(), io_tx.clone());
            let (codec, level) = (cfg.codec, cfg.level);
            let name = format!("layertap-zstd-{n}");
            let (timing, pool, ids) = (shared.clone(), out_pool.clone(), encoder_ids.clone());
            threads.push(spawn(&dir, name, shared.clone(), move || {
                ids.register_current();
                encode::run_worker(codec, level, rx, tx, &timing, &pool);
            })?);
        }
        Ok(ShardWriter {
            inner: ManuallyDrop::new(Inner {
                dir,
                writer_id,
                backend,
                encoders: cfg.thread_count(),
                encoder_ids,
                lossy: cfg.lossy,
                codec: cfg.codec,
                pid: std::process::id(),
                shared,
                submit: Mutex::new(SubmitSide {
                    keys: keys::KeyMemory::new(cfg.key_memory),
                    next_seq: 0,
                    jobs: Some(jobs_tx),
                    to_io: Some(io_tx),
                    closed: false,
                }),
                threads: Mutex::new(threads),
            }),
        })
    }

    /// Checks `rec` and queues it; returns its sequence number (0, 1, 2...). Waits while
    /// `max_inflight_bytes` are in flight. Bad input is refused before anything is queued.
    /// The record's buffers are owned by the writer until it is written.
    pub fn submit(&self, rec: RecordInput) -> Result<u64> {
        Ok(self.submit_many(vec![rec])?[0])
    }

    /// Like [`ShardWriter::submit`] for several records at once, with consecutive sequence
    /// numbers (one lock, one hand-off: what a caller with many records per step wants). Bad
    /// input, in any record, refuses them all before anything is queued, as does a key given
    /// twice. Only a failure of the writer itself while waiting for budget can leave the first
    /// records queued and the rest not; the writer is unusable after it anyway.
    pub fn submit_many(&self, recs: Vec<RecordInput>) -> Result<Vec<u64>> {
        let batch = self.prepare_many(recs)?;
        self.submit_prepared(batch)
    }

    /// The first half of [`ShardWriter::submit_many`]: checks every record and builds its
    /// header, without queueing anything or waiting. A binding calls it with its interpreter
    /// lock held, then asks [`ShardWriter::admits_now`] whether the second half may wait.
    pub fn prepare_many(&self, recs: Vec<RecordInput>) -> Result<PreparedBatch> {
        let inner = self.live()?;
        if inner.submit.lock().closed {
            return Err(Error::Closed(None));
        }
        inner.shared.check()?;
        let records = recs
            .into_iter()
            .map(|r| input::prepare(r, inner.lossy, inner.codec))
            .collect::<Result<Vec<_>>>()?;
        Ok(PreparedBatch { records })
    }

    /// Whether [`ShardWriter::submit_prepared`] would queue `batch` now without waiting for
    /// budget (`max_inflight_bytes`). A hint: budget only comes back meanwhile, unless another
    /// thread submits to the same writer in between, in which case the submission waits after
    /// all. Python bindings release the interpreter lock only when this says no: releasing it
    /// around a call that does not wait hands the lock to any other runnable Python thread,
    /// and taking it back can cost up to the interpreter's switch interval (5 ms), on every
    /// call (benches/RESULTS.md, 2026-12-02).
    pub fn admits_now(&self, batch: &PreparedBatch) -> bool {
        match self.live() {
            Ok(inner) => inner.shared.admits(batch.raw_len()),
            Err(_) => true, // a closed writer refuses at once
        }
    }

    /// The second half of [`ShardWriter::submit_many`]: refuses a key given twice (in the
    /// batch or earlier), then queues the records, waiting while `max_inflight_bytes` are in
    /// flight.
    pub fn submit_prepared(&self, batch: PreparedBatch) -> Result<Vec<u64>> {
        let inner = self.live()?;
        let prepared = batch.records;
        let mut side = inner.submit.lock();
        if side.closed {
            return Err(Error::Closed(None));
        }
        inner.shared.check()?;
        // A key twice within the batch; not looked for in the common batch of one (`submit`),
        // which would pay a set's allocation per record.
        let mut batch_keys = HashSet::with_capacity(if prepared.len() > 1 {
            prepared.len()
        } else {
            0
        });
        for rec in &prepared {
            let repeated = prepared.len() > 1 && !batch_keys.insert(rec.key.as_str());
            if repeated || side.keys.contains(&rec.key) {
                return Err(Error::DuplicateKey {
                    key: rec.key.clone(),
                });
            }
        }
        drop(batch_keys);
        let mut seqs = Vec::with_capacity(prepared.len());
        for rec in prepared {
            inner.shared.admit(rec.raw_len)?;
            let seq = side.next_seq;
            side.next_seq += 1;
            side.keys.insert(&rec.key);
            let jobs = side.jobs.as_ref().expect("open writer has a job queue");
            jobs.send(Job { seq, rec })
                .map_err(|_| Error::Closed(Some("workers gone".into())))?;
            seqs.push(seq);
        }
        Ok(seqs)
    }

    /// The records written since the last call, in sequence order. Returns a pending error of
    /// the writer's threads first (once); after that, still the records written before it.
    pub fn poll(&self) -> Result<Vec<Completion>> {
        let inner = self.live()?;
        if let Some(e) = inner.shared.take_error() {
            return Err(e);
        }
        Ok(inner.shared.drain_completions())
    }

    /// Like [`ShardWriter::poll`], but leaves a pending error of the writer's threads for a
    /// later call: for a caller that counts what it drains and returns the error only when it
    /// counted nothing (the region sink's `reap`), so that no count is lost to the error.
    pub(crate) fn poll_keeping_error(&self) -> Result<Vec<Completion>> {
        Ok(self.live()?.shared.drain_completions())
    }

    /// Whether the writer's threads failed (whether or not a call returned the error yet); in
    /// a forked child, where the writer is unusable, true without taking its lock.
    pub(crate) fn failed(&self) -> bool {
        self.live().map_or(true, |inner| inner.shared.failed())
    }

    /// Completions queued and not yet polled: tests that must act once a caller drained them.
    #[cfg(test)]
    pub(crate) fn queued_completions(&self) -> usize {
        self.inner.shared.queued_completions()
    }

    /// Like [`ShardWriter::poll`], but first waits until at least one record is written, unless
    /// none is in flight or the writer failed, for at most `timeout` (`None`: no limit). Lets a
    /// caller whose buffers are all in flight wait for the first one back instead of spinning.
    pub fn poll_wait(&self, timeout: Option<Duration>) -> Result<Vec<Completion>> {
        self.live()?.shared.wait_for_completion(timeout);
        self.poll()
    }

    /// Waits until every record submitted so far is written and, unless durability is
    /// `None`, fsynced.
    pub fn flush(&self) -> Result<()> {
        let inner = self.live()?;
        let (upto, to_io) = {
            let side = inner.submit.lock();
            if side.closed {
                return Err(Error::Closed(None));
            }
            (
                side.next_seq,
                side.to_io.clone().expect("open writer has an I/O queue"),
            )
        };
        inner.shared.check()?;
        let (ack, acked) = crossbeam_channel::bounded(1);
        // The I/O thread answers every flush it takes: once the records up to `upto` are
        // written and, with a durability policy, the sync thread has done every fsync sent
        // before the answer; or at once after a failure, which `check` then returns. A flush
        // never answered (the send refused, the answer dropped) found the I/O thread gone: a
        // `close` that raced this call stopped it (the final fsync then runs on the sync
        // thread, which that `close` joins, not this call), or a thread died and dropped the
        // answer before its failure was recorded. Whether the records are durable is then
        // unknown here, so that is `Closed`, never Ok: it used to be Ok once they were written.
        let answered = to_io.send(ToIo::Flush { upto, ack }).is_ok() && acked.recv().is_ok();
        inner.shared.check()?;
        if !answered {
            let why = if inner.submit.lock().closed {
                "the writer was closed while flush waited; close reports whether it completed"
            } else {
                "the writer's I/O thread stopped before it completed the flush"
            };
            return Err(Error::Closed(Some(why.into())));
        }
        if !inner.shared.all_written_upto(upto) {
            return Err(Error::Closed(Some(
                "the writer's I/O thread stopped".into(),
            )));
        }
        Ok(())
    }

    /// Writes everything submitted, completes the open shard (index and trailer), fsyncs per
    /// the durability policy (it returns once every shard's `fsync` is done), releases the lock
    /// and stops the threads. Idempotent. Records it completed can still be collected with
    /// [`ShardWriter::poll`].
    pub fn close(&self) -> Result<()> {
        let inner = self.live()?;
        let (upto, jobs, to_io) = {
            let mut side = inner.submit.lock();
            if side.closed {
                return Ok(());
            }
            side.closed = true;
            (side.next_seq, side.jobs.take(), side.to_io.take())
        };
        drop(jobs); // workers finish the queued jobs, then stop
        if let Some(to_io) = to_io {
            let (ack, acked) = crossbeam_channel::bounded(1);
            if to_io.send(ToIo::Close { upto, ack }).is_ok() {
                let _ = acked.recv();
            }
        }
        // The sync thread ends once the I/O thread is gone and every fsync it was handed is done.
        for t in inner.threads.lock().drain(..) {
            let _ = t.join(); // panics were turned into errors by `spawn`
        }
        if let Some(e) = inner.shared.take_error() {
            return Err(e);
        }
        if !inner.shared.failed() && !inner.shared.all_written_upto(upto) {
            return Err(Error::Closed(Some(
                "the writer's I/O thread stopped early".into(),
            )));
        }
        Ok(())
    }

    /// The writer's counters. Refused in a forked child like every call that takes the
    /// writer's locks: a thread of the parent may have held one at the fork, and no thread of
    /// the child will ever release it.
    pub fn stats(&self) -> Result<Stats> {
        let inner = self.live()?;
        Ok(inner.shared.stats(inner.backend, inner.encoders))
    }

    /// The I/O backend in use.
    pub fn backend(&self) -> Backend {
        self.inner.backend
    }

    /// The OS thread ids of this writer's compression threads (Linux; empty elsewhere), for a
    /// caller that changes their scheduling: threads still starting are waited for, up to
    /// `wait`. In a forked child (where the threads do not exist) an error.
    pub fn encoder_thread_ids(&self, wait: Duration) -> Result<Vec<i64>> {
        let inner = self.live()?;
        Ok(inner.encoder_ids.wait_for(inner.encoders, wait))
    }

    /// The writer id in the names of this writer's shards.
    pub fn writer_id(&self) -> &str {
        &self.inner.writer_id
    }

    /// The dataset directory.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// The writer, if this is the process that opened it.
    fn live(&self) -> Result<&Inner> {
        let me = std::process::id();
        if me != self.inner.pid {
            return Err(Error::Closed(Some(format!(
                "this writer belongs to process {}; it cannot be used in a forked child \
                 (process {me}); open a new writer in the child",
                self.inner.pid
            ))));
        }
        Ok(&self.inner)
    }
}

impl Drop for ShardWriter {
    fn drop(&mut self) {
        if std::process::id() != self.inner.pid {
            // A forked child: the threads and the ring do not exist here and the locks are
            // shared with the parent. Leak everything rather than touch the parent's state.
            return;
        }
        let _ = self.close();
        // SAFETY: dropped exactly once, here, and never used again.
        unsafe { ManuallyDrop::drop(&mut self.inner) };
    }
}

/// Starts a named writer thread; a panic in it fails the writer instead of hanging it.
fn spawn(
    dir: &Path,
    name: String,
    shared: Arc<Shared>,
    body: impl FnOnce() + Send + 'static,
) -> Result<JoinHandle<()>> {
    let thread_name = name.clone();
    std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                shared.fail(Error::Closed(Some(format!(
                    "thread {thread_name} panicked: {what}"
                ))));
            }
        })
        .map_err(|e| Error::io(dir, "spawn thread", e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A flush the I/O thread never answers is not a success. Here the thread has stopped, as
    /// it does when a `close` racing the flush reaches it first; the flush used to return Ok
    /// because the records were written, before the close's final fsync was done.
    #[test]
    fn a_flush_the_io_thread_never_answers_is_closed() {
        let dir = tempfile::tempdir().unwrap();
        let w = ShardWriter::open(dir.path(), WriterConfig::default()).unwrap();
        let spec = crate::blob::TensorSpec {
            name: "x".into(),
            dtype: crate::dtype::Dtype::U8,
            shape: vec![8],
        };
        w.submit(RecordInput {
            key: "a".into(),
            tensors: vec![TensorInput::new(spec, vec![0u8; 8])],
            metadata: std::collections::BTreeMap::new(),
            num_tokens: 0,
        })
        .unwrap();
        // What a racing `close` does to the I/O thread, without marking the writer closed.
        let to_io = w.inner.submit.lock().to_io.clone().unwrap();
        let (ack, acked) = crossbeam_channel::bounded(1);
        to_io.send(ToIo::Close { upto: 1, ack }).unwrap();
        acked.recv().unwrap();
        let io = {
            let mut threads = w.inner.threads.lock();
            let at = threads
                .iter()
                .position(|t| t.thread().name() == Some("layertap-io"))
                .unwrap();
            threads.remove(at)
        };
        io.join().unwrap();
        assert!(w.inner.shared.all_written_upto(1), "the record is written");
        match w.flush() {
            Err(Error::Closed(Some(why))) => assert!(why.contains("I/O thread stopped"), "{why}"),
            other => panic!("want Closed, got {other:?}"),
        }
        w.close().unwrap();
    }

    /// A forked child inherits the writer's state lock as it was at the fork, and no thread of
    /// the child will ever release it: `stats` must refuse before taking it (it used to take
    /// it first, and the child hung).
    #[test]
    fn stats_in_a_forked_child_refuses_without_taking_the_lock() {
        let dir = tempfile::tempdir().unwrap();
        let w = ShardWriter::open(dir.path(), WriterConfig::default()).unwrap();
        let held = w.inner.shared.hold_lock(); // as a writer thread may hold it at a fork
                                               // SAFETY: the child only calls `stats` and leaves with `_exit`, running no destructor.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let refused =
                matches!(w.stats(), Err(Error::Closed(Some(m))) if m.contains("forked child"));
            // SAFETY: ends the child at once, leaving the parent's writer alone.
            unsafe { libc::_exit(if refused { 0 } else { 1 }) };
        }
        drop(held);
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut status = 0;
        loop {
            // SAFETY: polls the child we forked; `status` is valid for writes.
            let r = unsafe { libc::waitpid(pid, &raw mut status, libc::WNOHANG) };
            if r == pid {
                break;
            }
            assert_eq!(r, 0, "waitpid: {}", std::io::Error::last_os_error());
            if Instant::now() > deadline {
                // SAFETY: kills and reaps the child we forked.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, &raw mut status, 0);
                }
                panic!("stats() hung in the forked child on the lock held at the fork");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "child status {status}"
        );
        assert_eq!(w.stats().unwrap().records_submitted, 0);
        w.close().unwrap();
    }
}
