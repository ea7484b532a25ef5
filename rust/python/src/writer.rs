//! Bindings of the core writer: `NativeShardWriter`. The GIL is held only to convert arguments
//! and results; it is released while `submit` waits for the in-flight budget and around
//! `flush`, `close` and opening. The writer's own threads never take it (see `buffers_in`).

use crate::buffers_in::{drain_graveyard, PyRecordBuffer};
use crate::errors::{to_py, IntoPyResult};
use crate::options::PyWriterOptions;
use layertap_core::blob::TensorSpec;
use layertap_core::writer::{Completion, RecordInput, ShardWriter, TensorInput};
use layertap_core::{Dtype, Error};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// How long `encoder_thread_ids` waits for a new writer's threads to start: they start within
/// microseconds, but a loaded machine may run them late.
const ENCODER_START_WAIT: Duration = Duration::from_secs(2);

fn invalid(msg: impl Into<String>) -> PyErr {
    to_py(Error::invalid(msg))
}

fn string_map(what: &str, value: Option<&Bound<'_, PyAny>>) -> PyResult<BTreeMap<String, String>> {
    match value {
        None => Ok(BTreeMap::new()),
        Some(v) if v.is_none() => Ok(BTreeMap::new()),
        Some(v) => v.extract::<BTreeMap<String, String>>().map_err(|_| {
            invalid(format!(
                "{what} must be a dict of str to str (valid UTF-8), not {}",
                v.repr().map(|r| r.to_string()).unwrap_or_default()
            ))
        }),
    }
}

/// One `(name, buffer, dtype, shape)` tuple of `submit`, or `(name, buffer, dtype, shape,
/// stored)` with `stored` `"exp-huf"` for a floating tensor whose buffer holds its exp-huf
/// block, encoded by the caller (`TensorInput::exphuf_block`), or `"raw"`.
fn tensor_input(item: &Bound<'_, PyAny>) -> PyResult<TensorInput> {
    let shape_err =
        || invalid("each tensor must be a tuple (name, buffer, dtype, shape[, stored])");
    let tuple = item.cast::<PyTuple>().map_err(|_| shape_err())?;
    if !matches!(tuple.len(), 4 | 5) {
        return Err(shape_err());
    }
    let item = |i: usize| tuple.get_item(i).map_err(|_| shape_err());
    let (name, buffer, dtype, shape) = (item(0)?, item(1)?, item(2)?, item(3)?);
    let stored = if tuple.len() == 5 {
        Some(item(4)?)
    } else {
        None
    };
    let name: String = name
        .extract()
        .map_err(|_| invalid(format!("tensor name {name} is not a str of valid UTF-8")))?;
    let dtype: String = dtype
        .extract()
        .map_err(|_| invalid(format!("tensor {name:?}: dtype {dtype} is not a str")))?;
    let dtype = Dtype::from_name(&dtype).map_err(|e| invalid(format!("tensor {name:?}: {e}")))?;
    let shape: Vec<u64> = shape.extract().map_err(|_| {
        invalid(format!(
            "tensor {name:?}: shape {shape} is not a sequence of non-negative ints"
        ))
    })?;
    let encoded = match stored.as_ref().map(|s| s.extract::<String>()) {
        None => false,
        Some(Ok(s)) if s == "raw" => false,
        Some(Ok(s)) if s == "exp-huf" => true,
        Some(_) => {
            return Err(invalid(format!(
                "tensor {name:?}: stored must be \"raw\" or \"exp-huf\" (the buffer holds the tensor's exp-huf block), not {}",
                stored.map(|s| s.repr().map(|r| r.to_string()).unwrap_or_default()).unwrap_or_default()
            )))
        }
    };
    let data = PyRecordBuffer::get(&buffer)
        .map_err(|reason| invalid(format!("tensor {name:?}: {reason}")))?;
    let spec = TensorSpec { name, dtype, shape };
    Ok(if encoded {
        TensorInput::exphuf_block(spec, data)
    } else {
        TensorInput::new(spec, data)
    })
}

