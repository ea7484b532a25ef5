//! The I/O thread (`layertap-io`): puts encoded records back in submission order, coalesces
//! them into writes of about `batch_bytes` (staged in aligned buffers for direct I/O, see
//! `direct.rs`), rotates shards, applies the durability policy by handing `fsync`s to the sync
//! thread (`sync.rs`), reports records done once all their bytes are in the file, and answers
//! `flush` and `close`.

use super::aligned::BufferPool;
use super::batch::{Placed, WriteOp, IOV_MAX};
use super::config::Durability;
use super::direct;
use super::encoded::{Encoded, ToIo};
use super::io::{Engine, Finished};
use super::shard::{OpenShard, ShardNaming};
use super::state::{Completion, Shared};
use super::sync::{SyncJob, Syncer};
use crate::error::{Error, Result};
use crate::format::IndexEntry;
use crossbeam_channel::{Receiver, Sender};
use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::sync::Arc;

/// The I/O thread's fixed settings.
pub(crate) struct IoSettings {
    pub naming: ShardNaming,
    /// The index of the next shard to create.
    pub next_index: u64,
    pub shard_size: u64,
    pub batch_bytes: u64,
    pub durability: Durability,
    /// Write record data with `O_DIRECT` where the file system allows it.
    pub direct: bool,
}

/// Direct I/O: bounce-buffer bytes in flight at most, in batches (chunks of `batch_bytes`).
/// Direct writes run concurrently where the file system allows it (XFS appends; ext4
/// serialises appending direct writes, which still overlaps the copy into the next chunk).
const DIRECT_DEPTH: u64 = 4;
/// Buffered writes in flight at most: io_uring's workers run buffered writes to one file one
/// at a time, so more in flight only delays their completions.
const BUFFERED_DEPTH: usize = 2;

struct Waiter {
    upto: u64,
    ack: Sender<()>,
    close: bool,
}

/// A write handed to the engine, in issue order; `outcome` is set when it finishes.
struct Issued {
    id: u64,
    /// Bytes of bounce buffer the write holds.
    staged: u64,
    outcome: Option<(WriteOp, io::Result<()>)>,
}

struct IoLoop {
    set: IoSettings,
    engine: Box<dyn Engine>,
    shared: Arc<Shared>,
    /// Where the `fsync`s go; `None` with durability `None`.
    syncer: Option<Syncer>,
    /// Encoded records that arrived before an earlier one.
    reorder: BTreeMap<u64, Encoded>,
    /// Records in order, not yet given to a write.
    ready: VecDeque<Encoded>,
    /// The sequence number the next ready record must have.
    next_ready: u64,
    /// Every record before this one is written.
    written_upto: u64,
    issued: VecDeque<Issued>,
    next_op_id: u64,
    /// Bounce-buffer bytes of the writes in flight (direct I/O).
    staged_in_flight: u64,
    /// Bounce buffers for direct writes.
    pool: BufferPool,
    shard: Option<OpenShard>,
    next_index: u64,
    since_sync: u64,
    waiters: Vec<Waiter>,
    failed: bool,
}

/// The body of the I/O thread. `first_shard` was created by `open`, so that errors
/// (permissions, a clash of writer ids) show at once. `syncer` (with a durability policy) is
/// the only sender to the sync thread, which ends after this thread.
pub(crate) fn run(
    set: IoSettings,
    first_shard: OpenShard,
    engine: Box<dyn Engine>,
    rx: Receiver<ToIo>,
    syncer: Option<Syncer>,
    shared: Arc<Shared>,
) {
    let next_index = set.next_index;
    let shard = Some(first_shard);
    // Bounce buffers are chunks of about `batch_bytes` (rounded up to the alignment).
    let chunk_max = (set.batch_bytes as usize).next_multiple_of(direct::MAX_ALIGN);
    let pool = BufferPool::new(DIRECT_DEPTH as usize + 1, chunk_max);
    let mut lp = IoLoop {
        set,
        engine,
        shared,
        syncer,
        reorder: BTreeMap::new(),
        ready: VecDeque::new(),
        next_ready: 0,
        written_upto: 0,
        issued: VecDeque::new(),
        next_op_id: 0,
        staged_in_flight: 0,
        pool,
        shard,
        next_index,
        since_sync: 0,
        waiters: Vec::new(),
        failed: false,
    };
    lp.run(rx);
}

