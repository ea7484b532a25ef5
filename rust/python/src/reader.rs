//! Bindings of the core reader and of recovery: `NativeShardReader`, `decode_record` (one record
//! from its stored payload), `recover`, `is_being_written`. The GIL is released around everything that touches shard bytes (scanning,
//! checksums, decompression) and around system calls.

use crate::buffers_in::{drain_graveyard, PyRecordBuffer};
use crate::buffers_out::TensorBuffer;
use crate::errors::{to_py, IntoPyResult};
use layertap_core::blob::BlobHeader;
use layertap_core::reader::{
    decode_payload, read_batch, read_payload, read_stored_batch, BatchRead, PayloadInfo, Placed,
    Problem, RecordBytes, ShardReader, StoredRead,
};
use layertap_core::writer::RecordBuffer;
use layertap_core::{Codec, Error};
use pyo3::exceptions::{PyIndexError, PyMemoryError, PyOSError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// `(kind, offset, key, message)`, as Python sees a problem.
type ProblemTuple = (&'static str, Option<u64>, Option<String>, String);

/// The core's errors as Python exceptions, except that a shard which cannot be opened raises
/// the plain `OSError` subclass Python's own `open()` would (`FileNotFoundError`,
/// `PermissionError`...), with the path as `filename`: `WriterIOError` is for failures while
/// writing.
fn open_err(e: Error) -> PyErr {
    match e {
        Error::Io {
            op: "open",
            path,
            source,
        } => match source.raw_os_error() {
            Some(errno) => {
                // "No such file or directory (os error 2)" -> what os.strerror() says.
                let text = std::io::Error::from_raw_os_error(errno).to_string();
                let strerror = text.split(" (os error").next().unwrap_or(&text).to_string();
                PyOSError::new_err((errno, strerror, path.display().to_string()))
            }
            None => PyOSError::new_err((source.to_string(), path.display().to_string())),
        },
        e => to_py(e),
    }
}

fn problem_tuple(p: &Problem) -> ProblemTuple {
    (
        p.kind(),
        p.offset(),
        p.key().map(str::to_string),
        p.to_string(),
    )
}

/// A memory-mapped shard (see `layertap_core::reader::ShardReader`). The shard-level attributes
/// are fixed when it is opened; `read` and `check` work until `close()`.
#[pyclass(frozen, module = "layertap._native")]
pub struct NativeShardReader {
    /// `None` once closed. Calls clone the `Arc` and release the lock before working, so
    /// `close()` never waits for a read, and records already read outlive the reader.
    reader: Mutex<Option<Arc<ShardReader>>>,
    #[pyo3(get)]
    path: String,
    #[pyo3(get)]
    complete: bool,
    #[pyo3(get)]
    meta_json: String,
    #[pyo3(get)]
    header_len: u64,
    #[pyo3(get)]
    file_bytes: u64,
    #[pyo3(get)]
    data_end: u64,
    #[pyo3(get)]
    torn_tail_bytes: u64,
    #[pyo3(get)]
    index_unusable: bool,
    #[pyo3(get)]
    lost_in_recovery: u32,
    #[pyo3(get)]
    problems: Vec<ProblemTuple>,
    shard_id: [u8; 16],
    path_buf: PathBuf,
}

impl NativeShardReader {
    fn reader(&self) -> PyResult<Arc<ShardReader>> {
        let guard = self
            .reader
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        guard.clone().ok_or_else(|| {
            PyValueError::new_err(format!("{}: the shard reader is closed", self.path))
        })
    }

    /// Record `i` of `r`, Python-style (negative counts from the end).
    fn position(r: &ShardReader, i: isize) -> PyResult<usize> {
        let n = r.len() as isize;
        let at = if i < 0 { i + n } else { i };
        if at < 0 || at >= n {
            return Err(PyIndexError::new_err(format!(
                "record {i} out of range: the shard has {n} records"
            )));
        }
        Ok(at as usize)
    }
}

#[pymethods]
impl NativeShardReader {
    /// Opens a shard (scanning it if it is open, with the GIL released).
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<NativeShardReader> {
        let reader = py.detach(|| ShardReader::open(&path)).map_err(open_err)?;
        Ok(NativeShardReader {
            path: path.display().to_string(),
            complete: reader.is_complete(),
            meta_json: reader.meta_json().to_string(),
            header_len: reader.header_len(),
            file_bytes: reader.file_len(),
            data_end: reader.data_end(),
            torn_tail_bytes: reader.torn_tail_bytes(),
            index_unusable: reader.index_unusable(),
            lost_in_recovery: reader.lost_in_recovery(),
            problems: reader.problems().iter().map(problem_tuple).collect(),
            shard_id: reader.shard_id(),
            path_buf: path,
            reader: Mutex::new(Some(Arc::new(reader))),
        })
    }

    /// The shard's 16 identifying bytes.
    #[getter]
    fn shard_id<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.shard_id)
    }

    /// Whether another process holds the shard's lock now (a writer is writing it).
    #[getter]
    fn being_written(&self, py: Python<'_>) -> PyResult<bool> {
        py.detach(|| layertap_core::reader::is_being_written(&self.path_buf))
            .map_err(open_err)
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.reader.lock().map(|g| g.is_none()).unwrap_or(true)
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.reader()?.len())
    }

    /// The records in file order, as tuples
    /// `(key, frame_offset, stored_len, raw_len, num_tokens, codec_name, payload_crc)`.
    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let r = self.reader()?;
        let rows = r.entries().iter().map(|e| {
            (
                e.key.as_str(),
                e.frame_offset,
                e.stored_len,
                e.raw_len,
                e.num_tokens,
                e.codec.name(),
                e.payload_crc,
            )
        });
        let list = PyList::empty(py);
        for row in rows {
            list.append(row)?;
        }
        Ok(list)
    }

    /// Reads record `i`: `(metadata, [(name, dtype, shape, buffer)])`, tensors in the order of
    /// their data. With `verify`, the payload checksum is checked first. Raises
    /// `CorruptRecordError` (with `path`, `offset`, `key`) when the record is damaged.
    #[pyo3(signature = (i, verify = true))]
    fn read<'py>(&self, py: Python<'py>, i: isize, verify: bool) -> PyResult<Bound<'py, PyTuple>> {
        let r = self.reader()?;
        let at = Self::position(&r, i)?;
        let record = py.detach(|| r.read(at, verify)).py_err()?;
        record_tuple(py, &record.header, record.bytes)
    }

    /// Checks record `i` fully (frame header against the index, checksum, decoding, key).
    /// Raises `CorruptRecordError` when it is damaged.
    fn check(&self, py: Python<'_>, i: isize) -> PyResult<()> {
        let r = self.reader()?;
        let at = Self::position(&r, i)?;
        py.detach(|| r.check(at)).py_err()
    }

    /// Closes the reader: the shard is unmapped once no record read from it is in use any more.
    /// Idempotent.
    fn close(&self) {
        let mut guard = self
            .reader
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        guard.take();
    }

    fn __repr__(&self) -> String {
        format!(
            "<NativeShardReader {:?} {}{}>",
            self.path,
            if self.complete { "complete" } else { "open" },
            if self.closed() { ", closed" } else { "" }
        )
    }
}

