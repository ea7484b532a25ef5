//! Caller buffers handed to the core writer without a copy, and their release without the GIL.
//!
//! The writer drops a buffer on one of its own threads once the record is written. Releasing a
//! Python buffer (`PyBuffer_Release`) needs the GIL, and the writer's threads must never take
//! it (a thread waiting for the GIL while the caller holds it and waits for the writer would
//! deadlock, and it would slow every write). So a dropped buffer goes to the graveyard, and the
//! bindings release what lies there whenever they run with the GIL held.

use layertap_core::writer::RecordBuffer;
use parking_lot::Mutex;
use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::prelude::*;
use std::ffi::{c_char, c_int, c_void};
use std::time::Duration;

/// CPython's `Py_buffer`. The module is built for the stable ABI of Python 3.10, whose headers
/// leave the buffer protocol out (it joined the stable ABI in 3.11), so pyo3 does not offer it
/// there; the struct and the two functions below have been the same since Python 3.3.
#[repr(C)]
struct RawBuffer {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut c_void,
}

extern "C" {
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut RawBuffer, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut RawBuffer);
}

/// `PyBUF_C_CONTIGUOUS`: read-only is fine, the exporter refuses if it is not C-contiguous.
const PYBUF_C_CONTIGUOUS: c_int = 0x0020 | 0x0010 | 0x0008;
/// `PyBUF_WRITABLE`: the exporter refuses read-only memory.
const PYBUF_WRITABLE: c_int = 0x0001;

/// A held (not released) `Py_buffer`, boxed so that its address never changes: exporters may
/// point its fields into itself.
struct HeldBuffer(Box<RawBuffer>);

// SAFETY: a `HeldBuffer` moves between threads but is only *read* off the GIL (its `buf` and
// `len` fields, and the memory they describe, which the exporter keeps alive and in place until
// the buffer is released). It is released only under the GIL, by `HeldBuffer::release` (from
// `get` or `drain_graveyard`), never by a destructor: `HeldBuffer` has none (dropping one
// leaks the export, which is why `PyRecordBuffer::drop` hands it to the graveyard instead).
unsafe impl Send for HeldBuffer {}

impl HeldBuffer {
    fn release(mut self, _py: Python<'_>) {
        // SAFETY: the GIL is held (`_py`); the view was filled by PyObject_GetBuffer and is
        // released exactly once, as `self` is consumed.
        unsafe { PyBuffer_Release(&raw mut *self.0) };
    }
}

/// Python buffers dropped by the writer's threads, waiting for a thread that holds the GIL.
static GRAVEYARD: Mutex<Vec<HeldBuffer>> = Mutex::new(Vec::new());

/// A C-contiguous Python buffer holding one tensor's bytes, owned by the writer until the record
/// is written. Dropping it (on any thread) moves the buffer to the graveyard.
pub struct PyRecordBuffer {
    held: Option<HeldBuffer>,
}

impl PyRecordBuffer {
    /// Takes `obj`'s buffer. `Err(reason)` if it has none or it is not C-contiguous.
    pub fn get(obj: &Bound<'_, PyAny>) -> Result<PyRecordBuffer, String> {
        Self::get_with(obj, PYBUF_C_CONTIGUOUS)
    }

    /// Like [`PyRecordBuffer::get`], for memory the holder may also write (the connector's
    /// pool): `Err(reason)` if the buffer is read-only too.
    pub fn get_writable(obj: &Bound<'_, PyAny>) -> Result<PyRecordBuffer, String> {
        Self::get_with(obj, PYBUF_C_CONTIGUOUS | PYBUF_WRITABLE)
    }

    fn get_with(obj: &Bound<'_, PyAny>, flags: c_int) -> Result<PyRecordBuffer, String> {
        let py = obj.py();
        let mut view = Box::new(RawBuffer {
            buf: std::ptr::null_mut(),
            obj: std::ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: std::ptr::null_mut(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        });
        // SAFETY: the GIL is held (`obj` is bound); `obj` is a live object and `view` a valid,
        // boxed Py_buffer that the call fills.
        if unsafe { PyObject_GetBuffer(obj.as_ptr(), &raw mut *view, flags) } != 0 {
            let err = PyErr::fetch(py);
            let kind = obj
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "object".into());
            return Err(if err.is_instance_of::<PyTypeError>(py) {
                format!("a {kind} does not support the buffer protocol")
            } else if flags & PYBUF_WRITABLE != 0 {
                format!(
                    "buffer of {kind} is not C-contiguous and writable ({})",
                    err.value(py)
                )
            } else {
                format!("buffer of {kind} is not C-contiguous ({})", err.value(py))
            });
        }
        if view.len < 0 || (view.len > 0 && view.buf.is_null()) {
            HeldBuffer(view).release(py);
            return Err("the exporter gave an invalid buffer".into());
        }
        Ok(PyRecordBuffer {
            held: Some(HeldBuffer(view)),
        })
    }
}

impl PyRecordBuffer {
    /// The address and length of the bytes, for callers that check buffers do not overlap.
    pub fn span(&self) -> (usize, usize) {
        match &self.held {
            Some(HeldBuffer(view)) if view.len > 0 => (view.buf as usize, view.len as usize),
            _ => (0, 0),
        }
    }

    /// The bytes of a buffer taken with [`PyRecordBuffer::get_writable`], to write into.
    ///
    /// # Safety
    /// No other slice of the same memory may be in use while the returned one is (the caller
    /// checks that the buffers it writes at once do not overlap, see [`PyRecordBuffer::span`]),
    /// and the buffer must have been taken writable.
    pub unsafe fn bytes_mut(&mut self) -> &mut [u8] {
        let Some(HeldBuffer(view)) = &self.held else {
            return &mut [];
        };
        if view.len == 0 {
            return &mut [];
        }
        // SAFETY: as for `bytes`, the held export keeps the memory alive and in place, C-
        // contiguous from the non-null `buf`; the exporter granted it writable, and the caller
        // promises no other slice of it is in use.
        unsafe { std::slice::from_raw_parts_mut(view.buf.cast::<u8>(), view.len as usize) }
    }
}

impl RecordBuffer for PyRecordBuffer {
    fn bytes(&self) -> &[u8] {
        let Some(HeldBuffer(view)) = &self.held else {
            return &[];
        };
        if view.len == 0 {
            return &[];
        }
        // SAFETY: the buffer is held (not released) for as long as `self` lives, so the exporter
        // keeps its memory alive and in place; it is C-contiguous, so its `len` bytes start at
        // `buf` (checked non-null in `get`). Reading the fields needs no GIL. The caller promised
        // (docs/API.md) not to modify the memory until the record is done.
        unsafe { std::slice::from_raw_parts(view.buf.cast::<u8>(), view.len as usize) }
    }
}

impl Drop for PyRecordBuffer {
    fn drop(&mut self) {
        let Some(held) = self.held.take() else { return };
        // Only short pushes and drains take this lock. A forked child may inherit it locked, so
        // do not wait forever: leaking one export is better than hanging.
        if let Some(mut graveyard) = GRAVEYARD.try_lock_for(Duration::from_secs(1)) {
            graveyard.push(held);
        }
    }
}

/// Releases the buffers the writer's threads dropped. Call with the GIL held.
pub fn drain_graveyard(py: Python<'_>) {
    let dead = match GRAVEYARD.try_lock() {
        Some(mut graveyard) => std::mem::take(&mut *graveyard),
        None => return, // a writer thread is pushing; the next call releases them
    };
    for buffer in dead {
        buffer.release(py);
    }
}
