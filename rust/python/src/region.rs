//! `NativeRegionSink`: the vLLM connector's hot path (`layertap.vllm.transfer`) in a few calls
//! per engine step, whatever the number of requests the step finished.
//!
//! The connector's host pool is one buffer, held here for the sink's lifetime. Each step that
//! finishes requests takes a region of it; the sink
//! - `fill`s the region's token ids and gather indices from the step's compact descriptors (the
//!   requests' token-id lists and KV block lists, as the scheduler half handed them over);
//! - `submit`s the step's records to the writer in one call: each record's tensors are slices
//!   of the region and its metadata comes from a per-engine template, built here;
//! - `reap`s: returns the regions the writer no longer reads (the last record slice of a region
//!   dropped: once every record of it is *encoded*, with a compressing codec, or written, with
//!   `none`) and how many records were written, without a Python object per record.
//!
//! A region is *leased* from its `submit` until its last slice is dropped; `fill` and `submit`
//! refuse a range that overlaps a live lease, so the pool memory the writer reads is never
//! written through this sink.

use crate::buffers_in::{drain_graveyard, PyRecordBuffer};
use crate::errors::{to_py, IntoPyResult};
use crate::writer::NativeShardWriter;
use layertap_core::blob::TensorSpec;
use layertap_core::writer::{RecordBuffer, RecordInput, TensorInput};
use layertap_core::{Dtype, Error};
use parking_lot::{Condvar, Mutex};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn invalid(msg: impl Into<String>) -> PyErr {
    to_py(Error::invalid(msg))
}

/// The pool's memory: a writable buffer held (not released) while the sink or any record slice
/// lives, so its address and length never change.
struct Pool {
    _held: PyRecordBuffer,
    base: usize,
    len: usize,
}

// SAFETY: `Pool` is read through `&self` only for `base` and `len`, plain integers copied when
// it was made; the held buffer is never touched through `&self` (only dropped, once, which hands
// it to the graveyard for release under the GIL).
unsafe impl Sync for Pool {}

/// Regions leased to the writer (start -> end, in pool bytes) and those it gave back.
#[derive(Default)]
struct Leases {
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

/// One region's records in the writer; dropped with the last slice of the region.
struct Lease {
    id: u64,
    start: usize,
    pool: Arc<Pool>,
    leases: Arc<Leases>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut s = self.leases.state.lock();
        s.live.remove(&self.start);
        s.released.push(self.id);
        drop(s);
        self.leases.returned.notify_all();
    }
}

/// One tensor of a record: bytes `[start, start + len)` of the pool.
struct PoolSlice {
    lease: Arc<Lease>,
    start: usize,
    len: usize,
}

impl RecordBuffer for PoolSlice {
    fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `submit` checked that the range lies within the pool, whose memory the held
        // buffer keeps alive and in place while `self.lease.pool` lives (which `self` keeps).
        // The range is inside a live lease, and `fill`/`submit` refuse to write or lease any
        // range overlapping a live lease, so nothing writes these bytes through this sink while
        // the slice lives (the connector's own writes into the pool, its gathers, go to regions
        // it has not submitted or got back from `reap`).
        unsafe {
            std::slice::from_raw_parts((self.lease.pool.base + self.start) as *const u8, self.len)
        }
    }
}

/// Where each token of a request lies in the hidden-states KV cache (see
/// `layertap.vllm.gather.HiddenStatesCache`).
struct Layout {
    /// Tokens per scheduler block.
    block_size: u64,
    /// Tokens per block of the cache tensor (a divisor of `block_size`).
    tensor_block_size: u64,
    /// Rows per tensor block and per token, and the row of each layer: indices are row numbers,
    /// one per layer. `None`: indices are `(tensor block, offset)` pairs.
    rows: Option<(i64, i64, Vec<i64>)>,
}

impl Layout {
    fn width(&self) -> usize {
        self.rows.as_ref().map_or(2, |(_, _, layers)| layers.len())
    }
}

