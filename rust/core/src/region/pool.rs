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
    pub(crate) pool: Arc<Pool>,
    /// Held, not read: the range stays leased while the slice lives.
    pub(crate) _lease: Arc<Lease>,
    pub(crate) start: usize,
    pub(crate) len: usize,
}

impl RecordBuffer for PoolSlice {
    fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `RegionSink::submit` checked that the range lies within the pool, whose
        // memory its owner keeps alive and in place while `self.pool` lives (which `self`
        // keeps). The range is inside a live lease (`self._lease`), and `fill`/`submit` refuse
        // to write or lease any range overlapping a live lease, so nothing writes these bytes
        // through the sink while the slice lives (the pool's other writer, the connector's
        // gathers, goes to regions it has not submitted or got back from `reap`: the contract
        // of `Pool::new`).
        unsafe { std::slice::from_raw_parts((self.pool.base + self.start) as *const u8, self.len) }
    }
}
