//! `NativeRegionSink`: the binding of `layertap_core::region::RegionSink`, the vLLM connector's
//! hot path (`layertap.vllm.region_sinks.NativeSink`) in a few calls per engine step. The layout, the
//! record schema, the leases and the retry live in the core; here: the pool's Python buffer,
//! the conversion of the step's descriptors, and the GIL.

use crate::buffers_in::{drain_graveyard, PyRecordBuffer};
use crate::errors::{to_py, IntoPyResult};
use crate::writer::{submit_many_holding_gil, NativeShardWriter};
use layertap_core::region::{Extras, Layout, RegionSink, Request, Submit};
use layertap_core::writer::{RecordBuffer, RecordInput, ShardWriter};
use layertap_core::{Dtype, Error};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use std::collections::BTreeMap;
use std::time::Duration;

fn invalid(msg: impl Into<String>) -> PyErr {
    to_py(Error::invalid(msg))
}

/// A Python error or the core's, out of `fill`'s per-request conversion.
struct FillError(PyErr);

impl From<Error> for FillError {
    fn from(e: Error) -> Self {
        FillError(to_py(e))
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

/// The records' extras from the client, by index: `(metadata or None, loss mask or None)`.
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
        out[i] = Some(Extras {
            metadata: meta.unwrap_or_default(),
            loss_mask: mask.map(|m| m.as_bytes().to_vec()),
        });
    }
    Ok(out)
}

/// The writer as the sink submits to it from Python: the GIL released only where the writer
/// may wait for budget.
struct HoldingGil<'a, 'py> {
    py: Python<'py>,
    writer: &'a ShardWriter,
}

impl Submit for HoldingGil<'_, '_> {
    fn submit_many(&mut self, records: Vec<RecordInput>) -> layertap_core::Result<Vec<u64>> {
        submit_many_holding_gil(self.py, self.writer, records)
    }

    fn submit_one(&mut self, record: RecordInput) -> layertap_core::Result<u64> {
        self.py.detach(|| self.writer.submit(record))
    }
}

/// The vLLM connector's path into a `NativeShardWriter` (`layertap_core::region`).
#[pyclass(frozen, module = "layertap._native")]
pub struct NativeRegionSink {
    writer: Py<NativeShardWriter>,
    sink: RegionSink,
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
        let layout = Layout::new(block_size, tensor_block_size, row_steps, layer_rows).py_err()?;
        let held = PyRecordBuffer::get_writable(pool).map_err(|r| invalid(format!("pool: {r}")))?;
        let bytes = held.bytes();
        let (base, len) = (bytes.as_ptr().cast_mut(), bytes.len());
        // SAFETY: `held` is a writable (PyBUF_WRITABLE), C-contiguous buffer of `len` bytes at
        // `base`, kept alive and in place by its exporter until released, which happens only
        // when the sink drops `held` (through the graveyard). The connector writes the pool
        // outside this sink only into regions it has not submitted or got back from `reap`.
        let sink = unsafe {
            RegionSink::new(
                Box::new(held),
                base,
                len,
                dtype,
                row_shape,
                metadata,
                layout,
            )
        }
        .py_err()?;
        Ok(NativeRegionSink { writer, sink })
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
        let bs = self.sink.layout().block_size();
        let request = |i: usize, ids: &mut [i64], out: &mut Vec<u64>| {
            let n = ids.len();
            let tokens = token_ids.get_item(i)?;
            let tokens = tokens
                .cast::<PyList>()
                .map_err(|_| invalid(format!("fill: token ids of record {i} are not a list")))?;
            let blocks = block_ids.get_item(i)?;
            let blocks = blocks
                .cast::<PyList>()
                .map_err(|_| invalid(format!("fill: blocks of record {i} are not a list")))?;
            if tokens.len() < n || !self.sink.layout().holds(blocks.len(), n) {
                return Err(invalid(format!(
                    "fill: record {i} has {n} tokens but {} token ids and {} blocks of {bs}",
                    tokens.len(),
                    blocks.len()
                )));
            }
            copy_ints(tokens, ids)
                .map_err(|e| invalid(format!("fill: token ids of record {i}: {e}")))?;
            // Only the blocks that hold the tokens: a request's list may run past them.
            for block in blocks.iter().take(n.div_ceil(bs as usize)) {
                out.push(block.extract()?);
            }
            Ok(())
        };
        let request =
            |i: usize, ids: &mut [i64], out: &mut Vec<u64>| request(i, ids, out).map_err(FillError);
        self.sink
            .fill(ids_offset, index_offset, &num_tokens, request)
            .map_err(|FillError(e)| e)
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
        let requests: Vec<Request> = keys
            .into_iter()
            .zip(request_ids)
            .zip(num_tokens.iter().zip(&num_prompt_tokens))
            .zip(extras)
            .map(|(((key, request_id), (&n, &prompt)), extras)| Request {
                key,
                request_id,
                num_tokens: n,
                num_prompt_tokens: prompt,
                extras,
            })
            .collect();
        let mut writer = HoldingGil {
            py,
            writer: &self.writer.get().writer,
        };
        let outcome = self.sink.submit(
            &mut writer,
            region,
            start,
            nbytes,
            hidden_offset,
            ids_offset,
            &requests,
        );
        drain_graveyard(py); // refused records' buffers
        outcome.py_err()
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
        let timeout = timeout.map(Duration::from_secs_f64);
        let reaped = if timeout == Some(Duration::ZERO) {
            self.sink.reap(writer, timeout) // no wait: keep the GIL (see `submit_many_holding_gil`)
        } else {
            py.detach(|| self.sink.reap(writer, timeout))
        };
        drain_graveyard(py);
        reaped.py_err()
    }

    /// Regions leased to the writer now.
    #[getter]
    fn live_regions(&self) -> usize {
        self.sink.live_regions()
    }
}

/// Adds this module's classes to `layertap._native`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeRegionSink>()?;
    Ok(())
}