/// Copies the first `out.len()` items of `list` (at least that long), ints that fit an i64, into
/// `out`. Through the C API directly: a step holds up to hundreds of thousands of token ids, and
/// a `Bound` per item (a reference count taken and dropped) would double the time.
fn copy_ints(list: &Bound<'_, PyList>, out: &mut [i64]) -> Result<(), String> {
    let py = list.py();
    if list.len() < out.len() {
        return Err(format!("{} ids where {} are needed", list.len(), out.len()));
    }
    for (t, slot) in out.iter_mut().enumerate() {
        // SAFETY: the GIL is held (`py`), `list` is a live list of at least `out.len()` items
        // and nothing else runs while the GIL is held; `PyList_GetItem` returns a borrowed
        // reference that the list keeps alive, used only before the next item.
        let value = unsafe {
            let item = ffi::PyList_GetItem(list.as_ptr(), t as ffi::Py_ssize_t);
            if item.is_null() {
                return Err(PyErr::fetch(py).to_string());
            }
            ffi::PyLong_AsLongLong(item)
        };
        if value == -1 {
            if let Some(err) = PyErr::take(py) {
                return Err(format!("item {t}: {err}"));
            }
        }
        *slot = value;
    }
    Ok(())
}

/// A record's extras from the client: metadata entries and a loss mask.
type Extras = (BTreeMap<String, String>, Option<Vec<u8>>);

/// The vLLM connector's path into a `NativeShardWriter` (see the module docs).
#[pyclass(frozen, module = "layertap._native")]
pub struct NativeRegionSink {
    writer: Py<NativeShardWriter>,
    pool: Arc<Pool>,
    leases: Arc<Leases>,
    dtype: Dtype,
    row_shape: Vec<u64>,
    row_bytes: usize,
    metadata: BTreeMap<String, String>,
    layout: Layout,
}

impl NativeRegionSink {
    /// Checks that `[start, start + len)` is in the pool, aligned to `align`, and not leased.
    fn check_range(&self, what: &str, start: usize, len: usize, align: usize) -> PyResult<()> {
        let end = start.checked_add(len).filter(|&e| e <= self.pool.len);
        let Some(end) = end else {
            return Err(invalid(format!(
                "{what}: bytes {start}..{start}+{len} are outside the pool of {} bytes",
                self.pool.len
            )));
        };
        if !(self.pool.base + start).is_multiple_of(align) {
            return Err(invalid(format!(
                "{what}: offset {start} is not aligned to {align}"
            )));
        }
        if len > 0 && self.leases.state.lock().overlaps(start, end) {
            return Err(invalid(format!(
                "{what}: bytes {start}..{end} overlap a region the writer still reads"
            )));
        }
        Ok(())
    }

    /// The record of request `i` (tokens `[at, at + n)` of the region).
    #[allow(clippy::too_many_arguments)]
    fn record(
        &self,
        lease: &Arc<Lease>,
        hidden_offset: usize,
        ids_offset: usize,
        at: usize,
        n: u64,
        key: &str,
        request_id: &str,
        num_prompt_tokens: u64,
        extras: Option<&Extras>,
    ) -> RecordInput {
        let len = n as usize;
        let mut metadata = self.metadata.clone();
        metadata.insert("num_tokens".into(), n.to_string());
        metadata.insert("request_id".into(), request_id.to_owned());
        metadata.insert("num_prompt_tokens".into(), num_prompt_tokens.to_string());
        let slice = |start: usize, len: usize| PoolSlice {
            lease: lease.clone(),
            start,
            len,
        };
        let mut shape = Vec::with_capacity(1 + self.row_shape.len());
        shape.push(n);
        shape.extend_from_slice(&self.row_shape);
        let mut tensors = vec![
            TensorInput::new(
                TensorSpec {
                    name: "hidden_states".into(),
                    dtype: self.dtype,
                    shape,
                },
                slice(hidden_offset + at * self.row_bytes, len * self.row_bytes),
            ),
            TensorInput::new(
                TensorSpec {
                    name: "token_ids".into(),
                    dtype: Dtype::I64,
                    shape: vec![n],
                },
                slice(ids_offset + at * 8, len * 8),
            ),
        ];
        if let Some((extra_meta, mask)) = extras {
            // The scheduler half refused entries that would replace the connector's own.
            metadata.extend(extra_meta.iter().map(|(k, v)| (k.clone(), v.clone())));
            if let Some(mask) = mask {
                tensors.push(TensorInput::new(
                    TensorSpec {
                        name: "loss_mask".into(),
                        dtype: Dtype::U8,
                        shape: vec![mask.len() as u64],
                    },
                    mask.clone(),
                ));
            }
        }
        RecordInput {
            key: key.to_owned(),
            tensors,
            metadata,
            num_tokens: u32::try_from(n).unwrap_or(u32::MAX),
        }
    }
}

