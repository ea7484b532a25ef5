//! Recycled output buffers of the compression threads: the encoded payloads (and the lossy
//! stage's fp8 values) go back to a small pool once the I/O thread is done with them, instead
//! of being freed, and the next record is encoded into one of them.
//!
//! Why: a buffer for a large record is larger than glibc's mmap threshold (128 KiB at first,
//! raised to the size of the mmapped chunks freed since, up to 32 MiB), so glibc serves it with
//! a fresh `mmap` and frees it with `munmap`. Every page the encoder writes into is then a page
//! fault, and every free a TLB shootdown: an IPI to every CPU that runs a thread of the
//! process, vLLM's engine thread included. Measured on an H200 with an 8B model (records of
//! ~33 MB raw): 2.68 million minor faults in the compression threads for 11 GB written (every
//! byte written went through a freshly faulted page), and 17,566 shootdowns in a 35 s window;
//! with a 1B model's records (~3 MB), 100k faults in one run and 1k in another, as glibc's
//! threshold moved. Here (`tests/writer_out_pool.rs`, records of 32 MiB, two threads) 132,054
//! faults for 132,033 pages stored before, 3 after.
//!
//! A buffer is a [`PooledBuf`], which owns its `Vec` and returns it to the pool when dropped,
//! wherever that is: after its write on the I/O thread (the write owns it until the engine
//! hands the write back, see `batch.rs`), once copied into a bounce buffer (`direct.rs`), or
//! when a failed writer drops its records. A buffer the kernel may still read is never dropped
//! (an engine that cannot reap its writes leaks them), so it is never handed out again either.
//!
//! Memory: the pool keeps at most `keep` idle buffers (two per compression thread and two more:
//! a record being encoded holds one, two with the lossy stage, and each record queued for or in
//! a write one) and at most `max_retained` bytes of capacity, a quarter of the writer's
//! in-flight budget (`max_inflight_bytes`); a buffer given back beyond either is freed. So idle
//! buffers add at most a quarter to what the budget bounds (under the default budget of 1 GiB,
//! 8 buffers of an 8B model's 33 MB records), and of a buffer only the pages once written to are
//! resident. While the writer keeps up with its producer a few buffers go round; a burst of
//! more records in flight at once than the pool keeps buffers for is encoded partly into fresh
//! buffers, which are freed once written.

use parking_lot::Mutex;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

/// Idle output buffers shared by the compression threads and whoever drops their records.
pub(crate) struct OutPool {
    free: Mutex<Idle>,
    /// Idle buffers kept at most.
    keep: usize,
    /// Capacity, in bytes, of the idle buffers kept at most.
    max_retained: usize,
}

#[derive(Default)]
struct Idle {
    bufs: Vec<Vec<u8>>,
    /// Sum of `bufs`' capacities.
    retained: usize,
}

impl OutPool {
    /// A pool keeping at most `keep` idle buffers of at most `max_retained` bytes in all.
    pub fn new(keep: usize, max_retained: usize) -> Arc<OutPool> {
        Arc::new(OutPool {
            free: Mutex::new(Idle::default()),
            keep,
            max_retained,
        })
    }

    /// The pool of a writer with `threads` compression threads and an in-flight budget of
    /// `max_inflight` bytes (see the module docs).
    pub fn for_writer(threads: usize, max_inflight: u64) -> Arc<OutPool> {
        let budget = usize::try_from(max_inflight).unwrap_or(usize::MAX);
        OutPool::new(2 * threads + 2, budget / 4)
    }

    /// An empty buffer of at least `capacity` bytes: the smallest idle one that holds that
    /// much, else the largest idle one, grown, else a new one.
    pub fn take(self: &Arc<Self>, capacity: usize) -> PooledBuf {
        let reused = {
            let mut idle = self.free.lock();
            let fits = (0..idle.bufs.len())
                .filter(|&i| idle.bufs[i].capacity() >= capacity)
                .min_by_key(|&i| idle.bufs[i].capacity());
            let pick =
                fits.or_else(|| (0..idle.bufs.len()).max_by_key(|&i| idle.bufs[i].capacity()));
            pick.map(|i| {
                let buf = idle.bufs.swap_remove(i);
                idle.retained -= buf.capacity();
                buf
            })
        };
        let mut bytes = reused.unwrap_or_default();
        bytes.clear();
        // Grows only a buffer that is too small (`reserve_exact` counts from `len`, 0 here).
        bytes.reserve_exact(capacity);
        PooledBuf {
            bytes,
            home: self.clone(),
        }
    }

