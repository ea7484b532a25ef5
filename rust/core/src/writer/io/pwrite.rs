//! The plain backend: `pwritev` on the I/O thread, one op at a time, short writes resumed.

use super::{Engine, Finished};
use crate::writer::batch::WriteOp;
use crate::writer::config::Backend;
use std::io;

pub(crate) struct PwriteEngine {
    done: Vec<Finished>,
}

impl PwriteEngine {
    pub fn new() -> PwriteEngine {
        PwriteEngine { done: Vec::new() }
    }
}

/// Writes all of `op`, resuming after short writes and EINTR.
pub(crate) fn write_all(op: &mut WriteOp) -> io::Result<()> {
    while op.remaining > 0 {
        let iov = op.pending();
        // SAFETY: every iovec points into memory owned by `op.frames`, alive for this call;
        // the kernel only reads it.
        let n =
            unsafe { libc::pwritev(op.fd, iov.as_ptr(), iov.len() as libc::c_int, op.offset as libc::off_t) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "pwritev wrote nothing"));
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
        1
    }

    fn in_flight(&self) -> usize {
        0 // every op is finished when submit returns
    }

    fn submit(&mut self, id: u64, mut op: WriteOp) {
        let result = write_all(&mut op);
        self.done.push(Finished { id, op, result });
    }

    fn reap(&mut self, _wait: bool) -> io::Result<Vec<Finished>> {
        Ok(std::mem::take(&mut self.done))
    }
}
