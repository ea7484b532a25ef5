//! The io_uring backend: up to [`MAX_IN_FLIGHT`] vectored writes in flight, each op kept in a
//! slab keyed by its `user_data` until its completion arrives.

use super::{Engine, Finished};
use crate::writer::batch::WriteOp;
use crate::writer::config::Backend;
use io_uring::{opcode, types, IoUring, Probe};
use std::collections::HashMap;
use std::io;

/// Writes in flight at most. Each is up to `batch_bytes` long.
const MAX_IN_FLIGHT: usize = 8;
/// Submission queue entries (each op has at most one entry queued at a time).
const RING_ENTRIES: u32 = 16;

pub(crate) struct UringEngine {
    ring: IoUring,
    /// Ops submitted to the kernel, by user_data. An op stays here (and so keeps the memory
    /// its iovecs point to alive) until its last completion has been seen.
    slab: HashMap<u64, WriteOp>,
    done: Vec<Finished>,
}

impl UringEngine {
    /// Sets up a ring, or says why not (ENOSYS, EPERM, disabled, opcodes missing).
    pub fn new() -> io::Result<UringEngine> {
        // dontfork: a forked child gets no mapping of the ring, so it cannot corrupt ours.
        let ring = IoUring::builder().dontfork().build(RING_ENTRIES)?;
        let mut probe = Probe::new();
        ring.submitter().register_probe(&mut probe)?;
        if !probe.is_supported(opcode::Writev::CODE) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "io_uring lacks IORING_OP_WRITEV",
            ));
        }
        Ok(UringEngine {
            ring,
            slab: HashMap::new(),
            done: Vec::new(),
        })
    }

    /// Queues the next (or first) writev of op `id`, which is in the slab.
    fn push(&mut self, id: u64) {
        let op = &self.slab[&id];
        let iov = op.pending();
        let entry = opcode::Writev::new(types::Fd(op.fd), iov.as_ptr(), iov.len() as u32)
            .offset(op.offset)
            .build()
            .user_data(id);
        // SAFETY: the iovec array and the memory it points to are owned by the op, which stays
        // in `self.slab` (its heap buffers do not move) until the completion for this entry
        // has been reaped; the fd stays open as long as the op exists (the I/O thread closes a
        // shard only when no op of it is in flight).
        let pushed = unsafe { self.ring.submission().push(&entry) };
        // At most one entry per op is queued and the slab holds at most MAX_IN_FLIGHT ops,
        // fewer than RING_ENTRIES, so the queue cannot be full.
        debug_assert!(pushed.is_ok());
        if pushed.is_err() {
            let op = self.slab.remove(&id).expect("op in slab");
            let err = io::Error::other("io_uring submission queue full");
            self.done.push(Finished {
                id,
                op,
                result: Err(err),
            });
        }
    }

    /// Hands queued entries to the kernel. Transient refusals leave them queued for the next
    /// enter.
    fn submit_queued(&mut self, wait_for: usize) -> io::Result<()> {
        loop {
            let r = if wait_for > 0 {
                self.ring.submit_and_wait(wait_for)
            } else {
                self.ring.submit()
            };
            match r {
                Ok(_) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EBUSY)) => {
                    return Ok(()); // completions must be reaped first; we will come back
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn handle_completion(&mut self, id: u64, res: i32) {
        let Some(op) = self.slab.get_mut(&id) else {
            return;
        };
        let outcome: Option<io::Result<()>> = if res < 0 {
            match -res {
                libc::EINTR | libc::EAGAIN => None,
                errno if op.fall_back(errno) => None, // a refused direct write: again, buffered
                errno => Some(Err(io::Error::from_raw_os_error(errno))),
            }
        } else if res == 0 && op.remaining > 0 {
            Some(Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "writev wrote nothing",
            )))
        } else {
            op.advance((res as u64).min(op.remaining) as usize);
            if op.remaining == 0 {
                Some(Ok(()))
            } else {
                None // a short write: resume where it stopped
            }
        };
        match outcome {
            Some(result) => {
                let op = self.slab.remove(&id).expect("op in slab");
                self.done.push(Finished { id, op, result });
            }
            None => self.push(id),
        }
    }
}

impl Engine for UringEngine {
    fn backend(&self) -> Backend {
        Backend::IoUring
    }

    fn capacity(&self) -> usize {
        MAX_IN_FLIGHT
    }

    fn in_flight(&self) -> usize {
        self.slab.len()
    }

    fn submit(&mut self, id: u64, op: WriteOp) {
        self.slab.insert(id, op);
        self.push(id);
        // Errors here resurface from the next reap, which enters the ring again.
        let _ = self.submit_queued(0);
    }

    fn reap(&mut self, wait: bool) -> io::Result<Vec<Finished>> {
        let wait_for = usize::from(wait && !self.slab.is_empty() && self.done.is_empty());
        self.submit_queued(wait_for)?;
        let cqes: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (id, res) in cqes {
            self.handle_completion(id, res);
        }
        if !self.slab.is_empty() {
            self.submit_queued(0)?; // resumed short writes
        }
        Ok(std::mem::take(&mut self.done))
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        // The kernel may still read the memory of ops in flight: wait for them. If the ring is
        // broken, leak the ops rather than free memory a kernel worker might read.
        let mut attempts = 0;
        while !self.slab.is_empty() && attempts < 1000 {
            attempts += 1;
            if self.submit_queued(1).is_err() {
                break;
            }
            let cqes: Vec<u64> = self.ring.completion().map(|c| c.user_data()).collect();
            for id in cqes {
                self.slab.remove(&id);
            }
        }
        for (_, op) in self.slab.drain() {
            #[expect(
                clippy::mem_forget,
                reason = "the kernel may still read the op's buffers"
            )]
            std::mem::forget(op);
        }
    }
}
