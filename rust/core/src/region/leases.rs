//! Which regions of the pool the writer still reads, and which it gave back.
//!
//! A region is *leased* from its `submit` until the last record slice of it is dropped (on a
//! writer thread, once the record is encoded or written); its id then waits in `released` for
//! the next `reap`.

use parking_lot::{Condvar, Mutex};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

/// The live leases (start -> end, in pool bytes) and the ids of the regions given back.
#[derive(Default)]
pub(crate) struct Leases {
    state: Mutex<LeaseState>,
    returned: Condvar,
}

#[derive(Default)]
struct LeaseState {
    live: BTreeMap<usize, usize>,
    released: Vec<u64>,
}

impl LeaseState {
    fn overlaps(&self, start: usize, end: usize) -> bool {
        self.live
            .range(..end)
            .next_back()
            .is_some_and(|(_, &live_end)| live_end > start)
    }
}

impl Leases {
    /// Whether `[start, end)` overlaps a live lease.
    pub(crate) fn overlaps(&self, start: usize, end: usize) -> bool {
        self.state.lock().overlaps(start, end)
    }

    /// Leases `[start, end)` as region `id` until the returned lease (and every clone) drops;
    /// `None` if the range is empty or overlaps a live lease. Checked here, under the lock that
    /// guards the map, so that live leases never overlap and each has a key of its own: an
    /// empty range `[s, s)` passed the overlap test and replaced the live lease starting at
    /// `s`, whose range then counted as free once the empty one dropped.
    pub(crate) fn lease(self: &Arc<Self>, id: u64, start: usize, end: usize) -> Option<Lease> {
        let mut s = self.state.lock();
        if start >= end || s.overlaps(start, end) {
            return None;
        }
        s.live.insert(start, end);
        Some(Lease {
            id,
            start,
            end,
            leases: self.clone(),
        })
    }

    /// The regions given back since the last call.
    pub(crate) fn take_released(&self) -> Vec<u64> {
        std::mem::take(&mut self.state.lock().released)
    }

    /// Waits until `until` for a region to come back, unless one already has or none is
    /// leased; returns whether one has (or none is leased).
    pub(crate) fn wait_returned(&self, until: Instant) -> bool {
        let mut s = self.state.lock();
        if s.released.is_empty() && !s.live.is_empty() {
            self.returned.wait_until(&mut s, until);
        }
        !s.released.is_empty() || s.live.is_empty()
    }

    /// Regions leased now.
    pub(crate) fn live(&self) -> usize {
        self.state.lock().live.len()
    }
}

/// One region's records in the writer; dropped with the last slice of the region.
pub(crate) struct Lease {
    id: u64,
    start: usize,
    end: usize,
    leases: Arc<Leases>,
}

impl Lease {
    /// The leased bytes of the pool, `[start, end)`.
    pub(crate) fn range(&self) -> std::ops::Range<usize> {
        self.start..self.end
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut s = self.leases.state.lock();
        // Only its own entry (`lease` keeps one per start; this guards that rule).
        if s.live.get(&self.start) == Some(&self.end) {
            s.live.remove(&self.start);
        }
        s.released.push(self.id);
        drop(s);
        self.leases.returned.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn overlap_is_half_open() {
        let leases = Arc::new(Leases::default());
        let lease = leases.lease(7, 100, 200).unwrap();
        assert!(!leases.overlaps(0, 100));
        assert!(!leases.overlaps(200, 300));
        assert!(leases.overlaps(199, 300));
        assert!(leases.overlaps(0, 101));
        assert!(leases.overlaps(120, 130));
        assert_eq!(leases.live(), 1);
        drop(lease);
        assert!(!leases.overlaps(0, 300));
        assert_eq!(leases.take_released(), [7]);
        assert!(leases.take_released().is_empty());
    }

    /// An empty or overlapping lease is refused and leaves the live one as it was.
    #[test]
    fn an_empty_or_overlapping_lease_is_refused() {
        let leases = Arc::new(Leases::default());
        let live = leases.lease(1, 0, 4096).unwrap();
        assert!(leases.lease(2, 0, 0).is_none());
        assert!(leases.lease(3, 4096, 4096).is_none());
        assert!(leases.lease(4, 100, 200).is_none());
        assert!(leases.overlaps(0, 1) && leases.live() == 1);
        assert!(leases.take_released().is_empty());
        drop(live);
        assert_eq!(leases.take_released(), [1]);
        assert!(leases.lease(5, 0, 0).is_none());
    }

    #[test]
    fn waiting_ends_when_a_region_comes_back() {
        let leases = Arc::new(Leases::default());
        assert!(leases.wait_returned(Instant::now() + Duration::from_secs(60)));
        let lease = leases.lease(1, 0, 8).unwrap();
        assert!(!leases.wait_returned(Instant::now() + Duration::from_millis(10)));
        let t = std::thread::spawn(move || drop(lease));
        assert!(leases.wait_returned(Instant::now() + Duration::from_secs(60)));
        t.join().unwrap();
        assert_eq!(leases.take_released(), [1]);
    }
}
