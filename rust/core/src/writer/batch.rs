//! A write of consecutive frames to one shard: the iovec list pointing into the frames' pieces,
//! and the frames themselves, which own that memory until the write is finished.

use super::encode::Encoded;
use std::os::fd::RawFd;

/// Most iovecs one `writev`/`pwritev` call takes (Linux `UIO_MAXIOV`).
pub(crate) const IOV_MAX: usize = 1024;

/// One write of consecutive frames at a file offset.
pub(crate) struct WriteOp {
    /// The shard's descriptor; the I/O thread keeps the file open while the op exists.
    pub fd: RawFd,
    /// Where the next unwritten byte goes.
    pub offset: u64,
    /// Bytes not yet written.
    pub remaining: u64,
    /// The pieces; `iov[next..]` are not (fully) written yet.
    iov: Vec<libc::iovec>,
    next: usize,
    /// The frames written, with the offset of each. They own the memory `iov` points into.
    pub frames: Vec<(u64, Encoded)>,
}

// SAFETY: the raw pointers in `iov` point into heap memory owned by `frames` (Vec buffers and
// boxed caller buffers, which do not move when the op moves), so sending the op to another
// thread moves the owners along with the pointers.
unsafe impl Send for WriteOp {}

impl WriteOp {
    /// A write of `frames` (consecutive, in order) starting at `offset`.
    pub fn new(fd: RawFd, offset: u64, records: Vec<Encoded>) -> WriteOp {
        let mut iov = Vec::with_capacity(records.iter().map(|r| r.piece_count()).sum());
        let mut frames = Vec::with_capacity(records.len());
        let mut at = offset;
        for rec in records {
            rec.for_each_piece(|p| {
                iov.push(libc::iovec { iov_base: p.as_ptr() as *mut libc::c_void, iov_len: p.len() })
            });
            let len = rec.frame_len();
            frames.push((at, rec));
            at += len;
        }
        WriteOp { fd, offset, remaining: at - offset, iov, next: 0, frames }
    }

    /// File offset just past the last frame.
    pub fn end(&self) -> u64 {
        self.offset + self.remaining
    }

    /// The iovecs still to write, at most [`IOV_MAX`] of them.
    pub fn pending(&self) -> &[libc::iovec] {
        let end = (self.next + IOV_MAX).min(self.iov.len());
        &self.iov[self.next..end]
    }

    /// Marks `n` more bytes as written (after a full or short write).
    pub fn advance(&mut self, mut n: usize) {
        debug_assert!(n as u64 <= self.remaining);
        self.offset += n as u64;
        self.remaining -= n as u64;
        while n > 0 && self.next < self.iov.len() {
            let v = &mut self.iov[self.next];
            if n >= v.iov_len {
                n -= v.iov_len;
                self.next += 1;
            } else {
                // SAFETY: n < iov_len, so the new base stays inside the same piece.
                v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n) }.cast();
                v.iov_len -= n;
                n = 0;
            }
        }
    }
}