/// `(metadata, [(name, dtype, shape, buffer)])` of a decoded record, as Python sees it: the
/// tensors in the order of their data, each buffer a view of the one blob.
fn record_tuple<'py>(
    py: Python<'py>,
    header: &BlobHeader,
    bytes: RecordBytes,
) -> PyResult<Bound<'py, PyTuple>> {
    let metadata = PyDict::new(py);
    for (k, v) in &header.metadata {
        metadata.set_item(k, v)?;
    }
    let bytes = Arc::new(bytes);
    let tensors = PyList::empty(py);
    for t in &header.tensors {
        let buffer = TensorBuffer::new(bytes.clone(), t.range.start, t.range.len())
            .ok_or_else(|| PyValueError::new_err("tensor range outside its record"))?;
        let shape = PyTuple::new(py, &t.spec.shape)?;
        tensors.append((
            t.spec.name.as_str(),
            t.spec.dtype.name(),
            shape,
            Py::new(py, buffer)?,
        ))?;
    }
    PyTuple::new(py, [metadata.into_any(), tensors.into_any()])
}

/// `(metadata, [(name, dtype, shape, buffer)])` of a record read with one tensor placed in the
/// caller's memory: that tensor's buffer is None.
fn placed_tuple<'py>(py: Python<'py>, placed: Placed) -> PyResult<Bound<'py, PyTuple>> {
    let metadata = PyDict::new(py);
    for (k, v) in &placed.header.metadata {
        metadata.set_item(k, v)?;
    }
    let bytes = Arc::new(RecordBytes::from_vec(placed.rest));
    let tensors = PyList::empty(py);
    for (i, t) in placed.header.tensors.iter().enumerate() {
        let shape = PyTuple::new(py, &t.spec.shape)?;
        let buffer = if placed.placed == Some(i) {
            py.None()
        } else {
            let b = TensorBuffer::new(bytes.clone(), t.range.start, t.range.len())
                .ok_or_else(|| PyValueError::new_err("tensor range outside its record"))?;
            Py::new(py, b)?.into_any()
        };
        tensors.append((t.spec.name.as_str(), t.spec.dtype.name(), shape, buffer))?;
    }
    PyTuple::new(py, [metadata.into_any(), tensors.into_any()])
}