impl IoLoop {
    fn run(&mut self, rx: Receiver<ToIo>) {
        let mut disconnected = false;
        loop {
            if self.idle() {
                if disconnected {
                    break; // nothing more can arrive or be done
                }
                match rx.recv() {
                    Ok(m) => self.handle(m),
                    Err(_) => {
                        // Every sender is gone without a close: write what arrived, then
                        // complete the shard as a close would.
                        disconnected = true;
                        let (ack, _) = crossbeam_channel::bounded(1);
                        self.waiters.push(Waiter {
                            upto: self.next_ready,
                            ack,
                            close: true,
                        });
                    }
                }
            }
            while let Ok(m) = rx.try_recv() {
                self.handle(m);
            }
            if !self.failed && self.syncer.as_ref().is_some_and(Syncer::failed) {
                self.stop(None); // the sync thread kept its error for the caller
            }
            if let Err(e) = self.step() {
                self.fail(e);
            }
            if self.answer_waiters() {
                break;
            }
        }
    }

    /// Whether nothing can happen until a message arrives.
    fn idle(&self) -> bool {
        self.failed
            || (self.ready.is_empty()
                && self.engine.in_flight() == 0
                && self.issued.is_empty()
                && !self.shard.as_ref().is_some_and(OpenShard::is_staging)
                && !self.waiters.iter().any(|w| w.upto <= self.written_upto))
    }

    fn handle(&mut self, m: ToIo) {
        match m {
            ToIo::Encoded(rec) if self.failed => self.shared.abandoned(rec.header.raw_len),
            ToIo::Failed { raw_len, .. } if self.failed => self.shared.abandoned(raw_len),
            ToIo::Encoded(rec) => {
                self.reorder.insert(rec.seq, rec);
                while let Some(rec) = self.reorder.remove(&self.next_ready) {
                    self.next_ready += 1;
                    self.ready.push_back(rec);
                }
            }
            ToIo::Failed { raw_len, error, .. } => {
                self.shared.abandoned(raw_len);
                self.fail(error);
            }
            ToIo::Flush { upto, ack } => self.waiters.push(Waiter {
                upto,
                ack,
                close: false,
            }),
            ToIo::Close { upto, ack } => self.waiters.push(Waiter {
                upto,
                ack,
                close: true,
            }),
        }
    }

    /// Issues writes, collects finished ones, retires them in order, syncs per policy.
    fn step(&mut self) -> Result<()> {
        if self.failed {
            return Ok(());
        }
        let issued_any = self.issue()?;
        let wait = self.engine.in_flight() > 0 && !issued_any;
        let finished = self
            .engine
            .reap(wait)
            .map_err(|e| self.io_err("wait for writes", e))?;
        self.mark(finished);
        if self
            .issued
            .iter()
            .any(|i| matches!(i.outcome, Some((_, Err(_)))))
        {
            // A write failed: let every other write in flight finish, so that those before it
            // can still be reported and no buffer is freed while the kernel may read it.
            while self.engine.in_flight() > 0 {
                let finished = self
                    .engine
                    .reap(true)
                    .map_err(|e| self.io_err("wait for writes", e))?;
                self.mark(finished);
            }
        }
        self.retire()?;
        if self.ready.is_empty() {
            self.flush_tail()?; // nothing more to write now: the last records must not wait
        }
        if let Durability::EveryBytes(n) = self.set.durability {
            if self.since_sync >= n {
                if let Some(shard) = &self.shard {
                    self.sync(SyncJob::Data(shard.sync_handle()))?;
                }
                self.since_sync = 0;
            }
        }
        Ok(())
    }

    /// Gives ready records to the engine, batched (and, for direct I/O, staged in chunks),
    /// while it has room. Returns whether it issued anything.
    fn issue(&mut self) -> Result<bool> {
        let mut issued_any = false;
        while self.has_room() {
            if !self.shard.as_ref().is_some_and(OpenShard::is_staging) {
                let Some((start, batch)) = self.take_batch()? else {
                    break;
                };
                let shard = self
                    .shard
                    .as_mut()
                    .expect("the batch went to the open shard");
                match shard.direct.as_mut() {
                    Some(direct) => {
                        let mut at = start;
                        for rec in &batch {
                            let header = rec.header.clone();
                            shard.unreported.push_back(Placed {
                                seq: rec.seq,
                                offset: at,
                                header,
                            });
                            at += rec.frame_len();
                        }
                        direct.enqueue(batch);
                    }
                    None => {
                        let (op, placed) = WriteOp::frames(shard.fd(), start, batch);
                        shard.unreported.extend(placed);
                        self.submit(op);
                        issued_any = true;
                        continue;
                    }
                }
            }
            let shard = self.shard.as_mut().expect("staging goes to the open shard");
            let fd = shard.fd();
            let direct = shard.direct.as_mut().expect("only direct shards stage");
            if let Some(op) = direct.stage_chunk(&mut self.pool, fd) {
                self.submit(op);
                issued_any = true;
            } // else less than a block: carried to the next write
        }
        Ok(issued_any)
    }

