//! The region sink: the vLLM connector's hot path into the writer, a few calls per engine step
//! whatever the number of requests the step finished (`layertap.vllm.region_sinks.NativeSink` through
//! the binding `layertap._native.NativeRegionSink`, which only converts arguments).
//!
//! The connector's host pool is one buffer, held for the sink's lifetime. Each step that
//! finishes requests takes a region of it; the sink
//! - [`fill`](RegionSink::fill)s the region's token ids and gather indices from the step's
//!   compact descriptors (the requests' token ids and scheduler block lists), through the
//!   [`Layout`] of the hidden-states cache;
//! - [`submit`](RegionSink::submit)s the step's records to the writer in one call: each
//!   record's tensors are slices of the region and its metadata comes from a per-engine
//!   template (`records.rs`, names from [`crate::record`]); a record the writer refuses costs
//!   only itself (`submit.rs`);
//! - [`reap`](RegionSink::reap)s: returns the regions the writer no longer reads (the last
//!   record slice of a region dropped: once every record of it is *encoded*, with a compressing
//!   codec, or written, with `none`) and how many records were written.
//!
//! A region is *leased* from its `submit` until its last slice is dropped (`leases.rs`); `fill`
//! and `submit` refuse a range that overlaps a live lease, so the pool memory the writer reads
//! is never written through this sink.

mod layout;
mod leases;
mod pool;
mod records;
mod submit;

pub use layout::{Indices, Layout};
pub use records::{Extras, Request};
pub use submit::Submit;

use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::writer::ShardWriter;
use leases::Leases;
use parking_lot::Mutex;
use pool::Pool;
use records::{RecordShape, RegionSlices};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long `reap` waits at a time before it looks for the writer's error, which leaves records
/// unwritten (their regions come back once the writer drops them).
const REAP_SLICE: Duration = Duration::from_millis(100);

/// The records of a pool's regions into a writer (see the module docs).
pub struct RegionSink {
    pool: Arc<Pool>,
    leases: Arc<Leases>,
    layout: Layout,
    shape: RecordShape,
    /// Held by `fill` while it writes and by `submit` while it checks and leases a range, so
    /// that no range is leased while `fill` writes it.
    writing: Mutex<()>,
}

impl RegionSink {
    /// A sink for records held in the pool `[base, base + len)`, kept in place by `owner`.
    /// Each record has a `hidden_states` tensor of `dtype` and shape `[tokens, *row_shape]`,
    /// `token_ids` (`I64 [tokens]`) and, when its client sent one, `loss_mask` (`U8`); its
    /// metadata is `metadata` plus `num_tokens`, `request_id` and `num_prompt_tokens` (and the
    /// client's entries). `layout` says where tokens lie in the KV cache.
    ///
    /// # Safety
    /// `[base, base + len)` must be valid for reads and writes, and stay so and in place while
    /// `owner` lives (the sink and every record slice of it keep `owner`); while a range of it
    /// is leased (from `submit` until `reap` returns its region), nothing but this sink may
    /// write it.
    pub unsafe fn new(
        owner: Box<dyn Send>,
        base: *mut u8,
        len: usize,
        dtype: Dtype,
        row_shape: Vec<u64>,
        metadata: BTreeMap<String, String>,
        layout: Layout,
    ) -> Result<RegionSink> {
        let row_elems: u64 = row_shape.iter().product();
        let row_bytes = row_elems
            .checked_mul(dtype.size() as u64)
            .and_then(|b| usize::try_from(b).ok())
            .ok_or_else(|| Error::invalid("row_shape too large"))?;
        Ok(RegionSink {
            // SAFETY: the caller's contract is `Pool::new`'s.
            pool: Arc::new(unsafe { Pool::new(owner, base, len) }),
            leases: Arc::new(Leases::default()),
            layout,
            shape: RecordShape {
                dtype,
                row_shape,
                row_bytes,
                metadata,
            },
            writing: Mutex::new(()),
        })
    }

