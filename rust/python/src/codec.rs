//! Codec pieces that other encoders reuse: the torch encoder of exp-huf (`layertap.gpu.exphuf`)
//! builds its code lengths here, and checks its bytes against this encoder's.

use crate::errors::to_py;
use layertap_core::exphuf::{self, huffman};
use layertap_core::Error;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// The exp-huf code lengths (at most 11 bits, 0: absent) of each table of symbol counts:
/// `counts` holds `k * 512` little-endian u32 counts, the result `k * 512` lengths.
#[pyfunction]
fn exphuf_code_lengths<'py>(py: Python<'py>, counts: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    let table_bytes = 4 * huffman::SYMBOLS;
    if !counts.len().is_multiple_of(table_bytes) {
        return Err(to_py(Error::invalid(format!(
            "counts hold {} bytes, not a whole number of {}-symbol u32 tables",
            counts.len(),
            huffman::SYMBOLS
        ))));
    }
    let mut out = Vec::with_capacity(counts.len() / 4);
    for table in counts.chunks_exact(table_bytes) {
        let c: [u32; huffman::SYMBOLS] = std::array::from_fn(|s| {
            u32::from_le_bytes(table[4 * s..4 * s + 4].try_into().expect("4 bytes"))
        });
        out.extend_from_slice(&huffman::code_lengths(&c));
    }
    Ok(PyBytes::new(py, &out))
}

/// The exp-huf payload of the blob `raw` (a safetensors blob), as the writer stores it.
#[pyfunction]
fn exphuf_encode<'py>(py: Python<'py>, raw: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    let mut out = Vec::new();
    py.detach(|| exphuf::encode(&[raw], &mut out))
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
    m.add_function(wrap_pyfunction!(exphuf_encode, m)?)?;
    Ok(())
}
