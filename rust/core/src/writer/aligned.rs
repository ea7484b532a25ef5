//! Memory aligned for `O_DIRECT`: the bounce buffers direct writes are staged in, and a small
//! pool that reuses them (a fresh buffer costs page faults on every first touch).

use std::alloc::{self, Layout};
use std::ptr::NonNull;

/// A heap buffer of fixed capacity whose address is a multiple of `align`; the first `len`
/// bytes are filled. Only filled bytes are ever read.
pub(crate) struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
    len: usize,
}

// SAFETY: an `AlignedBuf` owns its allocation alone, like a `Vec<u8>`; moving it to another
// thread moves that ownership, and `&AlignedBuf` only gives out shared reads.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// An empty buffer of at least `capacity` bytes at a multiple of `align` (a power of two).
    pub fn new(capacity: usize, align: usize) -> AlignedBuf {
        let size = capacity.max(1).next_multiple_of(align);
        let layout = Layout::from_size_align(size, align).expect("alignment is a power of two");
        // SAFETY: the layout's size is not zero.
        let ptr = unsafe { alloc::alloc(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        AlignedBuf {
            ptr,
            layout,
            len: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.layout.size()
    }

    pub fn align(&self) -> usize {
        self.layout.align()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Appends `bytes`; they must fit the capacity.
    pub fn extend_from_slice(&mut self, bytes: &[u8]) {
        assert!(
            bytes.len() <= self.capacity() - self.len,
            "aligned buffer overflow"
        );
        // SAFETY: the destination `[len, len + bytes.len())` lies inside our allocation (checked
        // above) and cannot overlap `bytes`, which the caller borrows from elsewhere (we hold
        // `&mut self`, so no slice of this buffer can be borrowed at the same time).
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.ptr.as_ptr().add(self.len),
                bytes.len(),
            );
        };
        self.len += bytes.len();
    }

    /// Keeps the first `len` bytes.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// The filled bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the first `len` bytes were written by `extend_from_slice`, and the buffer
        // outlives the borrow.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this very layout, freed only here.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// Bounce buffers given back after their write, kept for the next ones.
pub(crate) struct BufferPool {
    free: Vec<AlignedBuf>,
    /// Buffers kept at most.
    keep: usize,
    /// Buffers larger than this (made for one large record) are freed, not kept.
    max_kept_capacity: usize,
}

impl BufferPool {
    pub fn new(keep: usize, max_kept_capacity: usize) -> BufferPool {
        BufferPool {
            free: Vec::new(),
            keep,
            max_kept_capacity,
        }
    }

    /// An empty buffer of at least `capacity` bytes at a multiple of `align`: the smallest free
    /// one that fits, else a new one.
    pub fn take(&mut self, capacity: usize, align: usize) -> AlignedBuf {
        let fits = |b: &AlignedBuf| b.capacity() >= capacity && b.align() >= align;
        let best = (0..self.free.len())
            .filter(|&i| fits(&self.free[i]))
            .min_by_key(|&i| self.free[i].capacity());
        match best {
            Some(i) => self.free.swap_remove(i),
            None => AlignedBuf::new(capacity, align),
        }
    }

    /// Takes a buffer back for reuse.
    pub fn put(&mut self, mut buf: AlignedBuf) {
        if self.free.len() < self.keep && buf.capacity() <= self.max_kept_capacity {
            buf.clear();
            self.free.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_hold_what_was_appended() {
        let mut b = AlignedBuf::new(10_000, 4096);
        assert_eq!(b.as_slice().as_ptr() as usize % 4096, 0);
        assert_eq!(b.capacity(), 12_288);
        b.extend_from_slice(b"abc");
        b.extend_from_slice(&[7; 5000]);
        assert_eq!(b.len(), 5003);
        assert_eq!(&b.as_slice()[..4], b"abc\x07");
        b.truncate(2);
        assert_eq!(b.as_slice(), b"ab");
    }

    #[test]
    #[should_panic(expected = "overflow")]
    fn overflow_is_refused() {
        AlignedBuf::new(4096, 4096).extend_from_slice(&[0; 4097]);
    }

    #[test]
    fn pool_reuses_fitting_buffers_and_drops_oversized_ones() {
        let mut pool = BufferPool::new(2, 1 << 16);
        let a = pool.take(8192, 4096);
        assert_eq!(a.capacity(), 8192);
        let addr = a.as_slice().as_ptr();
        pool.put(a);
        let b = pool.take(5000, 4096);
        assert_eq!(b.as_slice().as_ptr(), addr, "reused");
        assert_eq!(pool.take(5000, 4096).capacity(), 8192, "a new one");
        let big = pool.take(1 << 20, 4096);
        assert_eq!(big.capacity(), 1 << 20);
        pool.put(big); // too large to keep
        pool.put(b);
        assert_eq!(pool.free.len(), 1);
    }
}