    /// Takes the next ready records for one write: consecutive, about `batch_bytes` (less the
    /// bytes a direct shard carries), all for the open shard, which is rotated or created as
    /// needed. Returns the offset of the first and the records, or `None` if there are none
    /// or the shard cannot rotate yet (writes of it are in flight).
    fn take_batch(&mut self) -> Result<Option<(u64, Vec<Encoded>)>> {
        let Some(first) = self.ready.front() else {
            return Ok(None);
        };
        let first_len = first.frame_len();
        if let Some(shard) = &self.shard {
            if shard.is_full_for(first_len, self.set.shard_size) {
                if !self.issued.is_empty() {
                    return Ok(None); // rotate once the shard's writes are done
                }
                self.finish_shard()?;
            }
        }
        if self.shard.is_none() {
            let chunk = self.set.direct.then_some(self.set.batch_bytes);
            let shard = OpenShard::create(&self.set.naming, self.next_index, chunk)?;
            self.shared.set_direct(shard.is_direct());
            self.shard = Some(shard);
            self.next_index += 1;
            if self.syncer.is_some() {
                self.sync(SyncJob::Dir(self.set.naming.dir.clone()))?;
            }
        }
        let shard = self.shard.as_mut().expect("shard just opened");
        let carried = shard.direct.as_ref().map_or(0, |d| d.carry.len() as u64);
        let limit = self.set.batch_bytes.saturating_sub(carried);
        let mut batch = Vec::new();
        let (mut bytes, mut iovs) = (0u64, 0usize);
        while let Some(rec) = self.ready.front() {
            let len = rec.frame_len();
            let pieces = rec.piece_count();
            let fits_batch = bytes + len <= limit && iovs + pieces <= IOV_MAX;
            if !batch.is_empty()
                && (!fits_batch || shard.is_full_for(bytes + len, self.set.shard_size))
            {
                break;
            }
            if batch.is_empty() && shard.is_full_for(len, self.set.shard_size) {
                break;
            }
            bytes += len;
            iovs += pieces;
            shard.allocated += 1;
            batch.push(self.ready.pop_front().expect("front exists"));
        }
        if batch.is_empty() {
            return Ok(None);
        }
        let start = shard.alloc_end;
        shard.alloc_end += bytes;
        Ok(Some((start, batch)))
    }

    /// Hands `op` to the engine.
    fn submit(&mut self, op: WriteOp) {
        let id = self.next_op_id;
        self.next_op_id += 1;
        let staged = op.staged_len();
        self.staged_in_flight += staged;
        self.issued.push_back(Issued {
            id,
            staged,
            outcome: None,
        });
        self.engine.submit(id, op);
    }

    /// Whether another write may be issued: the engine has room, and the writes in flight
    /// stay within [`DIRECT_DEPTH`] chunks (direct I/O) or [`BUFFERED_DEPTH`] writes.
    fn has_room(&self) -> bool {
        let in_flight = self.engine.in_flight();
        if in_flight >= self.engine.capacity() {
            return false;
        }
        if self.shard.as_ref().is_some_and(|s| s.direct.is_some()) {
            self.staged_in_flight == 0
                || self.staged_in_flight < DIRECT_DEPTH * self.set.batch_bytes
        } else {
            in_flight < BUFFERED_DEPTH
        }
    }

    fn mark(&mut self, finished: Vec<Finished>) {
        for f in finished {
            if let Some(slot) = self.issued.iter_mut().find(|i| i.id == f.id) {
                slot.outcome = Some((f.op, f.result));
            }
        }
    }