/// Reads the records of a training batch: `reads` is a list of `(reader, i, out)`, `out` a
/// writable C-contiguous buffer (a padded row of the batch) that record `i` of `reader`'s tensor
/// `name` is decoded into, at its start, zeros after it, when it fits; no two `out` may overlap.
/// The records' bytes are asked of the kernel first, then decoded on up to `threads` threads
/// with the GIL released. Returns, in order, what `NativeShardReader.read` does with that
/// tensor's buffer None when it went to `out` (else the record holds no such tensor that fits,
/// and `out` is untouched), or the exception reading the record raised (`CorruptRecordError`...).
#[pyfunction]
#[pyo3(signature = (reads, *, name, verify = true, threads = 1))]
fn read_batch_into<'py>(
    py: Python<'py>,
    reads: Vec<(Bound<'py, NativeShardReader>, isize, Bound<'py, PyAny>)>,
    name: String,
    verify: bool,
    threads: usize,
) -> PyResult<Bound<'py, PyList>> {
    let mut jobs = batch_jobs(&reads, "read_batch_into", "a row")?;
    let results = py.detach(move || {
        let mut batch: Vec<BatchRead<'_>> = jobs
            .iter_mut()
            .map(|(r, at, buffer)| BatchRead {
                reader: r,
                index: *at,
                // SAFETY: each buffer was taken writable, and no two overlap (checked above),
                // so each slice is the only one of its memory while the batch is read.
                dst: unsafe { buffer.bytes_mut() },
                result: None,
            })
            .collect();
        read_batch(&mut batch, &name, verify, threads);
        let results: Vec<_> = batch.into_iter().map(|b| b.result).collect();
        drop(jobs); // the buffers go to the graveyard, released below with the GIL
        results
    });
    drain_graveyard(py);
    let out = PyList::empty(py);
    for result in results {
        match result.expect("read_batch sets every result") {
            Ok(placed) => out.append(placed_tuple(py, placed)?)?,
            Err(e) => out.append(to_py(e).into_value(py))?,
        }
    }
    Ok(out)
}

/// The records of a batch read's `reads` (`(reader, i, out)`): each one's reader, position and
/// `out` taken writable. `ValueError` when two `out` overlap (`what` names the function, `each`
/// what each record should get): each is written by its own thread, so no two may share memory.
fn batch_jobs(
    reads: &[(Bound<'_, NativeShardReader>, isize, Bound<'_, PyAny>)],
    what: &str,
    each: &str,
) -> PyResult<Vec<(Arc<ShardReader>, usize, PyRecordBuffer)>> {
    let mut jobs = Vec::with_capacity(reads.len());
    for (reader, i, out) in reads {
        let r = reader.get().reader()?;
        let at = NativeShardReader::position(&r, *i)?;
        let buffer = PyRecordBuffer::get_writable(out).map_err(PyTypeError::new_err)?;
        jobs.push((r, at, buffer));
    }
    let mut spans: Vec<(usize, usize)> = jobs.iter().map(|j| j.2.span()).collect();
    spans.sort_unstable();
    if spans
        .windows(2)
        .any(|w| w[0].1 > 0 && w[1].1 > 0 && w[0].0 + w[0].1 > w[1].0)
    {
        return Err(PyValueError::new_err(format!(
            "the out buffers of {what} overlap: give each record {each} of its own"
        )));
    }
    Ok(jobs)
}

