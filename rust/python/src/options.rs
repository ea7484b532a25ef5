//! `layertap.WriterOptions`: the core's [`WriterConfig`] as a frozen Python class. The options,
//! their defaults and what each accepts are the core's (`writer/config.rs`, `options.rs`); this
//! module only converts Python values, refusing a value of the wrong type with the core's words
//! ([`refused`]) before the core checks the values themselves (`WriterConfig::validate`).

use crate::errors::{to_py, IntoPyResult};
use layertap_core::fp8::Lossy;
use layertap_core::options::{quoted, refused, Rule};
use layertap_core::writer::{Durability, IoMode, WriterConfig};
use layertap_core::{Codec, Error};
use pyo3::basic::CompareOp;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyDict, PyInt, PyMapping, PyString, PyTuple};
use std::collections::BTreeMap;

/// The options in the order `repr` and `FIELDS` list them (docs/API.md, "Writers").
const FIELDS: [&str; 13] = [
    "codec",
    "level",
    "shard_size",
    "durability",
    "threads",
    "max_inflight_bytes",
    "batch_bytes",
    "writer_id",
    "io",
    "direct",
    "metadata",
    "lossy",
    "key_memory",
];

/// The options of `layertap.ShardWriter`, checked when made: a bad value raises `OptionError`
/// naming the option, an unknown keyword `TypeError`. Keyword arguments only; each one left out
/// takes the core's default. `replace(**changes)` makes a changed copy, checked again.
#[pyclass(frozen, name = "WriterOptions", module = "layertap")]
pub struct PyWriterOptions {
    pub(crate) config: WriterConfig,
}

fn shown(value: &Bound<'_, PyAny>) -> String {
    value
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<unprintable>".into())
}

fn is_int(value: &Bound<'_, PyAny>) -> bool {
    value.is_instance_of::<PyInt>() && !value.is_instance_of::<PyBool>()
}

/// A positive integer below 2**64 (0 is left to `validate`, which says the same).
fn size(option: &'static str, value: &Bound<'_, PyAny>) -> PyResult<u64> {
    let bad = || to_py(refused(option, Rule::Positive, &shown(value)));
    if !is_int(value) {
        return Err(bad());
    }
    value.extract::<u64>().map_err(|_| bad())
}

fn text(option: &'static str, rule: Rule, value: &Bound<'_, PyAny>) -> PyResult<String> {
    value
        .cast::<PyString>()
        .ok()
        .and_then(|s| s.to_str().ok().map(str::to_owned))
        .ok_or_else(|| to_py(refused(option, rule, &shown(value))))
}

fn level(value: &Bound<'_, PyAny>) -> PyResult<i32> {
    if !is_int(value) {
        return Err(to_py(refused("level", Rule::Level, &shown(value))));
    }
    value
        .extract::<i32>()
        .map_err(|_| to_py(refused("level", Rule::Level32, &shown(value))))
}

fn durability(value: &Bound<'_, PyAny>) -> PyResult<Durability> {
    let bad = || to_py(refused("durability", Rule::Durability, &shown(value)));
    if is_int(value) {
        return value
            .extract::<u64>()
            .map(Durability::EveryBytes)
            .map_err(|_| bad());
    }
    match value.cast::<PyString>().ok().and_then(|s| s.to_str().ok()) {
        Some("none") => Ok(Durability::None),
        Some("close") => Ok(Durability::OnClose),
        _ => Err(bad()),
    }
}

fn threads(value: &Bound<'_, PyAny>) -> PyResult<usize> {
    let bad = || to_py(refused("threads", Rule::Threads, &shown(value)));
    if !is_int(value) {
        return Err(bad());
    }
    value.extract::<usize>().map_err(|_| bad())
}

fn codec(value: &Bound<'_, PyAny>) -> PyResult<Codec> {
    Codec::from_name(&text("codec", Rule::Codec, value)?).py_err()
}

fn io(value: &Bound<'_, PyAny>) -> PyResult<IoMode> {
    IoMode::from_name(&text("io", Rule::Io, value)?).py_err()
}

fn lossy(value: &Bound<'_, PyAny>) -> PyResult<Lossy> {
    Lossy::from_name(&text("lossy", Rule::Lossy, value)?).py_err()
}