    /// Retires the writes finished at the front of the issue order and reports the records
    /// whose bytes are now all in the file; fails at a failed write.
    fn retire(&mut self) -> Result<()> {
        while let Some(Issued {
            outcome: Some((op, result)),
            ..
        }) = self.issued.front()
        {
            if let Err(e) = result {
                // Left at the front, so nothing after it is ever retired. The bytes before
                // `op.offset` are in the file (a full disk takes part of a write, then refuses
                // the rest): the records wholly among them are reported, not lost with the
                // batch (a batch is up to `batch_bytes`, 8 MiB by default).
                let e = match e.raw_os_error() {
                    Some(code) => io::Error::from_raw_os_error(code),
                    None => io::Error::new(e.kind(), e.to_string()),
                };
                let reached = op.offset;
                if let Some(shard) = self.shard.as_mut() {
                    shard.file_end = shard.file_end.max(reached);
                }
                self.report_written();
                return Err(self.io_err("write", e));
            }
            let issued = self.issued.pop_front().expect("checked");
            let (op, _) = issued.outcome.expect("checked");
            self.staged_in_flight -= issued.staged;
            let shard = self.shard.as_mut().expect("writes go to the open shard");
            shard.file_end = shard.file_end.max(op.end());
            if issued.staged == 0 && self.set.durability != Durability::None {
                shard.start_writeback(op.start(), op.end()); // buffered data that will be fsynced
            }
            if op.fell_back {
                if let Some(direct) = shard.direct.as_mut() {
                    direct.refused = true; // the rest of this shard goes through the page cache
                    self.shared.set_direct(false);
                }
            }
            // A bounce buffer goes back to the pool; a write of frames releases the caller's
            // buffers here, before the records are reported.
            if let Some(buf) = op.into_bounce() {
                self.pool.put(buf);
            }
            self.report_written();
        }
        Ok(())
    }

    /// Reports the frames of the open shard that lie wholly before its `file_end`.
    fn report_written(&mut self) {
        let Some(shard) = self.shard.as_mut() else {
            return;
        };
        let mut done = Vec::new();
        while shard
            .unreported
            .front()
            .is_some_and(|p| p.end() <= shard.file_end)
        {
            let p = shard.unreported.pop_front().expect("checked");
            shard
                .entries
                .push(IndexEntry::for_frame(p.offset, &p.header));
            self.since_sync += p.end() - shard.written_end;
            shard.written_end = p.end();
            self.written_upto = p.seq + 1;
            done.push(Completion {
                seq: p.seq,
                shard: shard.path.clone(),
                offset: p.offset,
                stored_len: p.header.stored_len,
                raw_len: p.header.raw_len,
                key: p.header.key,
            });
        }
        if !done.is_empty() {
            self.shared.written(done);
        }
    }

    /// Direct I/O, once no write is in flight: writes the carried partial block through the
    /// page cache, so that the records ending in it are in the file and reported.
    fn flush_tail(&mut self) -> Result<()> {
        let Some(shard) = self.shard.as_mut() else {
            return Ok(());
        };
        let Some(direct) = shard.direct.as_ref() else {
            return Ok(());
        };
        if !self.issued.is_empty() || shard.unreported.is_empty() || direct.is_staging() {
            return Ok(());
        }
        let end = direct
            .write_tail(shard.file())
            .map_err(|e| Error::io(&shard.path, "write", e))?;
        shard.file_end = shard.file_end.max(end);
        self.report_written();
        Ok(())
    }

    /// Answers the flushes and closes whose records are written. Returns whether to stop.
    fn answer_waiters(&mut self) -> bool {
        let mut stop = false;
        let mut i = 0;
        while i < self.waiters.len() {
            let w = &self.waiters[i];
            let ready = self.failed
                || (w.upto <= self.written_upto && (!w.close || self.issued.is_empty()));
            if !ready {
                i += 1;
                continue;
            }
            let w = self.waiters.swap_remove(i);
            stop |= w.close;
            if self.failed {
                let _ = w.ack.send(());
            } else if w.close {
                // `close` joins the sync thread after this answer, so it still waits for the
                // `fsync` of this shard.
                if let Err(e) = self.finish_shard() {
                    self.fail(e);
                }
                let _ = w.ack.send(());
            } else if let Err(e) = self.sync_for_flush(w.ack) {
                self.fail(e); // the ack is dropped, which wakes the caller, who sees the error
            }
        }
        stop
    }

