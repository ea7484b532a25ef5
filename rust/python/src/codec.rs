//! Codec pieces that other encoders reuse: the torch encoder of exp-huf (`layertap.gpu.exphuf`)
//! builds its code lengths, codes and block heads here (`exphuf::tables`, the GIL released
//! around each call), and checks its bytes against this encoder's.

use crate::errors::to_py;
use layertap_core::exphuf;
use layertap_core::{Dtype, Error};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// The exp-huf code lengths (at most 11 bits, 0: absent) of each table of symbol counts:
/// `counts` holds `k * 512` little-endian u32 counts, the result `k * 512` lengths.
#[pyfunction]
fn exphuf_code_lengths<'py>(py: Python<'py>, counts: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    if !counts.len().is_multiple_of(4) {
        return Err(to_py(Error::invalid(format!(
            "counts hold {} bytes, not a whole number of u32 counts",
            counts.len()
        ))));
    }
    let lengths = py
        .detach(|| {
            let counts: Vec<u32> = counts
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect();
            exphuf::tables::code_lengths(&counts)
        })
        .map_err(|e| to_py(Error::invalid(e)))?;
    Ok(PyBytes::new(py, &lengths))
}

/// The canonical codes, bit-reversed (as the streams send them), of each table of code lengths:
/// `lengths` holds `k * 512` lengths, the result `k * 512` little-endian u16 codes.
#[pyfunction]
fn exphuf_reversed_codes<'py>(py: Python<'py>, lengths: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    let codes = py
        .detach(|| {
            exphuf::tables::reversed_codes(lengths).map(|codes| {
                codes
                    .iter()
                    .flat_map(|c| c.to_le_bytes())
                    .collect::<Vec<u8>>()
            })
        })
        .map_err(|e| to_py(Error::invalid(e)))?;
    Ok(PyBytes::new(py, &codes))
}

/// The heads (everything before the streams) of coded blocks of `dtype` whose streams another
/// encoder made, one per tensor: `strides[i]`, `modes[i]` (the sample's most common exponent),
/// `lengths` (`k * 16 * 512` code lengths) and `stream_lens` (`k * streams` byte lengths).
#[pyfunction]
fn exphuf_coded_heads<'py>(
    py: Python<'py>,
    dtype: &str,
    strides: Vec<usize>,
    modes: Vec<u8>,
    lengths: &[u8],
    stream_lens: Vec<u64>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let dtype = Dtype::from_name(dtype).map_err(to_py)?;
    let heads = py
        .detach(|| exphuf::tables::coded_heads(dtype, &strides, &modes, lengths, &stream_lens))
        .map_err(|e| to_py(Error::invalid(e)))?;
    Ok(heads.iter().map(|h| PyBytes::new(py, h)).collect())
}

/// The exp-huf payload of the blob `raw` (a safetensors blob), as the writer stores it
/// (`by="column"`, block mode 2), or with its blocks in element order as the GPU encoder writes
/// them (`by="element"`, mode 1).
#[pyfunction]
#[pyo3(signature = (raw, by = "column"))]
fn exphuf_encode<'py>(py: Python<'py>, raw: &[u8], by: &str) -> PyResult<Bound<'py, PyBytes>> {
    let layout = match by {
        "column" => exphuf::Layout::ByColumn,
        "element" => exphuf::Layout::ByElement,
        _ => {
            return Err(to_py(Error::invalid(format!(
                "by={by:?} is not a block layout; use \"column\" or \"element\""
            ))))
        }
    };
    let mut out = Vec::new();
    py.detach(|| exphuf::encode_as(&[raw], layout, &mut out))
        .map_err(|e| {
            to_py(Error::invalid(format!(
                "not a blob exp-huf can encode: {e}"
            )))
        })?;
    Ok(PyBytes::new(py, &out))
}

/// Adds this module's functions to `layertap._native`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(exphuf_code_lengths, m)?)?;
    m.add_function(wrap_pyfunction!(exphuf_reversed_codes, m)?)?;
    m.add_function(wrap_pyfunction!(exphuf_coded_heads, m)?)?;
    m.add_function(wrap_pyfunction!(exphuf_encode, m)?)?;
    Ok(())
}
