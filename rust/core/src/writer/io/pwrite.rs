//! The plain backend: `pwritev` on a writer thread of its own (`layertap-pwrite`), one op at a
//! time, short writes resumed. The I/O thread meanwhile batches (or copies into bounce buffers)
//! the next write, so two ops are in flight: one being written, one queued.

use super::{Engine, Finished};
use crate::writer::batch::WriteOp;
use crate::writer::config::Backend;
use crossbeam_channel::{Receiver, Sender};
use std::io;
use std::thread::JoinHandle;

/// Ops in flight at most: one being written, one waiting.
const MAX_IN_FLIGHT: usize = 2;

pub(crate) struct PwriteEngine {
    /// Ops to write; `None` once dropped, which stops the thread.
    to_writer: Option<Sender<(u64, WriteOp)>>,
    from_writer: Receiver<Finished>,
    /// Ops written here because the thread was gone.
    written_here: Vec<Finished>,
    in_flight: usize,
    thread: Option<JoinHandle<()>>,
}

impl PwriteEngine {
    pub fn new() -> io::Result<PwriteEngine> {
        let (to_writer, ops) = crossbeam_channel::bounded::<(u64, WriteOp)>(MAX_IN_FLIGHT);
        let (done, from_writer) = crossbeam_channel::unbounded();
        let thread = std::thread::Builder::new()
            .name("layertap-pwrite".into())
            .spawn(move || {
                for (id, mut op) in &ops {
                    let result = write_all(&mut op);
                    if done.send(Finished { id, op, result }).is_err() {
                        return; // the engine is gone; the op is freed, its write is over
                    }
                }
            })?;
        let to_writer = Some(to_writer);
        Ok(PwriteEngine {
            to_writer,
            from_writer,
            written_here: Vec::new(),
            in_flight: 0,
            thread: Some(thread),
        })
    }
}

/// Writes all of `op`, resuming after short writes and EINTR, and retrying a direct write the
/// kernel refuses through its buffered descriptor.
pub(crate) fn write_all(op: &mut WriteOp) -> io::Result<()> {
    while op.remaining > 0 {
        let iov = op.pending();
        // SAFETY: every iovec points into memory owned by `op`, alive for this call; the
        // kernel only reads it.
        let n = unsafe {
            libc::pwritev(
                op.fd,
                iov.as_ptr(),
                iov.len() as libc::c_int,
                op.offset as libc::off_t,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted || op.fall_back(e.raw_os_error().unwrap_or(0))
            {
                continue; // interrupted, or a refused direct write retried through the page cache
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "pwritev wrote nothing",
            ));
        }
        op.advance(n as usize);
    }
    Ok(())
}

impl Engine for PwriteEngine {
    fn backend(&self) -> Backend {
        Backend::Pwrite
    }

    fn capacity(&self) -> usize {
        MAX_IN_FLIGHT
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn submit(&mut self, id: u64, op: WriteOp) {
        let to_writer = self.to_writer.as_ref().expect("engine in use");
        match to_writer.send((id, op)) {
            Ok(()) => self.in_flight += 1,
            Err(crossbeam_channel::SendError((id, mut op))) => {
                // The writer thread is gone (it panicked): write here rather than lose the op.
                let result = write_all(&mut op);
                self.written_here.push(Finished { id, op, result });
                self.in_flight += 1;
            }
        }
    }

    fn reap(&mut self, wait: bool) -> io::Result<Vec<Finished>> {
        let mut done = std::mem::take(&mut self.written_here);
        if wait && done.is_empty() && self.in_flight > 0 {
            match self.from_writer.recv() {
                Ok(f) => done.push(f),
                Err(_) => return Err(io::Error::other("the pwrite thread stopped")),
            }
        }
        done.extend(self.from_writer.try_iter());
        self.in_flight -= done.len();
        Ok(done)
    }
}

impl Drop for PwriteEngine {
    fn drop(&mut self) {
        // The thread finishes the ops it was given (their memory is theirs), then stops.
        self.to_writer = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
