//! `TensorBuffer`: the bytes of one tensor of a record read from a shard, handed to Python
//! without a copy.
//!
//! Python reaches the bytes through the NumPy array interface (`__array_interface__`):
//! `numpy.asarray(buffer)` is a writable `uint8` array over them whose `base` is the buffer, and
//! that array supports the buffer protocol (`memoryview`, `torch.frombuffer`). The buffer
//! protocol itself (`__getbuffer__`) is not part of the stable ABI before Python 3.11, and this
//! module is built for the abi3 of Python 3.10.

use layertap_core::reader::RecordBytes;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::Arc;

/// The bytes of one tensor of a record: a slice of the record's own private copy-on-write mapping
/// of the shard (codec `none`, large records) or of its decoded buffer. Writable; writes never
/// reach the file, nor the bytes any other read of the record returns.
#[pyclass(frozen, module = "layertap._native")]
pub struct TensorBuffer {
    /// Keeps the record's mapping or buffer alive for as long as this object, and so for as
    /// long as any array or tensor made from it (they hold a reference to it).
    bytes: Arc<RecordBytes>,
    start: usize,
    len: usize,
}

impl TensorBuffer {
    /// The bytes `[start, start + len)` of `bytes`; the range must lie inside them.
    pub fn new(bytes: Arc<RecordBytes>, start: usize, len: usize) -> Option<TensorBuffer> {
        (start.checked_add(len)? <= bytes.len()).then_some(TensorBuffer { bytes, start, len })
    }

    fn address(&self) -> usize {
        // `new` checked that the range lies inside the record's bytes, so this stays inside the
        // same allocation (wrapping_add only avoids an unsafe block for a plain address).
        self.bytes.as_mut_ptr().wrapping_add(self.start) as usize
    }
}

#[pymethods]
impl TensorBuffer {
    /// The NumPy array interface (version 3): a one-dimensional, writable array of bytes.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("version", 3)?;
        d.set_item("shape", (self.len,))?;
        d.set_item("typestr", "|u1")?;
        // (address, read_only): the memory is the record's own, so writing is allowed. The
        // address stays valid for as long as this object lives (`bytes` owns the memory), and
        // NumPy keeps this object alive as the `base` of every array made from the interface;
        // torch.frombuffer keeps the array alive in turn.
        d.set_item("data", (self.address(), false))?;
        Ok(d)
    }

    fn __len__(&self) -> usize {
        self.len
    }

    /// Number of bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.len
    }

    /// Address of the first byte.
    #[getter(address)]
    fn py_address(&self) -> usize {
        self.address()
    }

    /// Whether the bytes are a mapping of the shard file (zero copy) rather than a buffer.
    #[getter]
    fn mapped(&self) -> bool {
        self.bytes.is_mapped()
    }

    fn __repr__(&self) -> String {
        format!(
            "<TensorBuffer of {} bytes{}>",
            self.len,
            if self.mapped() { ", mapped" } else { "" }
        )
    }
}