    /// Keeps `buf` for reuse if the pool has room for it; else frees it.
    fn put(&self, buf: Vec<u8>) {
        let cap = buf.capacity();
        if cap == 0 {
            return;
        }
        let mut idle = self.free.lock();
        if idle.bufs.len() < self.keep && idle.retained + cap <= self.max_retained {
            idle.retained += cap;
            idle.bufs.push(buf);
            return;
        }
        drop(idle); // `buf` is freed after the lock: a munmap takes a while
    }

    /// Idle buffers held now, and their capacity in all.
    #[cfg(test)]
    fn idle(&self) -> (usize, usize) {
        let idle = self.free.lock();
        (idle.bufs.len(), idle.retained)
    }
}

/// A buffer from an [`OutPool`]: a `Vec<u8>` (through `Deref`) that goes back to its pool when
/// dropped.
pub(crate) struct PooledBuf {
    bytes: Vec<u8>,
    home: Arc<OutPool>,
}

impl Deref for PooledBuf {
    type Target = Vec<u8>;
    fn deref(&self) -> &Vec<u8> {
        &self.bytes
    }
}

impl DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.bytes
    }
}

/// What [`crate::fp8::quantize_into`] fills.
impl AsMut<Vec<u8>> for PooledBuf {
    fn as_mut(&mut self) -> &mut Vec<u8> {
        &mut self.bytes
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        self.home.put(std::mem::take(&mut self.bytes));
    }
}

/// The lossy stage stores its fp8 values in a pooled buffer as a record's tensor.
impl super::input::RecordBuffer for PooledBuf {
    fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_comes_back_and_is_reused_with_its_capacity() {
        let pool = OutPool::new(4, 1 << 20);
        let mut a = pool.take(1000);
        assert!(a.capacity() >= 1000 && a.is_empty());
        a.extend_from_slice(&[7; 1000]);
        let (addr, cap) = (a.as_ptr(), a.capacity());
        drop(a);
        assert_eq!(pool.idle(), (1, cap));
        let b = pool.take(500);
        assert_eq!(b.as_ptr(), addr, "the same allocation");
        assert_eq!(b.capacity(), cap, "not shrunk");
        assert!(b.is_empty(), "cleared: nothing of the record it held");
        assert_eq!(pool.idle(), (0, 0));
    }

    #[test]
    fn the_smallest_fitting_buffer_is_taken_else_the_largest_is_grown() {
        let pool = OutPool::new(4, 1 << 20);
        let (small, large) = (pool.take(100), pool.take(10_000));
        let (small_at, large_at) = (small.as_ptr(), large.as_ptr());
        drop((small, large));
        assert_eq!(pool.take(50).as_ptr(), small_at, "the small one fits");
        let big = pool.take(5000);
        assert_eq!(big.as_ptr(), large_at, "only the large one fits");
        drop(big);
        let grown = pool.take(20_000); // none fits: the largest is grown, not a new one added
        assert!(grown.capacity() >= 20_000);
        assert_eq!(pool.idle().0, 1, "the small one stays");
    }

    #[test]
    fn the_pool_keeps_a_bounded_count() {
        let pool = OutPool::new(2, 1 << 20);
        let bufs: Vec<PooledBuf> = (0..5).map(|_| pool.take(100)).collect();
        drop(bufs);
        let (count, retained) = pool.idle();
        assert_eq!(count, 2, "the others were freed");
        assert!((200..400).contains(&retained), "{retained}");
    }

    #[test]
    fn the_pool_keeps_a_bounded_capacity() {
        let pool = OutPool::new(8, 25_000);
        let bufs: Vec<PooledBuf> = (0..4).map(|_| pool.take(10_000)).collect();
        drop(bufs);
        let (count, retained) = pool.idle();
        assert_eq!(count, 2, "a third would take it past 25,000 bytes");
        assert!(retained <= 25_000);
        drop(pool.take(100_000)); // larger than the pool keeps at all
        assert_eq!(
            pool.idle().0,
            1,
            "taken (the largest, grown) and freed, not kept"
        );
    }

    #[test]
    fn a_writers_pool_follows_its_threads_and_budget() {
        let pool = OutPool::for_writer(3, 1 << 30);
        assert_eq!((pool.keep, pool.max_retained), (8, 1 << 28));
    }

    #[test]
    fn buffers_outlive_their_pools_handle() {
        let pool = OutPool::new(2, 1 << 20);
        let buf = pool.take(10);
        let weak = Arc::downgrade(&pool);
        drop(pool);
        drop(buf); // the buffer's own handle keeps the pool alive until here
        assert!(weak.upgrade().is_none());
    }
}