    /// The cache layout the indices follow.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Checks that `[start, start + len)` is in the pool, aligned to `align`, and not leased.
    fn check_range(&self, what: &str, start: usize, len: usize, align: usize) -> Result<usize> {
        let end = start.checked_add(len).filter(|&e| e <= self.pool.len);
        let Some(end) = end else {
            return Err(Error::invalid(format!(
                "{what}: bytes {start}..{start}+{len} are outside the pool of {} bytes",
                self.pool.len
            )));
        };
        if !(self.pool.base + start).is_multiple_of(align) {
            return Err(Error::invalid(format!(
                "{what}: offset {start} is not aligned to {align}"
            )));
        }
        if len > 0 && self.leases.overlaps(start, end) {
            return Err(Error::invalid(format!(
                "{what}: bytes {start}..{end} overlap a region the writer still reads"
            )));
        }
        Ok(end)
    }

    /// Writes the token ids of a step's requests at pool offset `ids_offset` and where each
    /// token lies in the cache, [`Layout::width`] int64 per token, at `index_offset`; request
    /// `i` has `num_tokens[i]` tokens. `request(i, ids, blocks)` copies request `i`'s token ids
    /// into `ids` and pushes its scheduler block ids onto `blocks` (empty; at least enough for
    /// its tokens, [`Layout::holds`]). It must not call this sink (which would wait forever).
    /// Returns the number of tokens.
    pub fn fill<E: From<Error>>(
        &self,
        ids_offset: usize,
        index_offset: usize,
        num_tokens: &[u64],
        mut request: impl FnMut(usize, &mut [i64], &mut Vec<u64>) -> std::result::Result<(), E>,
    ) -> std::result::Result<u64, E> {
        let total_len = token_starts("fill", num_tokens.iter().copied())?.1;
        let width = self.layout.width();
        let ids_len = total_len
            .checked_mul(8)
            .ok_or_else(|| Error::invalid("fill: too many tokens"))?;
        let index_len = ids_len
            .checked_mul(width)
            .ok_or_else(|| Error::invalid("fill: too many tokens"))?;
        let _writing = self.writing.lock();
        let ids_end = self.check_range("fill: token ids", ids_offset, ids_len, 8)?;
        let index_end = self.check_range("fill: indices", index_offset, index_len, 8)?;
        if ids_offset < index_end && index_offset < ids_end && total_len > 0 {
            return Err(Error::invalid("fill: the token ids and the indices overlap").into());
        }
        // SAFETY: both ranges lie within the pool (checked above), are aligned to 8 bytes, do not
        // overlap each other, and overlap no live lease, so no record slice reads them; while
        // `_writing` is held no range is leased and no other `fill` runs, so nothing else
        // writes them through this sink meanwhile (and nothing outside it may, `new`'s
        // contract). The pool's memory is writable and stays in place while `self.pool` lives.
        let (ids, index) = unsafe {
            (
                std::slice::from_raw_parts_mut(
                    (self.pool.base + ids_offset) as *mut i64,
                    total_len,
                ),
                std::slice::from_raw_parts_mut(
                    (self.pool.base + index_offset) as *mut i64,
                    total_len * width,
                ),
            )
        };
        let mut blocks = Vec::new();
        let mut at = 0usize;
        for (i, &n) in num_tokens.iter().enumerate() {
            let n = n as usize;
            blocks.clear();
            request(i, &mut ids[at..at + n], &mut blocks)?;
            if !self.layout.holds(blocks.len(), n) {
                return Err(Error::invalid(format!(
                    "fill: record {i} has {n} tokens but {} blocks of {}",
                    blocks.len(),
                    self.layout.block_size()
                ))
                .into());
            }
            self.layout
                .write_request(&blocks, &mut index[at * width..(at + n) * width]);
            at += n; // at most `total_len`: the sum was checked
        }
        Ok(total_len as u64)
    }