/// Copies the stored payloads of a batch's records, as their shards hold them (not decoded), for
/// a decoder elsewhere (the GPU decoder's pinned staging buffer): `reads` is a list of
/// `(reader, i, out)`, `out` a writable C-contiguous buffer of exactly record `i`'s `stored_len`
/// bytes; no two `out` may overlap. The copies run on up to `threads` threads with the GIL
/// released, each payload's checksum checked as it is copied (with `verify`). Returns, in
/// order, None for each record copied, or the exception reading it raised
/// (`CorruptRecordError`, `InvalidInputError` for an `out` of another length).
#[pyfunction]
#[pyo3(signature = (reads, *, verify = true, threads = 1))]
fn read_stored_into<'py>(
    py: Python<'py>,
    reads: Vec<(Bound<'py, NativeShardReader>, isize, Bound<'py, PyAny>)>,
    verify: bool,
    threads: usize,
) -> PyResult<Bound<'py, PyList>> {
    let mut jobs = batch_jobs(&reads, "read_stored_into", "a buffer")?;
    let results = py.detach(move || {
        let mut batch: Vec<StoredRead<'_>> = jobs
            .iter_mut()
            .map(|(r, at, buffer)| StoredRead {
                reader: r,
                index: *at,
                // SAFETY: each buffer was taken writable, and no two overlap (checked above),
                // so each slice is the only one of its memory while the batch is read.
                dst: unsafe { buffer.bytes_mut() },
                result: None,
            })
            .collect();
        read_stored_batch(&mut batch, verify, threads);
        let results: Vec<_> = batch.into_iter().map(|b| b.result).collect();
        drop(jobs); // the buffers go to the graveyard, released below with the GIL
        results
    });
    drain_graveyard(py);
    let out = PyList::empty(py);
    for result in results {
        match result.expect("read_stored_batch sets every result") {
            Ok(()) => out.append(py.None())?,
            Err(e) => out.append(to_py(e).into_value(py))?,
        }
    }
    Ok(out)
}

/// `nbytes` of memory for a batch to be decoded into (`read_batch_into`'s `out` rows), as a
/// writable buffer: what an earlier batch used, once nothing refers to it any more, when one is
/// large enough (its bytes are what that batch left), else new zeroed memory. Raises
/// `MemoryError` when it cannot be allocated.
#[pyfunction]
fn batch_memory(py: Python<'_>, nbytes: usize) -> PyResult<Py<TensorBuffer>> {
    let bytes = py.detach(|| RecordBytes::recycled(nbytes)).ok_or_else(|| {
        PyMemoryError::new_err(format!("cannot allocate {nbytes} bytes for a batch"))
    })?;
    let bytes = Arc::new(bytes);
    let buffer = TensorBuffer::new(bytes, 0, nbytes)
        .ok_or_else(|| PyValueError::new_err("batch memory shorter than asked"))?;
    Py::new(py, buffer)
}

/// Decodes one record from its stored payload (`stored`: any C-contiguous buffer, the bytes
/// after its frame header as a shard or a store object holds them), with the GIL released:
/// checked against `payload_crc` (unless None), decoded by codec id `codec` to `raw_len` bytes,
/// its key checked. Returns what `NativeShardReader.read` does; raises `CorruptRecordError`
/// naming `path`, `offset` and `key` when the payload is not that record intact.
#[pyfunction]
#[pyo3(signature = (stored, *, key, codec, raw_len, payload_crc, path, offset))]
#[allow(clippy::too_many_arguments)]
fn decode_record<'py>(
    py: Python<'py>,
    stored: &Bound<'py, PyAny>,
    key: String,
    codec: u8,
    raw_len: u64,
    payload_crc: Option<u32>,
    path: PathBuf,
    offset: u64,
) -> PyResult<Bound<'py, PyTuple>> {
    let codec = Codec::from_id(codec).map_err(to_py)?;
    let buffer = PyRecordBuffer::get(stored).map_err(PyTypeError::new_err)?;
    let info = PayloadInfo {
        key: &key,
        codec,
        raw_len,
        payload_crc,
    };
    // The buffer moves into the closure (it is Send, not Sync) and is dropped there: its release
    // waits in the graveyard for the GIL, drained just after.
    let decoded = py.detach(move || decode_payload(buffer.bytes(), &info));
    drain_graveyard(py);
    let (bytes, header) = decoded.map_err(|reason| {
        to_py(Error::CorruptRecord {
            path,
            offset,
            key: Some(key.clone()),
            reason,
        })
    })?;
    record_tuple(py, &header, bytes)
}

