//! Direct I/O (`O_DIRECT`) for a shard: the second descriptor, the alignment it needs, and
//! the staging of frames into aligned bounce buffers.
//!
//! The file is seen as one byte stream. Records given a place in the shard wait in `staging`
//! and are copied, in order, into bounce buffers of `chunk` bytes (about `batch_bytes`, so a
//! large record takes several chunks and bounce memory stays bounded); the caller's buffers are
//! released as soon as a record is copied. Everything before `direct_end` (a multiple of the
//! alignment) was handed to direct writes of whole blocks; the bytes after it (`carry`, less
//! than a block) are kept in memory and go at the front of the next direct write. When the
//! writer runs out of records to write, the carried bytes are written through the shard's
//! buffered descriptor (`write_tail`), so that the records ending in them are in the file and
//! can be reported done; the next direct write rewrites that block whole. The file header is
//! written buffered; its last partial block is the first carry.
//!
//! Page cache coherence: the alignment is at least the page size, so a page holds either bytes
//! that went through direct writes or buffered bytes at or after `direct_end`, never both, and
//! a direct write starts at `direct_end`. Linux writes back and drops the cached pages a
//! direct write covers before it starts (the buffered tail, the file header), and the I/O
//! thread never has a buffered write in flight at the same time as a direct write. So no
//! stale cached page can ever be written back over direct data: after a direct write the
//! buffered descriptor only ever writes beyond it.

use super::aligned::BufferPool;
use super::batch::WriteOp;
use super::encoded::Encoded;
use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Alignment used when the file system does not say (`statx` without `STATX_DIOALIGN`).
pub(crate) const DEFAULT_ALIGN: usize = 4096;
/// Larger alignments are not believed: the file is written buffered instead.
pub(crate) const MAX_ALIGN: usize = 1 << 20;

/// A shard's direct-I/O state.
pub(crate) struct DirectShard {
    /// The `O_DIRECT` descriptor of the shard file.
    fd: OwnedFd,
    /// Offsets, lengths and buffer addresses of direct writes are multiples of this.
    pub align: usize,
    /// Bytes of one direct write at most: a multiple of `align`.
    chunk: usize,
    /// Records placed in the shard whose bytes are not all copied yet, with how many are.
    staging: VecDeque<(Encoded, u64)>,
    /// Every byte before this offset was handed to a direct write (or is part of the file
    /// header's whole blocks, written buffered); the next direct write starts here.
    pub direct_end: u64,
    /// The bytes from `direct_end` on that no direct write holds yet.
    pub carry: Vec<u8>,
    /// The kernel refused a direct write on this shard: stage as before, but write through
    /// the buffered descriptor.
    pub refused: bool,
}

impl DirectShard {
    /// Opens `path` (the shard just created as `file`, `header` written at its start) a
    /// second time with `O_DIRECT`, for direct writes of about `chunk` bytes. `Ok(None)`: the
    /// file system does not do direct I/O (`open` refuses with EINVAL, or `statx` says so).
    pub fn open(
        path: &Path,
        file: &File,
        header: &[u8],
        chunk: u64,
    ) -> io::Result<Option<DirectShard>> {
        let Some(fd) = open_direct(path)? else {
            return Ok(None);
        };
        if !same_file(file, &fd)? {
            return Err(io::Error::other(
                "the shard was replaced while being opened for direct I/O",
            ));
        }
        let Some(align) = dio_alignment(&fd) else {
            return Ok(None);
        };
        let chunk = usize::try_from(chunk)
            .unwrap_or(usize::MAX)
            .clamp(align, 1 << 30)
            .next_multiple_of(align);
        let direct_end = (header.len() / align * align) as u64;
        let carry = header[direct_end as usize..].to_vec();
        Ok(Some(DirectShard {
            fd,
            align,
            chunk,
            staging: VecDeque::new(),
            direct_end,
            carry,
            refused: false,
        }))
    }

    /// Queues records placed in the shard (consecutive, after those queued before) for
    /// [`DirectShard::stage_chunk`].
    pub fn enqueue(&mut self, records: Vec<Encoded>) {
        self.staging.extend(records.into_iter().map(|r| (r, 0)));
    }

