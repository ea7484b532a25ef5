//! A write to one shard: the iovec list, and whatever owns the memory it points into (the
//! frames' pieces, or an aligned bounce buffer for direct I/O) until the write is finished.

use super::aligned::AlignedBuf;
use super::encoded::{Encoded, Payload};
use crate::format::FrameHeader;
use std::os::fd::RawFd;

/// Most iovecs one `writev`/`pwritev` call takes (Linux `UIO_MAXIOV`).
pub(crate) const IOV_MAX: usize = 1024;

/// A frame given a place in a shard and handed to a write, not yet reported done.
pub(crate) struct Placed {
    pub seq: u64,
    /// Where the frame starts in the shard.
    pub offset: u64,
    pub header: FrameHeader,
}

impl Placed {
    /// Offset just past the frame.
    pub fn end(&self) -> u64 {
        self.offset + self.header.frame_len()
    }
}

/// What an op's iovecs point into.
enum Memory {
    /// The frame header bytes and payloads of the frames written (codec `none`: the caller's
    /// buffers themselves; else buffers of the writer's output pool, which they return to when
    /// the op is dropped).
    Frames(#[allow(dead_code)] Vec<(Vec<u8>, Payload)>),
    /// A bounce buffer the bytes were copied into (direct I/O).
    Staged(AlignedBuf),
}

/// One write of consecutive bytes at a file offset.
pub(crate) struct WriteOp {
    /// The descriptor written through; the I/O thread keeps it open while the op exists.
    pub fd: RawFd,
    /// A buffered descriptor of the same file to write through instead if the kernel refuses
    /// a direct write (EINVAL). Set for direct writes only.
    fallback_fd: Option<RawFd>,
    /// Whether the write went through `fallback_fd`.
    pub fell_back: bool,
    /// Where the next unwritten byte goes.
    pub offset: u64,
    /// Bytes not yet written.
    pub remaining: u64,
    /// File offset of the op's first byte.
    start: u64,
    /// File offset just past the op.
    end: u64,
    /// The pieces; `iov[next..]` are not (fully) written yet.
    iov: Vec<libc::iovec>,
    next: usize,
    memory: Memory,
}

// SAFETY: the raw pointers in `iov` point into heap memory owned by `memory` (Vec buffers, pooled
// ones included, boxed caller buffers, an aligned allocation), which does not move when the op
// moves, so sending the op to another thread moves the owners along with the pointers. A pooled
// buffer goes back to its pool only when the op is dropped, i.e. once the engine is done with
// it (`io/mod.rs`), so no worker can write into memory a write still reads.
unsafe impl Send for WriteOp {}

impl WriteOp {
    /// A write of `records` (consecutive, in order) starting at `offset`, straight from their
    /// memory; also returns where each frame went.
    pub fn frames(fd: RawFd, offset: u64, records: Vec<Encoded>) -> (WriteOp, Vec<Placed>) {
        let mut iov = Vec::with_capacity(records.iter().map(|r| r.piece_count()).sum());
        let mut placed = Vec::with_capacity(records.len());
        let mut owners = Vec::with_capacity(records.len());
        let mut at = offset;
        for rec in records {
            rec.for_each_piece(|p| {
                iov.push(libc::iovec {
                    iov_base: p.as_ptr().cast_mut().cast::<libc::c_void>(),
                    iov_len: p.len(),
                });
            });
            let Encoded {
                seq,
                header,
                head,
                payload,
            } = rec;
            let len = header.frame_len();
            placed.push(Placed {
                seq,
                offset: at,
                header,
            });
            owners.push((head, payload)); // moving the Vecs and boxes does not move their heap memory
            at += len;
        }
        let op = WriteOp {
            fd,
            fallback_fd: None,
            fell_back: false,
            offset,
            remaining: at - offset,
            start: offset,
            end: at,
            iov,
            next: 0,
            memory: Memory::Frames(owners),
        };
        (op, placed)
    }

    /// A write of all of `buf` at `offset` through the direct descriptor `fd`, or through
    /// `fallback_fd` if the kernel refuses it.
    pub fn staged(fd: RawFd, fallback_fd: RawFd, offset: u64, buf: AlignedBuf) -> WriteOp {
        let bytes = buf.as_slice();
        let iov = vec![libc::iovec {
            iov_base: bytes.as_ptr().cast_mut().cast::<libc::c_void>(),
            iov_len: bytes.len(),
        }];
        let len = bytes.len() as u64;
        WriteOp {
            fd,
            fallback_fd: Some(fallback_fd),
            fell_back: false,
            offset,
            remaining: len,
            start: offset,
            end: offset + len,
            iov,
            next: 0,
            memory: Memory::Staged(buf),
        }
    }

    /// File offset of the op's first byte.
    pub fn start(&self) -> u64 {
        self.start
    }

    /// File offset just past the op.
    pub fn end(&self) -> u64 {
        self.end
    }

    /// Bytes of bounce buffer the op holds (0 for a write of frames).
    pub fn staged_len(&self) -> u64 {
        match &self.memory {
            Memory::Staged(buf) => buf.len() as u64,
            Memory::Frames(_) => 0,
        }
    }

    /// The bounce buffer, for reuse, once the op is finished.
    pub fn into_bounce(self) -> Option<AlignedBuf> {
        match self.memory {
            Memory::Staged(buf) => Some(buf),
            Memory::Frames(_) => None,
        }
    }

    /// After the kernel refused a direct write with `errno`: switches to the buffered
    /// descriptor and returns true if that is worth a try (EINVAL: the file system refuses
    /// this direct write, e.g. a length cut short by a file size limit).
    pub fn fall_back(&mut self, errno: i32) -> bool {
        match self.fallback_fd.take() {
            Some(fd) if errno == libc::EINVAL => {
                self.fd = fd;
                self.fell_back = true;
                true
            }
            _ => false,
        }
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