fn direct(value: &Bound<'_, PyAny>) -> PyResult<bool> {
    value
        .cast::<PyBool>()
        .map(|b| b.is_true())
        .map_err(|_| to_py(refused("direct", Rule::Direct, &shown(value))))
}

/// None, or the value converted.
fn optional<T>(
    value: &Bound<'_, PyAny>,
    convert: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<T>,
) -> PyResult<Option<T>> {
    if value.is_none() {
        Ok(None)
    } else {
        convert(value).map(Some)
    }
}

/// Shard metadata: a mapping of str to str (valid UTF-8); its size is `validate`'s.
fn metadata(value: &Bound<'_, PyAny>) -> PyResult<BTreeMap<String, String>> {
    if value.is_none() {
        return Ok(BTreeMap::new());
    }
    let map = value.cast::<PyMapping>().map_err(|_| {
        let type_name = value
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default();
        to_py(refused("metadata", Rule::Metadata, &type_name))
    })?;
    let mut out = BTreeMap::new();
    for item in map.items()?.iter() {
        let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
        let (Ok(ks), Ok(vs)) = (k.cast::<PyString>(), v.cast::<PyString>()) else {
            return Err(to_py(Error::option(
                "metadata",
                format!(
                    "entry {}: {}: keys and values must be str",
                    shown(&k),
                    shown(&v)
                ),
            )));
        };
        let utf8 = |s: &Bound<'_, PyString>, whole: &Bound<'_, PyAny>| {
            s.to_str().map(str::to_owned).map_err(|_| {
                to_py(Error::option(
                    "metadata",
                    format!(
                        "entry {} is not valid UTF-8 (it holds a lone surrogate)",
                        shown(whole)
                    ),
                ))
            })
        };
        out.insert(utf8(ks, &k)?, utf8(vs, &v)?);
    }
    Ok(out)
}

/// Sets the options `kwargs` names on `config`, converted; the caller validates the whole.
fn apply(config: &mut WriterConfig, kwargs: &Bound<'_, PyDict>) -> PyResult<()> {
    for (name, value) in kwargs.iter() {
        let name: String = name.extract()?;
        let value = &value;
        match name.as_str() {
            "codec" => config.codec = codec(value)?,
            "level" => config.level = level(value)?,
            "shard_size" => config.shard_size = size("shard_size", value)?,
            "durability" => config.durability = durability(value)?,
            "threads" => config.threads = optional(value, threads)?,
            "max_inflight_bytes" => config.max_inflight_bytes = size("max_inflight_bytes", value)?,
            "batch_bytes" => config.batch_bytes = size("batch_bytes", value)?,
            "writer_id" => {
                config.writer_id = optional(value, |v| text("writer_id", Rule::WriterId, v))?;
            }
            "io" => config.io = io(value)?,
            "direct" => config.direct = direct(value)?,
            "metadata" => config.shard_metadata = metadata(value)?,
            "lossy" => config.lossy = optional(value, lossy)?,
            "key_memory" => config.key_memory = optional(value, |v| size("key_memory", v))?,
            other => {
                return Err(PyTypeError::new_err(format!(
                    "WriterOptions() got an unexpected keyword argument {}; the options are: {}",
                    quoted(other),
                    FIELDS.join(", ")
                )))
            }
        }
    }
    config.validate().py_err()
}

static MAPPING_PROXY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

