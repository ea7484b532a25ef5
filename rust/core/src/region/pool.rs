//! The connector's host pool as the region sink sees it: memory of a fixed address and length,
//! whose owner the sink keeps alive while the sink or any record slice of it lives.

use super::leases::Lease;
use crate::writer::RecordBuffer;
use std::sync::Arc;

/// The pool's memory: `[base, base + len)`, kept in place by `_owner`.
pub(crate) struct Pool {
    _owner: Box<dyn Send>,
    pub(crate) base: usize,
    pub(crate) len: usize,
}

// SAFETY: `Pool` is read through `&self` only for `base` and `len`, plain integers copied when
// it was made; the owner is never touched through `&self` (only dropped, once, with the last
// `Arc<Pool>`), so sharing `&Pool` between threads shares no access to it.
unsafe impl Sync for Pool {}

impl Pool {
    /// # Safety
    /// `[base, base + len)` must be valid for reads and writes, and stay so and in place while
    /// `owner` lives; nothing but the region sink may write the parts of it the sink leases.
    pub(crate) unsafe fn new(owner: Box<dyn Send>, base: *mut u8, len: usize) -> Pool {
        Pool {
            _owner: owner,
            base: base as usize,
            len,
        }
    }
}

/// One tensor of a record: bytes `[start, start + len)` of the pool, inside a live lease.
pub(crate) struct PoolSlice {
    pool: Arc<Pool>,
    /// Held, not read: the range stays leased while the slice lives.
    _lease: Arc<Lease>,
    start: usize,
    len: usize,
}

impl PoolSlice {
    /// Bytes `[start, start + len)` of `pool`, which must lie within `lease` and the pool.
    ///
    /// # Panics
    /// If they do not: `RegionSink::submit` checked every record's range before, so this is a
    /// bug, and reading outside the lease (or the pool) would read memory the writer may not.
    /// Checked here, always (two comparisons a tensor), so that `bytes` is sound whatever the
    /// arithmetic that made the range.
    pub(crate) fn new(pool: Arc<Pool>, lease: Arc<Lease>, start: usize, len: usize) -> PoolSlice {
        let leased = lease.range();
        let inside = start
            .checked_add(len)
            .is_some_and(|end| leased.start <= start && end <= leased.end && end <= pool.len);
        assert!(
            inside,
            "a record slice {start}+{len} outside its region {leased:?} (pool of {} bytes)",
            pool.len
        );
        PoolSlice {
            pool,
            _lease: lease,
            start,
            len,
        }
    }
}

impl RecordBuffer for PoolSlice {
    fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `PoolSlice::new` checked that the range lies within the pool, whose memory
        // its owner keeps alive and in place while `self.pool` lives (which `self` keeps), and
        // within a live lease (`self._lease`, held by `self`); `fill`/`submit` refuse
        // to write or lease any range overlapping a live lease, so nothing writes these bytes
        // through the sink while the slice lives (the pool's other writer, the connector's
        // gathers, goes to regions it has not submitted or got back from `reap`: the contract
        // of `Pool::new`).
        unsafe { std::slice::from_raw_parts((self.pool.base + self.start) as *const u8, self.len) }
    }
}