    /// Hands the records of region `region` (pool bytes `[start, start + nbytes)`) to the
    /// writer through `writer` in one call: record `i` is tokens `[sum(num_tokens[:i]), ...)`
    /// of the hidden states at `hidden_offset` and the token ids at `ids_offset`. A record the
    /// writer refuses (bad input, a key it already took) costs only itself: returns
    /// `(index, message)` for each. [`reap`](Self::reap) reports the region once the writer no
    /// longer reads it.
    #[allow(clippy::too_many_arguments)]
    pub fn submit(
        &self,
        writer: &mut impl Submit,
        region: u64,
        start: usize,
        nbytes: usize,
        hidden_offset: usize,
        ids_offset: usize,
        requests: &[Request],
    ) -> Result<Vec<(usize, String)>> {
        // Checked: a sum that wrapped (`[u64::MAX, 1]` adds up to 0 in a release build) let
        // every range check pass and put record 1 before the region.
        let (starts, total) = token_starts("submit", requests.iter().map(|r| r.num_tokens))?;
        if nbytes == 0 {
            // An empty lease would share its key with a live lease at the same start.
            return Err(Error::invalid(format!(
                "submit: region {region} is empty (nbytes 0); submit a region that holds its \
                 records' bytes"
            )));
        }
        let lease = {
            let _writing = self.writing.lock();
            let end = self.check_range("submit: region", start, nbytes, 1)?;
            let inside = |off: usize, len: Option<usize>| {
                off >= start
                    && len
                        .and_then(|l| off.checked_add(l))
                        .is_some_and(|e| e <= end)
            };
            if !inside(hidden_offset, total.checked_mul(self.shape.row_bytes))
                || !inside(ids_offset, total.checked_mul(8))
            {
                return Err(Error::invalid(
                    "submit: the hidden states or token ids are outside the region",
                ));
            }
            let lease = self.leases.lease(region, start, end).ok_or_else(|| {
                Error::invalid(format!(
                    "submit: region: bytes {start}..{end} overlap a region the writer still reads"
                ))
            })?;
            Arc::new(lease)
        };
        let slices = RegionSlices {
            pool: &self.pool,
            lease: &lease,
            hidden_offset,
            ids_offset,
        };
        // The records hold the lease now; the region comes back with the last of them.
        submit::all_or_each(writer, requests.len(), |i| {
            self.shape.record(&slices, starts[i], &requests[i])
        })
    }

    /// The regions the writer no longer reads, since the last call, and the number of records
    /// `writer` (the one `submit` was given) wrote meanwhile; the regions of the records counted
    /// are among those returned (by this call or an earlier one). With a `timeout` other than zero
    /// (`None`: no limit), first waits until a region comes back, unless none is leased, or the
    /// writer fails.
    ///
    /// The writer's error is returned only by a call that counted no record; one that did
    /// returns its count and leaves the error pending in the writer, for the next call (which,
    /// the writer having stopped, soon counts none). Returning the error there dropped records
    /// already drained from the writer: they were never counted, and the connector's counts of
    /// records written came out short.
    pub fn reap(&self, writer: &ShardWriter, timeout: Option<Duration>) -> Result<(Vec<u64>, u64)> {
        let mut written = 0u64;
        if timeout != Some(Duration::ZERO) {
            let deadline = timeout.map(|t| Instant::now() + t);
            loop {
                let slice = Instant::now() + REAP_SLICE;
                let returned = self
                    .leases
                    .wait_returned(deadline.map_or(slice, |d| d.min(slice)));
                written += writer.poll_keeping_error()?.len() as u64;
                if returned || writer.failed() || deadline.is_some_and(|d| Instant::now() >= d) {
                    break;
                }
            }
        }
        // Polled before the regions are taken, never after: the writer drops a record's slices
        // before it reports the record, so every region of a record counted here is in
        // `released`. (Polled after, a record could be counted written while its region came
        // back only at the next call: a caller that waits for both saw its pool still in use.)
        written += writer.poll_keeping_error()?.len() as u64;
        if written == 0 {
            // The writer's error, if any (a poll that returns it drains nothing); else what was
            // written since the line above.
            written += writer.poll()?.len() as u64;
        }
        let released = self.leases.take_released();
        Ok((released, written))
    }

    /// Regions leased to the writer now.
    pub fn live_regions(&self) -> usize {
        self.leases.live()
    }
}

/// Where each record starts (in tokens from the first) and the total, or `InvalidInput` if the
/// total does not fit a `usize` (nor then the pool).
fn token_starts(what: &str, mut counts: impl Iterator<Item = u64>) -> Result<(Vec<usize>, usize)> {
    let mut starts = Vec::with_capacity(counts.size_hint().0);
    let total = counts.try_fold(0usize, |at, n| {
        starts.push(at);
        usize::try_from(n).ok().and_then(|n| at.checked_add(n))
    });
    let total = total.ok_or_else(|| {
        Error::invalid(format!(
            "{what}: the token counts add up to more than {}; pass each record's real count",
            usize::MAX
        ))
    })?;
    Ok((starts, total))
}

#[cfg(test)]
mod tests;