fn extract_extras(extras: &Bound<'_, PyDict>, count: usize) -> PyResult<Vec<Option<Extras>>> {
    let mut out: Vec<Option<Extras>> = (0..count).map(|_| None).collect();
    for (index, value) in extras.iter() {
        let i: usize = index.extract()?;
        if i >= count {
            return Err(invalid(format!("extras: record {i} of {count}")));
        }
        let (meta, mask): (Option<BTreeMap<String, String>>, Option<Bound<'_, PyBytes>>) =
            value.extract().map_err(|_| {
                invalid("extras: each value must be (dict of str or None, bytes or None)")
            })?;
        out[i] = Some((
            meta.unwrap_or_default(),
            mask.map(|m| m.as_bytes().to_vec()),
        ));
    }
    Ok(out)
}

#[pymethods]
impl NativeRegionSink {
    /// A sink into `writer` for records held in `pool` (a writable, C-contiguous buffer held
    /// until the sink and every record from it are gone). Each record has a `hidden_states`
    /// tensor of `dtype` and shape `[tokens, *row_shape]`, `token_ids` (`I64 [tokens]`) and,
    /// when its client sent one, `loss_mask` (`U8 [tokens]`); its metadata is `metadata` plus
    /// `num_tokens`, `request_id` and `num_prompt_tokens` (and the client's entries). The
    /// layout arguments say where tokens lie in the KV cache: `row_steps = (rows per tensor
    /// block, rows per token)` and `layer_rows` (the row of each layer) give row numbers;
    /// `row_steps = None` gives `(tensor block, offset)` pairs.
    #[new]
    #[pyo3(signature = (writer, pool, *, dtype, row_shape, metadata, block_size, tensor_block_size, row_steps, layer_rows))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        writer: Py<NativeShardWriter>,
        pool: &Bound<'_, PyAny>,
        dtype: &str,
        row_shape: Vec<u64>,
        metadata: BTreeMap<String, String>,
        block_size: u64,
        tensor_block_size: u64,
        row_steps: Option<(i64, i64)>,
        layer_rows: Vec<i64>,
    ) -> PyResult<NativeRegionSink> {
        let dtype = Dtype::from_name(dtype).py_err()?;
        if block_size == 0
            || tensor_block_size == 0
            || !block_size.is_multiple_of(tensor_block_size)
        {
            return Err(invalid(format!(
                "block size {block_size} must be a positive multiple of the tensor block size {tensor_block_size}"
            )));
        }
        let row_elems: u64 = row_shape.iter().product();
        let row_bytes = usize::try_from(row_elems * dtype.size() as u64)
            .map_err(|_| invalid("row_shape too large"))?;
        let held = PyRecordBuffer::get_writable(pool).map_err(|r| invalid(format!("pool: {r}")))?;
        let bytes = held.bytes();
        let (base, len) = (bytes.as_ptr() as usize, bytes.len());
        let rows = match row_steps {
            Some((per_block, per_token)) if !layer_rows.is_empty() => {
                Some((per_block, per_token, layer_rows))
            }
            Some(_) => return Err(invalid("layer_rows must not be empty")),
            None => None,
        };
        Ok(NativeRegionSink {
            writer,
            pool: Arc::new(Pool {
                _held: held,
                base,
                len,
            }),
            leases: Arc::new(Leases::default()),
            dtype,
            row_shape,
            row_bytes,
            metadata,
            layout: Layout {
                block_size,
                tensor_block_size,
                rows,
            },
        })
    }

    /// Writes the token ids of a step's records (`token_ids[i][:num_tokens[i]]`, lists of int)
    /// at pool offset `ids_offset`, and where each token lies in the cache (from the records'
    /// scheduler block lists `block_ids[i]`), `index_width` int64 per token, at `index_offset`.
    /// Returns the number of tokens.
    fn fill(
        &self,
        ids_offset: usize,
        index_offset: usize,
        token_ids: &Bound<'_, PyList>,
        num_tokens: Vec<u64>,
        block_ids: &Bound<'_, PyList>,
    ) -> PyResult<u64> {
        let count = num_tokens.len();
        if token_ids.len() != count || block_ids.len() != count {
            return Err(invalid(format!(
                "fill: {count} token counts, {} token-id lists, {} block lists",
                token_ids.len(),
                block_ids.len()
            )));
        }
        let total: u64 = num_tokens.iter().sum();
        let total_len = usize::try_from(total).map_err(|_| invalid("fill: too many tokens"))?;
        let width = self.layout.width();
        self.check_range("fill: token ids", ids_offset, total_len * 8, 8)?;
        self.check_range("fill: indices", index_offset, total_len * width * 8, 8)?;
        let (ids_end, index_end) = (
            ids_offset + total_len * 8,
            index_offset + total_len * width * 8,
        );
        if ids_offset < index_end && index_offset < ids_end && total_len > 0 {
            return Err(invalid("fill: the token ids and the indices overlap"));
        }
        // SAFETY: both ranges lie within the pool (checked above), are aligned to 8 bytes, do not
        // overlap each other, and overlap no live lease, so no record slice reads them; the
        // pool's memory is writable (taken with PyBUF_WRITABLE) and stays in place while
        // `self.pool` lives. The GIL is held for the whole call, so no other call of this sink
        // runs meanwhile.
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
        let (bs, tbs) = (self.layout.block_size, self.layout.tensor_block_size);
        let mut at = 0usize;
        for (i, (tokens, blocks)) in token_ids.iter().zip(block_ids.iter()).enumerate() {
            let n = num_tokens[i] as usize;
            let tokens = tokens
                .cast::<PyList>()
                .map_err(|_| invalid(format!("fill: token ids of record {i} are not a list")))?;
            let blocks = blocks
                .cast::<PyList>()
                .map_err(|_| invalid(format!("fill: blocks of record {i} are not a list")))?;
            if tokens.len() < n || (blocks.len() as u64) * bs < n as u64 {
                return Err(invalid(format!(
                    "fill: record {i} has {n} tokens but {} token ids and {} blocks of {bs}",
                    tokens.len(),
                    blocks.len()
                )));
            }
            copy_ints(tokens, &mut ids[at..at + n])
                .map_err(|e| invalid(format!("fill: token ids of record {i}: {e}")))?;
            let mut t = 0usize;
            for block in blocks.iter() {
                if t >= n {
                    break;
                }
                let block: u64 = block.extract()?;
                for off in 0..(bs as usize).min(n - t) {
                    let slot = block * bs + off as u64;
                    let (blk, toff) = ((slot / tbs) as i64, (slot % tbs) as i64);
                    let row = &mut index[(at + t + off) * width..(at + t + off + 1) * width];
                    match &self.layout.rows {
                        Some((per_block, per_token, layers)) => {
                            let base = blk * per_block + toff * per_token;
                            for (r, layer) in row.iter_mut().zip(layers) {
                                *r = base + layer;
                            }
                        }
                        None => {
                            row[0] = blk;
                            row[1] = toff;
                        }
                    }
                }
                t += bs as usize;
            }
            at += n;
        }
        Ok(total)
    }

    /// Hands the records of region `region` (pool bytes `[start, start + nbytes)`) to the
    /// writer in one call: record `i` is tokens `[sum(num_tokens[:i]), ...)` of the hidden
    /// states at `hidden_offset` and the token ids at `ids_offset`, under `keys[i]`. `extras`
    /// maps a record's index to `(metadata or None, loss mask bytes or None)`. A record the
    /// writer refuses (bad input, a key it already took) costs only itself: returns
    /// `(index, message)` for each. `reap` reports the region once the writer no longer reads it.
    #[pyo3(signature = (region, start, nbytes, hidden_offset, ids_offset, keys, request_ids, num_tokens, num_prompt_tokens, extras))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        py: Python<'_>,
        region: u64,
        start: usize,
        nbytes: usize,
        hidden_offset: usize,
        ids_offset: usize,
        keys: Vec<String>,
        request_ids: Vec<String>,
        num_tokens: Vec<u64>,
        num_prompt_tokens: Vec<u64>,
        extras: &Bound<'_, PyDict>,
    ) -> PyResult<Vec<(usize, String)>> {
        let count = keys.len();
        if request_ids.len() != count
            || num_tokens.len() != count
            || num_prompt_tokens.len() != count
        {
            return Err(invalid(
                "submit: keys, request ids and token counts differ in length",
            ));
        }
        let extras = extract_extras(extras, count)?;
        let total: u64 = num_tokens.iter().sum();
        let total = usize::try_from(total).map_err(|_| invalid("submit: too many tokens"))?;
        self.check_range("submit: region", start, nbytes, 1)?;
        let end = start + nbytes;
        let inside =
            |off: usize, len: usize| off >= start && off.checked_add(len).is_some_and(|e| e <= end);
        if !inside(hidden_offset, total * self.row_bytes) || !inside(ids_offset, total * 8) {
            return Err(invalid(
                "submit: the hidden states or token ids are outside the region",
            ));
        }
        let lease = Arc::new(Lease {
            id: region,
            start,
            pool: self.pool.clone(),
            leases: self.leases.clone(),
        });
        self.leases.state.lock().live.insert(start, end);
        let build = |i: usize, at: usize| {
            self.record(
                &lease,
                hidden_offset,
                ids_offset,
                at,
                num_tokens[i],
                &keys[i],
                &request_ids[i],
                num_prompt_tokens[i],
                extras[i].as_ref(),
            )
        };
        let mut starts = Vec::with_capacity(count);
        let mut at = 0usize;
        for &n in &num_tokens {
            starts.push(at);
            at += n as usize;
        }
        let writer = &self.writer.get().writer;
        let batch: Vec<RecordInput> = (0..count).map(|i| build(i, starts[i])).collect();
        let outcome = crate::writer::submit_many_holding_gil(py, writer, batch);
        let mut failures = Vec::new();
        match outcome {
            Ok(_) => {}
            Err(Error::InvalidInput(_) | Error::DuplicateKey { .. }) => {
                // All or none: find the bad records one by one and write the others.
                for (i, &start) in starts.iter().enumerate().take(count) {
                    let record = build(i, start);
                    match py.detach(|| writer.submit(record)) {
                        Ok(_) => {}
                        Err(e @ (Error::InvalidInput(_) | Error::DuplicateKey { .. })) => {
                            failures.push((i, e.to_string()));
                        }
                        Err(e) => {
                            drop(lease);
                            drain_graveyard(py);
                            return Err(to_py(e));
                        }
                    }
                }
            }
            Err(e) => {
                drop(lease);
                drain_graveyard(py);
                return Err(to_py(e));
            }
        }
        drop(lease); // the records hold it now; the region comes back with the last of them
        drain_graveyard(py);
        Ok(failures)
    }

    /// The regions the writer no longer reads, since the last call, and the number of records
    /// it wrote meanwhile. With `timeout` > 0 (seconds) or `None` (no limit), first waits (GIL
    /// released) until a region comes back, unless none is leased.
    #[pyo3(signature = (timeout = Some(0.0)))]
    fn reap(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<(Vec<u64>, u64)> {
        if let Some(t) = timeout.filter(|t| !(*t >= 0.0 && t.is_finite())) {
            return Err(invalid(format!(
                "reap timeout must be >= 0 seconds or None, not {t}"
            )));
        }
        let writer = &self.writer.get().writer;
        let mut written = 0u64;
        if timeout != Some(0.0) {
            let deadline = timeout.map(|t| Instant::now() + Duration::from_secs_f64(t));
            loop {
                // Wake up now and then to collect the writer's error, which leaves records
                // unwritten (their regions come back once the writer drops them).
                let waited = py.detach(|| {
                    let mut s = self.leases.state.lock();
                    if s.released.is_empty() && !s.live.is_empty() {
                        let slice = Instant::now() + Duration::from_millis(100);
                        let until = deadline.map_or(slice, |d| d.min(slice));
                        self.leases.returned.wait_until(&mut s, until);
                    }
                    !s.released.is_empty() || s.live.is_empty()
                });
                written += writer.poll().py_err()?.len() as u64;
                if waited || deadline.is_some_and(|d| Instant::now() >= d) {
                    break;
                }
            }
        }
        let released = std::mem::take(&mut self.leases.state.lock().released);
        let polled = writer.poll();
        drain_graveyard(py);
        written += polled.py_err()?.len() as u64;
        Ok((released, written))
    }

    /// Regions leased to the writer now.
    #[getter]
    fn live_regions(&self) -> usize {
        self.leases.state.lock().live.len()
    }
}

/// Adds this module's classes to `layertap._native`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeRegionSink>()?;
    Ok(())
}
