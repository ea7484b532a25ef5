//! Maps the core's [`Error`] to the exception classes of `layertap.errors`, with their details
//! as attributes. The classes are defined in Python so that the pure-Python implementation
//! raises the very same ones.

use layertap_core::Error;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

static ERRORS_MODULE: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

fn class<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyType>> {
    let module = ERRORS_MODULE.get_or_try_init(py, || -> PyResult<_> {
        Ok(py.import("layertap.errors")?.unbind())
    })?;
    Ok(module.bind(py).getattr(name)?.cast_into::<PyType>()?)
}

fn build(py: Python<'_>, e: Error) -> PyResult<PyErr> {
    let msg = e.to_string();
    let exc = match &e {
        Error::InvalidInput(_) => class(py, "InvalidInputError")?.call1((msg,))?,
        Error::InvalidOption { option, problem } => {
            class(py, "OptionError")?.call1((*option, problem.as_str()))?
        }
        Error::DuplicateKey { key } => class(py, "DuplicateKeyError")?.call1((msg, key))?,
        Error::NotAShard { path, .. } | Error::CorruptIndex { path, .. } => {
            class(py, "FormatError")?.call1((msg, path.display().to_string()))?
        }
        Error::CorruptRecord {
            path, offset, key, ..
        } => class(py, "CorruptRecordError")?.call1((
            msg,
            path.display().to_string(),
            *offset,
            key.clone(),
        ))?,
        Error::NotFound(_) => class(py, "RecordNotFoundError")?.call1((msg,))?,
        Error::Io { path, source, .. } => class(py, "WriterIOError")?.call1((
            source.raw_os_error(),
            msg,
            path.display().to_string(),
        ))?,
        Error::DiskFull {
            dir,
            path,
            free_bytes,
            source,
            ..
        } => class(py, "DiskFullError")?.call1((
            source.raw_os_error(),
            msg,
            path.display().to_string(),
            dir.display().to_string(),
            *free_bytes,
        ))?,
        Error::Locked { path } => {
            class(py, "ShardLockedError")?.call1((msg, path.display().to_string()))?
        }
        Error::Closed(_) => class(py, "WriterClosedError")?.call1((msg,))?,
        Error::Codec { codec, reason } => {
            class(py, "CodecError")?.call1((msg.as_str(), *codec, reason.as_str()))?
        }
    };
    Ok(PyErr::from_value(exc))
}

/// Converts a core error into the matching Python exception.
pub fn to_py(e: Error) -> PyErr {
    Python::attach(|py| build(py, e).unwrap_or_else(|import_failed| import_failed))
}

/// A record of a batch that is not a valid exp-huf payload (the device decoder's parse,
/// `exphuf::batch_heads`): a `CorruptRecordError` whose message names the record of the batch,
/// without a shard or offset (the caller knows where its records come from).
pub fn batch_problem(e: layertap_core::exphuf::batch_heads::BatchProblem) -> PyErr {
    Python::attach(|py| {
        class(py, "CorruptRecordError")
            .and_then(|c| c.call1((e.to_string(),)))
            .map_or_else(|import_failed| import_failed, PyErr::from_value)
    })
}

/// `.map_err(to_py)` as a trait, for `?` on core results.
pub trait IntoPyResult<T> {
    /// Maps the error to its Python exception.
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for layertap_core::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