    /// Whether queued records are not all copied yet.
    pub fn is_staging(&self) -> bool {
        !self.staging.is_empty()
    }

    /// Copies the carried bytes and then queued records' bytes into a bounce buffer from
    /// `pool`, up to `chunk` bytes. Returns the write of its whole blocks at `direct_end`
    /// (`None` if there is less than a block); the bytes after them become the new carry.
    /// `buffered_fd` is the shard's buffered descriptor.
    pub fn stage_chunk(&mut self, pool: &mut BufferPool, buffered_fd: RawFd) -> Option<WriteOp> {
        let mut buf = pool.take(self.chunk, self.align);
        buf.extend_from_slice(&self.carry);
        self.carry.clear();
        while buf.len() < self.chunk {
            let Some((rec, copied)) = self.staging.front_mut() else {
                break;
            };
            *copied += rec.copy_into(*copied, &mut buf, self.chunk) as u64;
            if *copied == rec.frame_len() {
                self.staging.pop_front(); // all copied: the record's own buffers are released
            }
        }
        let whole = buf.len() / self.align * self.align;
        self.carry.extend_from_slice(&buf.as_slice()[whole..]);
        if whole == 0 {
            pool.put(buf);
            return None;
        }
        buf.truncate(whole);
        let offset = self.direct_end;
        self.direct_end += whole as u64;
        let fd = if self.refused {
            buffered_fd
        } else {
            self.fd.as_raw_fd()
        };
        Some(WriteOp::staged(fd, buffered_fd, offset, buf))
    }

    /// Writes the carried bytes at `direct_end` through the buffered descriptor `file`, so
    /// that the file holds every byte staged so far. No direct write may be in flight.
    /// Returns the offset just past them.
    pub fn write_tail(&self, file: &File) -> io::Result<u64> {
        file.write_all_at(&self.carry, self.direct_end)?;
        Ok(self.direct_end + self.carry.len() as u64)
    }
}

/// Opens `path` for writing with `O_DIRECT`; `None` if the file system refuses (EINVAL).
fn open_direct(path: &Path) -> io::Result<Option<OwnedFd>> {
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))?;
    loop {
        // SAFETY: `c_path` is a NUL-terminated string that outlives the call.
        let fd = unsafe {
            libc::open(
                c_path.as_ptr(),
                libc::O_WRONLY | libc::O_DIRECT | libc::O_CLOEXEC,
            )
        };
        if fd >= 0 {
            // SAFETY: `fd` was just opened and is owned by nobody else.
            return Ok(Some(unsafe { OwnedFd::from_raw_fd(fd) }));
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EINVAL) => return Ok(None),
            _ => return Err(e),
        }
    }
}