    /// Answers a flush whose records are written: at once without a durability policy, else
    /// through the sync thread once the open shard and every shard before it are synced.
    fn sync_for_flush(&mut self, ack: Sender<()>) -> Result<()> {
        if self.syncer.is_none() {
            let _ = ack.send(());
            return Ok(());
        }
        if let Some(shard) = &self.shard {
            self.sync(SyncJob::Data(shard.sync_handle()))?;
            self.since_sync = 0;
        }
        self.sync(SyncJob::Barrier(ack))
    }

    /// Completes the open shard (if any). Its writes must all be retired. With a durability
    /// policy the sync thread `fsync`s and closes it (and counts it closed); the records are
    /// reported already and readable, so nothing waits for that here.
    fn finish_shard(&mut self) -> Result<()> {
        if !self.issued.is_empty() {
            return Ok(()); // not everything is written: leave it open (recoverable)
        }
        self.flush_tail()?;
        if let Some(shard) = self.shard.take() {
            let complete = shard.finish()?;
            self.since_sync = 0;
            if self.syncer.is_some() {
                self.sync(SyncJob::Finish(complete))?;
            } else {
                drop(complete); // closes the file (`finish` released the lock)
                self.shared.shard_closed();
            }
        }
        Ok(())
    }

    /// Hands `job` to the sync thread; waits while it is behind (see `sync.rs`).
    fn sync(&self, job: SyncJob) -> Result<()> {
        self.syncer
            .as_ref()
            .expect("a durability policy has a sync thread")
            .send(job)
    }

    /// After a failure, writes the index of the records reported so far into `shard` (cut
    /// back to them already), best effort: the error that stopped the writer is what the
    /// caller sees. With a durability policy the shard is `fsync`ed here, as its last records
    /// were reported before their `fsync`.
    fn complete_after_failure(&self, shard: OpenShard) {
        let written_end = shard.written_end;
        let mut shard = shard;
        shard.unreported.clear();
        shard.alloc_end = written_end;
        if let Ok(complete) = shard.finish() {
            if self.syncer.is_some() {
                let _ = complete.sync_all();
            }
            self.shared.shard_closed();
        }
    }

    fn io_err(&self, op: &'static str, e: io::Error) -> Error {
        let path = self
            .shard
            .as_ref()
            .map(|s| s.path.clone())
            .unwrap_or_else(|| self.set.naming.dir.clone());
        Error::io(path, op, e)
    }

    /// Stops for good after `e`: see [`IoLoop::stop`].
    fn fail(&mut self, e: Error) {
        self.stop(Some(e));
    }

    /// Stops for good: waits for writes in flight, cuts the shard back to its last whole frame,
    /// drops every queued record, and keeps `e` for the caller (`None`: the sync thread kept
    /// its error already).
    fn stop(&mut self, e: Option<Error>) {
        if self.failed {
            return;
        }
        self.failed = true;
        let mut guard = 0;
        while self.engine.in_flight() > 0 && guard < 1000 {
            guard += 1;
            match self.engine.reap(true) {
                Ok(f) => self.mark(f),
                Err(_) => break, // the engine keeps (or leaks) what is still in the kernel
            }
        }
        // Writes that finished well before the failed one are still reported.
        let _ = self.retire();
        let mut abandoned = 0;
        if let Some(shard) = self.shard.take() {
            shard.truncate_to_written();
            abandoned += shard
                .unreported
                .iter()
                .map(|p| p.header.raw_len)
                .sum::<u64>();
            if matches!(e, Some(Error::DiskFull { .. })) {
                // Cutting the partial frame off gave back its space: the index fits there more
                // often than not, and a complete shard needs no `recover` (which would need
                // that space too). If it does not fit, the shard stays cut to whole frames.
                self.complete_after_failure(shard);
            }
        }
        let mut e = e;
        if let Some(Error::DiskFull {
            dir, free_bytes, ..
        }) = e.as_mut()
        {
            // What is free now, as `df` shows it: the part of the record that did not fit is
            // cut off and the index written (the moment of the failure always said ~0).
            *free_bytes = crate::error::free_bytes(dir).or(*free_bytes);
        }
        // Finished writes are freed; any still in the kernel stay with the engine.
        self.issued.clear();
        for rec in self
            .ready
            .drain(..)
            .chain(std::mem::take(&mut self.reorder).into_values())
        {
            abandoned += rec.header.raw_len;
        }
        if let Some(e) = e {
            self.shared.fail(e);
        }
        self.shared.abandoned(abandoned);
    }
}
