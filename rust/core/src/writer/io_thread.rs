//! The I/O thread (`layertap-io`): puts encoded records back in submission order, coalesces
//! them into writes of about `batch_bytes`, rotates shards, applies the durability policy,
//! reports records done, and answers `flush` and `close`.

use super::batch::{WriteOp, IOV_MAX};
use super::config::Durability;
use super::encode::Encoded;
use super::io::{Engine, Finished};
use super::shard::{OpenShard, ShardNaming};
use super::state::{Completion, Shared};
use crate::error::{Error, Result};
use crate::format::IndexEntry;
use crossbeam_channel::{Receiver, Sender};
use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::sync::Arc;

/// Messages to the I/O thread.
pub(crate) enum ToIo {
    /// A worker encoded a record.
    Encoded(Encoded),
    /// A worker could not encode a record.
    Failed { raw_len: u64, error: Error },
    /// Answer `ack` once every record before `upto` is written (and synced, per policy).
    Flush { upto: u64, ack: Sender<()> },
    /// Like `Flush`, then complete the open shard and stop.
    Close { upto: u64, ack: Sender<()> },
}

/// The I/O thread's fixed settings.
pub(crate) struct IoSettings {
    pub naming: ShardNaming,
    /// The index of the next shard to create.
    pub next_index: u64,
    pub shard_size: u64,
    pub batch_bytes: u64,
    pub durability: Durability,
}

struct Waiter {
    upto: u64,
    ack: Sender<()>,
    close: bool,
}

/// A write handed to the engine, in issue order; `outcome` is set when it finishes.
struct Issued {
    id: u64,
    outcome: Option<(WriteOp, io::Result<()>)>,
}

struct IoLoop {
    set: IoSettings,
    engine: Box<dyn Engine>,
    shared: Arc<Shared>,
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
    shard: Option<OpenShard>,
    next_index: u64,
    since_sync: u64,
    waiters: Vec<Waiter>,
    failed: bool,
}