/// Whether two descriptors name the same file (device and inode).
fn same_file(a: &File, b: &OwnedFd) -> io::Result<bool> {
    let ident = |fd: RawFd| -> io::Result<(u64, u64)> {
        // SAFETY: `st` is plain data that fstat fills in; `fd` is open for the whole call.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above; the pointer is valid for writes of one `stat`.
        if unsafe { libc::fstat(fd, &raw mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok((st.st_dev, st.st_ino))
    };
    Ok(ident(a.as_raw_fd())? == ident(b.as_raw_fd())?)
}

/// The alignment direct writes to `fd` need: the larger of the file system's offset and
/// memory alignments (`statx` `STATX_DIOALIGN`, Linux 6.1; else [`DEFAULT_ALIGN`]) and the page
/// size (see the module docs). `None`: the file system says it cannot do direct I/O here.
fn dio_alignment(fd: &OwnedFd) -> Option<usize> {
    // SAFETY: sysconf reads a constant.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .unwrap_or(4096)
        .max(512);
    let base = page.max(DEFAULT_ALIGN);
    // SAFETY: `stx` is plain data that statx fills in.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: the empty path is a NUL-terminated static string; with AT_EMPTY_PATH statx looks
    // at `fd`, which is open for the whole call; `stx` is valid for writes.
    let rc = unsafe {
        libc::statx(
            fd.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &raw mut stx,
        )
    };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return Some(base); // an older kernel or a file system that does not say
    }
    if stx.stx_dio_offset_align == 0 {
        return None; // "direct I/O is not supported on this file"
    }
    let align = base
        .max(stx.stx_dio_offset_align as usize)
        .max(stx.stx_dio_mem_align as usize);
    (align.is_power_of_two() && align <= MAX_ALIGN).then_some(align)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{FrameHeader, FrameKind};
    use crate::writer::encoded::Payload;
    use crate::writer::out_pool::OutPool;
    use crate::Codec;

    fn frame(seq: u64, len: usize) -> Encoded {
        let mut payload = OutPool::new(0, 0).take(len); // a pool that keeps nothing
        payload.extend((0..len).map(|i| (i * 7 + seq as usize) as u8));
        let header = FrameHeader {
            kind: FrameKind::Record,
            codec: Codec::Zstd,
            key: format!("k{seq}"),
            stored_len: len as u64,
            raw_len: len as u64,
            num_tokens: 0,
            payload_crc: crate::format::crc32c(&payload),
        };
        let head = header.encode();
        Encoded {
            seq,
            header,
            head,
            payload: Payload::Owned(payload),
        }
    }

    fn bytes_of(rec: &Encoded) -> Vec<u8> {
        let mut v = Vec::new();
        rec.for_each_piece(|p| v.extend_from_slice(p));
        v
    }

    #[test]
    fn staging_writes_whole_blocks_in_order_and_carries_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        let header = vec![9u8; 5000];
        file.write_all_at(&header, 0).unwrap();
        let Some(mut d) = DirectShard::open(&path, &file, &header, 20_000).unwrap() else {
            eprintln!(
                "NOTE: {} refuses O_DIRECT; staging not tested",
                dir.path().display()
            );
            return;
        };
        assert!(d.align.is_power_of_two() && d.align >= 4096, "{}", d.align);
        assert_eq!(d.chunk % d.align, 0);
        assert_eq!(d.direct_end as usize, 5000 / d.align * d.align);
        let mut want = header[d.direct_end as usize..].to_vec();
        let records: Vec<Encoded> = [100, 70_000, 3, 9000, 12_345]
            .iter()
            .enumerate()
            .map(|(i, &n)| frame(i as u64, n))
            .collect();
        for r in &records {
            want.extend(bytes_of(r));
        }
        d.enqueue(records);
        let mut pool = BufferPool::new(2, 1 << 20);
        let (mut got, mut at) = (Vec::new(), d.direct_end);
        while d.is_staging() {
            let Some(op) = d.stage_chunk(&mut pool, file.as_raw_fd()) else {
                break;
            };
            assert_eq!(op.offset, at, "contiguous");
            assert_eq!(op.fd, d.fd.as_raw_fd(), "through the O_DIRECT descriptor");
            let buf = op.into_bounce().unwrap();
            assert!(
                buf.len() % d.align == 0 && buf.len() <= d.chunk,
                "{}",
                buf.len()
            );
            assert_eq!(buf.as_slice().as_ptr() as usize % d.align, 0);
            at += buf.len() as u64;
            got.extend_from_slice(buf.as_slice());
            pool.put(buf);
        }
        assert!(d.carry.len() < d.align);
        assert_eq!(d.direct_end, at);
        got.extend_from_slice(&d.carry);
        assert!(
            got == want,
            "the staged bytes are the stream of the header's tail and the frames"
        );
        // Less than a block left: nothing to write directly, all carried.
        let small = frame(9, 10);
        let fits = d.carry.len() + (small.frame_len() as usize) < d.align;
        d.enqueue(vec![small]);
        assert_eq!(d.stage_chunk(&mut pool, file.as_raw_fd()).is_none(), fits);
        assert!(!d.is_staging());
        // The tail goes through the buffered descriptor, at `direct_end`.
        let end = d.write_tail(&file).unwrap();
        assert_eq!(end, d.direct_end + d.carry.len() as u64);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), end);
    }

    #[test]
    fn alignment_is_at_least_a_page() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a");
        std::fs::write(&path, b"").unwrap();
        if let Some(fd) = open_direct(&path).unwrap() {
            let align = dio_alignment(&fd).expect("this file system does direct I/O");
            assert!(align.is_power_of_two() && (DEFAULT_ALIGN..=MAX_ALIGN).contains(&align));
        }
    }
}