#[pymethods]
impl PyWriterOptions {
    #[new]
    #[pyo3(signature = (**kwargs), text_signature = "(*, codec='bp16-zstd', level=1, \
        shard_size=1073741824, durability='close', threads=None, max_inflight_bytes=1073741824, \
        batch_bytes=8388608, writer_id=None, io='auto', direct=False, metadata={}, lossy=None, \
        key_memory=None)")]
    fn new(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let mut config = WriterConfig::default();
        match kwargs {
            Some(kwargs) => apply(&mut config, kwargs)?,
            None => config.validate().py_err()?,
        }
        Ok(PyWriterOptions { config })
    }

    /// A copy with the options in `changes` changed, checked again.
    #[pyo3(signature = (**changes))]
    fn replace(&self, changes: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let mut config = self.config.clone();
        if let Some(changes) = changes {
            apply(&mut config, changes)?;
        }
        Ok(PyWriterOptions { config })
    }

    /// The options' names, in order.
    #[classattr]
    #[pyo3(name = "FIELDS")]
    fn fields(py: Python<'_>) -> PyResult<Py<PyTuple>> {
        Ok(PyTuple::new(py, FIELDS)?.unbind())
    }

    #[getter]
    fn codec(&self) -> &'static str {
        self.config.codec.name()
    }

    #[getter]
    fn level(&self) -> i32 {
        self.config.level
    }

    #[getter]
    fn shard_size(&self) -> u64 {
        self.config.shard_size
    }

    /// `"none"`, `"close"` or a number of bytes.
    #[getter]
    fn durability<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(match self.config.durability {
            Durability::None => "none".into_pyobject(py)?.into_any(),
            Durability::OnClose => "close".into_pyobject(py)?.into_any(),
            Durability::EveryBytes(n) => n.into_pyobject(py)?.into_any(),
        })
    }

    #[getter]
    fn threads(&self) -> Option<usize> {
        self.config.threads
    }

    #[getter]
    fn max_inflight_bytes(&self) -> u64 {
        self.config.max_inflight_bytes
    }

    #[getter]
    fn batch_bytes(&self) -> u64 {
        self.config.batch_bytes
    }

    #[getter]
    fn writer_id(&self) -> Option<&str> {
        self.config.writer_id.as_deref()
    }

    /// `"auto"`, `"uring"` or `"pwrite"` (`"io_uring"` was taken for `"uring"`).
    #[getter]
    fn io(&self) -> &'static str {
        match self.config.io {
            IoMode::Auto => "auto",
            IoMode::Uring => "uring",
            IoMode::Pwrite => "pwrite",
        }
    }

    #[getter]
    fn direct(&self) -> bool {
        self.config.direct
    }

    /// Read-only (`types.MappingProxyType`), so that no one changes a checked value.
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let proxy = MAPPING_PROXY.get_or_try_init(py, || -> PyResult<_> {
            Ok(py.import("types")?.getattr("MappingProxyType")?.unbind())
        })?;
        proxy.bind(py).call1((self.config.shard_metadata.clone(),))
    }

    #[getter]
    fn lossy(&self) -> Option<&'static str> {
        self.config.lossy.map(Lossy::name)
    }

    #[getter]
    fn key_memory(&self) -> Option<u64> {
        self.config.key_memory
    }

    /// The options as keyword arguments (`WriterOptions(**o.as_dict()) == o`).
    fn as_dict<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(slf.py());
        for name in FIELDS {
            let value = if name == "metadata" {
                // A dict of its own, not the read-only view the getter gives.
                let map = &slf.get().config.shard_metadata;
                map.clone().into_pyobject(slf.py())?.into_any()
            } else {
                slf.getattr(name)?
            };
            out.set_item(name, value)?;
        }
        Ok(out)
    }

    /// Pickles as its keyword arguments (the constructor checks them again on the way back).
    fn __getnewargs_ex__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyTuple>, Bound<'py, PyDict>)> {
        Ok((PyTuple::empty(slf.py()), Self::as_dict(slf)?))
    }

    fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
        let fields = Self::as_dict(slf)?;
        let mut parts = Vec::with_capacity(FIELDS.len());
        for (name, value) in fields.iter() {
            parts.push(format!("{name}={}", shown(&value)));
        }
        Ok(format!("WriterOptions({})", parts.join(", ")))
    }

    fn __richcmp__(&self, other: &Bound<'_, PyAny>, op: CompareOp) -> Py<PyAny> {
        let py = other.py();
        let equal = match other.cast::<PyWriterOptions>() {
            Ok(other) => self.config == other.get().config,
            Err(_) => return py.NotImplemented(),
        };
        match op {
            CompareOp::Eq => PyBool::new(py, equal).to_owned().into_any().unbind(),
            CompareOp::Ne => PyBool::new(py, !equal).to_owned().into_any().unbind(),
            _ => py.NotImplemented(),
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyWriterOptions>()
}