fn completion_tuple<'py>(py: Python<'py>, c: Completion) -> PyResult<Bound<'py, PyTuple>> {
    let shard = c.shard.display().to_string();
    (c.seq, c.key, shard, c.offset, c.stored_len, c.raw_len).into_pyobject(py)
}

/// The Rust shard writer (see `layertap_core::writer::ShardWriter`); `layertap.ShardWriter`
/// wraps it with the documented Python API.
#[pyclass(frozen, module = "layertap._native")]
pub struct NativeShardWriter {
    pub(crate) writer: ShardWriter,
    #[pyo3(get)]
    path: String,
}

#[pymethods]
impl NativeShardWriter {
    /// Opens a writer on a dataset directory (created if missing) with checked options.
    #[new]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        options: &Bound<'_, PyWriterOptions>,
    ) -> PyResult<NativeShardWriter> {
        let cfg = options.get().config.clone();
        let writer = py.detach(|| ShardWriter::open(&path, cfg)).py_err()?;
        Ok(NativeShardWriter {
            writer,
            path: path.display().to_string(),
        })
    }

    /// Queues one record and returns its sequence number. `tensors` is a list of
    /// `(name, buffer, dtype_name, shape)`; each buffer must be C-contiguous and is held (not
    /// copied) until the record is written. Waits, with the GIL released, while the in-flight
    /// budget is full.
    #[pyo3(signature = (key, tensors, metadata = None, num_tokens = 0))]
    fn submit(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        tensors: &Bound<'_, PyList>,
        metadata: Option<&Bound<'_, PyAny>>,
        num_tokens: u32,
    ) -> PyResult<u64> {
        drain_graveyard(py);
        let key: String = key
            .extract()
            .map_err(|_| invalid(format!("record key {key} is not a str of valid UTF-8")))?;
        let metadata = string_map("metadata", metadata)?;
        let tensors = tensors
            .iter()
            .map(|t| tensor_input(&t))
            .collect::<PyResult<Vec<_>>>()?;
        let record = RecordInput {
            key,
            tensors,
            metadata,
            num_tokens,
        };
        let seq = submit_many_holding_gil(py, &self.writer, vec![record]).map(|seqs| seqs[0]);
        drain_graveyard(py); // a refused record's buffers
        seq.py_err()
    }

    /// Several records at once: a list of `(key, tensors, metadata, num_tokens)` tuples, each
    /// as `submit` takes them; returns their sequence numbers. Bad input in any record refuses
    /// them all (`ShardWriter::submit_many`).
    fn submit_many(&self, py: Python<'_>, records: &Bound<'_, PyList>) -> PyResult<Vec<u64>> {
        drain_graveyard(py);
        let mut batch = Vec::with_capacity(records.len());
        for item in records.iter() {
            let (key, tensors, metadata, num_tokens): (
                Bound<'_, PyAny>,
                Bound<'_, PyList>,
                Option<Bound<'_, PyAny>>,
                u32,
            ) = item.extract().map_err(|_| {
                invalid("each record must be a tuple (key, list of tensors, metadata or None, num_tokens)")
            })?;
            let key: String = key
                .extract()
                .map_err(|_| invalid(format!("record key {key} is not a str of valid UTF-8")))?;
            let metadata = string_map("metadata", metadata.as_ref())?;
            let tensors = tensors
                .iter()
                .map(|t| tensor_input(&t))
                .collect::<PyResult<Vec<_>>>()?;
            batch.push(RecordInput {
                key,
                tensors,
                metadata,
                num_tokens,
            });
        }
        let seqs = submit_many_holding_gil(py, &self.writer, batch);
        drain_graveyard(py); // refused records' buffers
        seqs.py_err()
    }

    /// The records written since the last call, in sequence order, as tuples
    /// `(seq, key, shard, offset, stored_len, raw_len)`. With `timeout` > 0 (seconds) or
    /// `None` (no limit), first waits (GIL released) until at least one record is written,
    /// unless none is in flight.
    #[pyo3(signature = (timeout = Some(0.0)))]
    fn poll<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyList>> {
        let wait = match timeout {
            Some(t) if !(t >= 0.0 && t.is_finite()) => {
                return Err(to_py(Error::invalid(format!(
                    "poll timeout must be >= 0 seconds or None, not {t}"
                ))));
            }
            Some(0.0) => None,
            Some(t) => Some(Some(Duration::from_secs_f64(t))),
            None => Some(None),
        };
        let done = match wait {
            None => self.writer.poll(),
            Some(limit) => py.detach(|| self.writer.poll_wait(limit)),
        };
        drain_graveyard(py);
        let done = done.py_err()?;
        let list = PyList::empty(py);
        for c in done {
            list.append(completion_tuple(py, c)?)?;
        }
        Ok(list)
    }

    /// Waits (GIL released) until every submitted record is written and, unless durability
    /// is `"none"`, fsynced.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let r = py.detach(|| self.writer.flush());
        drain_graveyard(py);
        r.py_err()
    }

    /// Writes everything, completes the open shard, releases its lock (GIL released).
    /// Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let r = py.detach(|| self.writer.close());
        drain_graveyard(py);
        r.py_err()
    }

    /// The counters, as a dict (docs/API.md).
    #[getter]
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        drain_graveyard(py);
        let s = self.writer.stats().py_err()?;
        let d = PyDict::new(py);
        d.set_item("records_submitted", s.records_submitted)?;
        d.set_item("records_written", s.records_written)?;
        d.set_item("bytes_in", s.bytes_in)?;
        d.set_item("bytes_stored", s.bytes_stored)?;
        d.set_item("ratio", s.ratio)?;
        d.set_item("queue_depth", s.queue_depth)?;
        d.set_item("inflight_bytes", s.inflight_bytes)?;
        d.set_item("blocked_seconds", s.blocked_seconds)?;
        d.set_item("shards_closed", s.shards_closed)?;
        d.set_item("backend", s.backend.name())?;
        d.set_item("direct", s.direct)?;
        d.set_item("threads", s.threads)?;
        d.set_item("encode_seconds", s.encode_seconds)?;
        Ok(d)
    }

    /// `"io_uring"` or `"pwrite"`.
    #[getter]
    fn backend(&self) -> &'static str {
        self.writer.backend().name()
    }

    /// The OS thread ids of the compression threads (Linux; empty elsewhere), waiting for
    /// threads still starting (up to `ENCODER_START_WAIT`), with the GIL released.
    #[getter]
    fn encoder_thread_ids(&self, py: Python<'_>) -> PyResult<Vec<i64>> {
        py.detach(|| self.writer.encoder_thread_ids(ENCODER_START_WAIT))
            .py_err()
    }

    /// The writer id in the names of this writer's shards.
    #[getter]
    fn writer_id(&self) -> &str {
        self.writer.writer_id()
    }

    fn __repr__(&self) -> String {
        format!(
            "<NativeShardWriter {:?} writer_id={:?}>",
            self.path,
            self.writer.writer_id()
        )
    }
}

impl Drop for NativeShardWriter {
    fn drop(&mut self) {
        // Close (flush, footer, unlock) with the GIL released: the writer's threads may be
        // busy for a while. In a forked child `close` refuses at once and nothing is touched.
        Python::try_attach(|py| {
            let _ = py.detach(|| self.writer.close());
            drain_graveyard(py);
        });
    }
}

/// Queues `recs`, releasing the GIL only when the writer may wait for budget
/// (`ShardWriter::admits_now`). Queueing alone takes microseconds; releasing the GIL around it
/// hands the GIL to any other runnable Python thread (vLLM's engine core has two), and taking
/// it back can cost up to the interpreter's switch interval, 5 ms, on every call.
pub(crate) fn submit_many_holding_gil(
    py: Python<'_>,
    writer: &ShardWriter,
    recs: Vec<RecordInput>,
) -> layertap_core::Result<Vec<u64>> {
    let batch = writer.prepare_many(recs)?;
    if writer.admits_now(&batch) {
        writer.submit_prepared(batch)
    } else {
        py.detach(|| writer.submit_prepared(batch))
    }
}

/// Adds this module's classes and functions to `layertap._native`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeShardWriter>()?;
    Ok(())
}