/// The body of the I/O thread. `first_shard` was created by `open`, so that errors
/// (permissions, a clash of writer ids) show at once.
pub(crate) fn run(
    set: IoSettings,
    first_shard: OpenShard,
    engine: Box<dyn Engine>,
    rx: Receiver<ToIo>,
    shared: Arc<Shared>,
) {
    let next_index = set.next_index;
    let shard = Some(first_shard);
    let mut lp = IoLoop {
        set,
        engine,
        shared,
        reorder: BTreeMap::new(),
        ready: VecDeque::new(),
        next_ready: 0,
        written_upto: 0,
        issued: VecDeque::new(),
        next_op_id: 0,
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
                        self.waiters.push(Waiter { upto: self.next_ready, ack, close: true });
                    }
                }
            }
            while let Ok(m) = rx.try_recv() {
                self.handle(m);
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
            ToIo::Flush { upto, ack } => self.waiters.push(Waiter { upto, ack, close: false }),
            ToIo::Close { upto, ack } => self.waiters.push(Waiter { upto, ack, close: true }),
        }
    }

    /// Issues writes, collects finished ones, retires them in order, syncs per policy.
    fn step(&mut self) -> Result<()> {
        if self.failed {
            return Ok(());
        }
        let issued_any = self.issue()?;
        let wait = self.engine.in_flight() > 0 && !issued_any;
        let finished = self.engine.reap(wait).map_err(|e| self.io_err("io_uring_enter", e))?;
        self.mark(finished);
        if self.issued.iter().any(|i| matches!(i.outcome, Some((_, Err(_))))) {
            // A write failed: let every other write in flight finish, so that those before it
            // can still be reported and no buffer is freed while the kernel may read it.
            while self.engine.in_flight() > 0 {
                let finished = self.engine.reap(true).map_err(|e| self.io_err("io_uring_enter", e))?;
                self.mark(finished);
            }
        }
        self.retire()?;
        if let Durability::EveryBytes(n) = self.set.durability {
            if self.since_sync >= n {
                if let Some(shard) = &self.shard {
                    shard.sync()?;
                }
                self.since_sync = 0;
            }
        }
        Ok(())
    }

    /// Gives ready records to the engine, batched, while it has room. Returns whether it
    /// issued anything.
    fn issue(&mut self) -> Result<bool> {
        let mut issued_any = false;
        while !self.ready.is_empty() && self.engine.in_flight() < self.engine.capacity() {
            let first_len = self.ready[0].frame_len();
            if let Some(shard) = &self.shard {
                if shard.is_full_for(first_len, self.set.shard_size) {
                    if !self.issued.is_empty() {
                        break; // rotate once the shard's writes are done
                    }
                    self.finish_shard()?;
                }
            }
            if self.shard.is_none() {
                let durable = self.set.durability != Durability::None;
                self.shard = Some(OpenShard::create(&self.set.naming, self.next_index, durable)?);
                self.next_index += 1;
            }
            let shard = self.shard.as_mut().expect("shard just opened");
            let mut batch = Vec::new();
            let (mut bytes, mut iovs) = (0u64, 0usize);
            while let Some(rec) = self.ready.front() {
                let len = rec.frame_len();
                let pieces = rec.piece_count();
                let fits_batch = bytes + len <= self.set.batch_bytes && iovs + pieces <= IOV_MAX;
                if !batch.is_empty() && (!fits_batch || shard.is_full_for(bytes + len, self.set.shard_size)) {
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
                break;
            }
            let op = WriteOp::new(shard.fd(), shard.alloc_end, batch);
            shard.alloc_end = op.end();
            let id = self.next_op_id;
            self.next_op_id += 1;
            self.issued.push_back(Issued { id, outcome: None });
            self.engine.submit(id, op);
            issued_any = true;
        }
        Ok(issued_any)
    }

    fn mark(&mut self, finished: Vec<Finished>) {
        for f in finished {
            if let Some(slot) = self.issued.iter_mut().find(|i| i.id == f.id) {
                slot.outcome = Some((f.op, f.result));
            }
        }
    }

    /// Reports the writes finished at the front of the issue order; fails at a failed one.
    fn retire(&mut self) -> Result<()> {
        while let Some(Issued { outcome: Some((_, result)), .. }) = self.issued.front() {
            if let Err(e) = result {
                // Left at the front, so nothing after it is ever retired.
                let e = match e.raw_os_error() {
                    Some(code) => io::Error::from_raw_os_error(code),
                    None => io::Error::new(e.kind(), e.to_string()),
                };
                return Err(self.io_err("write", e));
            }
            let (op, _) = self.issued.pop_front().and_then(|i| i.outcome).expect("checked");
            let shard = self.shard.as_mut().expect("writes go to the open shard");
            let mut done = Vec::with_capacity(op.frames.len());
            for (offset, rec) in &op.frames {
                shard.entries.push(IndexEntry::for_frame(*offset, &rec.header));
                done.push(Completion {
                    seq: rec.seq,
                    key: rec.header.key.clone(),
                    shard: shard.path.clone(),
                    offset: *offset,
                    stored_len: rec.header.stored_len,
                    raw_len: rec.header.raw_len,
                });
            }
            self.since_sync += op.end() - shard.written_end;
            shard.written_end = op.end();
            self.written_upto = op.frames.last().map(|(_, r)| r.seq + 1).unwrap_or(self.written_upto);
            drop(op); // releases the caller's buffers before the records are reported
            self.shared.written(done);
        }
        Ok(())
    }

    /// Answers the flushes and closes whose records are written. Returns whether to stop.
    fn answer_waiters(&mut self) -> bool {
        let mut stop = false;
        let mut i = 0;
        while i < self.waiters.len() {
            let w = &self.waiters[i];
            let ready = self.failed || (w.upto <= self.written_upto && (!w.close || self.issued.is_empty()));
            if !ready {
                i += 1;
                continue;
            }
            let w = self.waiters.swap_remove(i);
            if !self.failed {
                let done = if w.close { self.finish_shard() } else { self.sync_for_flush() };
                if let Err(e) = done {
                    self.fail(e);
                }
            }
            stop |= w.close;
            let _ = w.ack.send(());
        }
        stop
    }

    fn sync_for_flush(&mut self) -> Result<()> {
        if self.set.durability == Durability::None {
            return Ok(());
        }
        if let Some(shard) = &self.shard {
            shard.sync()?;
            self.since_sync = 0;
        }
        Ok(())
    }

    /// Completes the open shard (if any). Its writes must all be retired.
    fn finish_shard(&mut self) -> Result<()> {
        if !self.issued.is_empty() {
            return Ok(()); // not everything is written: leave it open (recoverable)
        }
        if let Some(shard) = self.shard.take() {
            shard.finish(self.set.durability != Durability::None)?;
            self.shared.shard_closed();
            self.since_sync = 0;
        }
        Ok(())
    }

    fn io_err(&self, op: &'static str, e: io::Error) -> Error {
        let path = self.shard.as_ref().map(|s| s.path.clone()).unwrap_or_else(|| self.set.naming.dir.clone());
        Error::io(path, op, e)
    }

    /// Stops for good after `e`: waits for writes in flight, cuts the shard back to its last
    /// whole frame, drops every queued record, and keeps `e` for the caller.
    fn fail(&mut self, e: Error) {
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
        if let Some(shard) = self.shard.take() {
            shard.truncate_to_written();
        }
        let mut abandoned = 0;
        for i in self.issued.drain(..) {
            if let Some((op, _)) = i.outcome {
                abandoned += op.frames.iter().map(|(_, r)| r.header.raw_len).sum::<u64>();
            }
        }
        for rec in self.ready.drain(..).chain(std::mem::take(&mut self.reorder).into_values()) {
            abandoned += rec.header.raw_len;
        }
        self.shared.fail(e);
        self.shared.abandoned(abandoned);
    }
}