/// Reads and decodes the record whose stored payload (`stored_len` bytes) lies at
/// `payload_offset` of the file at `path` (a shard still being written, whose frame the caller
/// found), with the GIL released and the checks of `decode_record`: codec `none` records of at
/// least 64 KiB are privately mapped, not copied, as `NativeShardReader.read` maps them. Raises
/// `CorruptRecordError` naming `path`, `offset` (the frame's) and `key`, also when the file ends
/// before the payload does; `OSError` when the file cannot be opened. With `fd` (a descriptor of
/// the file the caller holds open, borrowed for the call) the file is read through it, so that a
/// shard removed meanwhile is still read as the caller opened it.
#[pyfunction]
#[pyo3(signature = (path, payload_offset, *, key, codec, raw_len, stored_len, payload_crc, offset, fd = None))]
#[allow(clippy::too_many_arguments)]
fn read_record<'py>(
    py: Python<'py>,
    path: PathBuf,
    payload_offset: u64,
    key: String,
    codec: u8,
    raw_len: u64,
    stored_len: u64,
    payload_crc: Option<u32>,
    offset: u64,
    fd: Option<i32>,
) -> PyResult<Bound<'py, PyTuple>> {
    use std::os::fd::FromRawFd;
    let codec = Codec::from_id(codec).map_err(to_py)?;
    let info = PayloadInfo {
        key: &key,
        codec,
        raw_len,
        payload_crc,
    };
    let read = py.detach(|| {
        let file = match fd {
            // SAFETY: the caller holds `fd` open for the call; ManuallyDrop never closes it.
            Some(fd) => std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) }),
            None => std::mem::ManuallyDrop::new(std::fs::File::open(&path).map_err(|source| {
                Error::Io {
                    op: "open",
                    path: path.clone(),
                    source,
                }
            })?),
        };
        let read = read_payload(&file, payload_offset, stored_len, &info);
        if fd.is_none() {
            drop(std::mem::ManuallyDrop::into_inner(file));
        }
        Ok::<_, Error>(read)
    });
    let (bytes, header) = read.map_err(open_err)?.map_err(|reason| {
        to_py(Error::CorruptRecord {
            path: path.clone(),
            offset,
            key: Some(key.clone()),
            reason,
        })
    })?;
    record_tuple(py, &header, bytes)
}

/// Completes a shard whose writer died (see `layertap_core::recover::recover`). Returns a dict
/// with `path`, `was_complete`, `records`, `truncated_bytes`, `removed` and `problems` (tuples
/// `(kind, offset, key, message)`). Raises `ShardLockedError` if a writer holds the shard.
#[pyfunction]
fn recover<'py>(py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyDict>> {
    let report = py
        .detach(|| layertap_core::recover::recover(&path))
        .map_err(open_err)?;
    let d = PyDict::new(py);
    d.set_item("path", report.path.display().to_string())?;
    d.set_item("was_complete", report.was_complete)?;
    d.set_item("records", report.records)?;
    d.set_item("truncated_bytes", report.truncated_bytes)?;
    d.set_item("removed", report.removed)?;
    d.set_item(
        "problems",
        report
            .problems
            .iter()
            .map(problem_tuple)
            .collect::<Vec<_>>(),
    )?;
    Ok(d)
}

/// Whether another process holds the lock of the shard at `path` (a writer is writing it).
#[pyfunction]
fn is_being_written(py: Python<'_>, path: PathBuf) -> PyResult<bool> {
    py.detach(|| layertap_core::reader::is_being_written(&path))
        .map_err(open_err)
}

/// Adds this module's classes and functions to `layertap._native`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeShardReader>()?;
    m.add_class::<TensorBuffer>()?;
    m.add_function(wrap_pyfunction!(decode_record, m)?)?;
    m.add_function(wrap_pyfunction!(read_record, m)?)?;
    m.add_function(wrap_pyfunction!(read_batch_into, m)?)?;
    m.add_function(wrap_pyfunction!(read_stored_into, m)?)?;
    m.add_function(wrap_pyfunction!(batch_memory, m)?)?;
    m.add_function(wrap_pyfunction!(recover, m)?)?;
    m.add_function(wrap_pyfunction!(is_being_written, m)?)?;
    Ok(())
}
