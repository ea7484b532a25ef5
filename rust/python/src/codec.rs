//! Codec pieces that other encoders and decoders reuse: the torch encoder of exp-huf
//! (`layertap.gpu.exphuf`) builds its code lengths, codes and block heads here
//! (`exphuf::tables`, the GIL released around each call), and checks its bytes against this
//! encoder's; the Triton decoder (`layertap.gpu.exphuf_decode`) has a batch's heads parsed here
//! (`exphuf::batch_heads`).

use crate::buffers_in::{drain_graveyard, PyRecordBuffer};
use crate::errors::{batch_problem, to_py};
use layertap_core::exphuf;
use layertap_core::exphuf::batch_heads::{parse_batch, BatchHeads};
use layertap_core::writer::RecordBuffer;
use layertap_core::{Dtype, Error};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict};

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

/// The heads of a batch of exp-huf payloads, for a decoder on another device
/// (`exphuf::batch_heads::parse_batch`, the GIL released): payload `i` is
/// `staged[bases[i]:bases[i] + lengths[i]]` (`staged`: any C-contiguous buffer, the batch as it
/// is copied to the device). Returns a dict of the parsed arrays, each as a `bytearray` of
/// little-endian int64 (uint8 for `lengths` and `context_of_top`), rows of the width the core's
/// types give (`element_lanes_2`, `element_lanes_4`, `column_lanes`: 7; `merges_2`, `merges_4`:
/// 6; `blocks`, `column_blocks`, `plain`: 3; `places`: 2, a tensor's width and start), beside
/// `record_tensors`, `names`, `dtypes`, `shapes`, `metadata` (dicts), `elements` (2 counts),
/// `tops` and `plain_bytes`. Raises `CorruptRecordError` naming the first record that is not a
/// valid exp-huf payload, `InvalidInputError` where a payload lies outside `staged`.
#[pyfunction]
fn exphuf_batch_heads<'py>(
    py: Python<'py>,
    staged: &Bound<'py, PyAny>,
    bases: Vec<u64>,
    lengths: Vec<u64>,
) -> PyResult<Bound<'py, PyDict>> {
    let buffer = PyRecordBuffer::get(staged).map_err(PyTypeError::new_err)?;
    let size = buffer.bytes().len() as u64;
    if bases.len() != lengths.len() {
        return Err(to_py(Error::invalid(format!(
            "{} bases for {} lengths",
            bases.len(),
            lengths.len()
        ))));
    }
    if let Some(i) = (0..bases.len()).find(|&i| bases[i].saturating_add(lengths[i]) > size) {
        return Err(to_py(Error::invalid(format!(
            "payload {i} ({} bytes at {}) lies outside the {size} staged bytes",
            lengths[i], bases[i]
        ))));
    }
    let parsed = py.detach(|| {
        let bytes = buffer.bytes();
        let payloads: Vec<(&[u8], u64)> = bases
            .iter()
            .zip(&lengths)
            .map(|(&b, &n)| (&bytes[b as usize..(b + n) as usize], b))
            .collect();
        let parsed = parse_batch(&payloads).map(|heads| {
            let arrays = Arrays::of(&heads);
            (heads, arrays)
        });
        drop(buffer); // to the graveyard, released below with the GIL
        parsed
    });
    drain_graveyard(py);
    let (heads, arrays) = parsed.map_err(batch_problem)?;
    let d = PyDict::new(py);
    for (name, bytes) in arrays.0 {
        d.set_item(name, PyByteArray::new(py, &bytes))?;
    }
    let names: Vec<&str> = heads.tensors.iter().map(|t| t.name.as_str()).collect();
    let dtypes: Vec<&str> = heads.tensors.iter().map(|t| t.dtype.name()).collect();
    let shapes: Vec<&[u64]> = heads.tensors.iter().map(|t| t.shape.as_slice()).collect();
    d.set_item("names", names)?;
    d.set_item("dtypes", dtypes)?;
    d.set_item("shapes", shapes)?;
    d.set_item("metadata", &heads.metadata)?;
    d.set_item("elements", heads.elements)?;
    d.set_item("tops", heads.tops)?;
    d.set_item("plain_bytes", heads.plain_bytes)?;
    Ok(d)
}

/// The array fields of [`BatchHeads`] as the bytes of their rows, by name.
struct Arrays(Vec<(&'static str, Vec<u8>)>);

impl Arrays {
    fn of(h: &BatchHeads) -> Arrays {
        fn ints(xs: impl ExactSizeIterator<Item = i64>) -> Vec<u8> {
            let mut out = Vec::with_capacity(8 * xs.len());
            for x in xs {
                out.extend_from_slice(&x.to_le_bytes());
            }
            out
        }
        fn rows<const N: usize>(rows: &[[i64; N]]) -> Vec<u8> {
            ints(rows.as_flattened().iter().copied())
        }
        let tensors = &h.tensors;
        let places: Vec<[i64; 2]> = tensors
            .iter()
            .map(|t| [t.width as i64, t.start as i64])
            .collect();
        let blocks: Vec<[i64; 3]> = h
            .blocks
            .iter()
            .map(|b| [b.tensor, b.first_table, b.contexts].map(|x| x as i64))
            .collect();
        Arrays(vec![
            (
                "record_tensors",
                ints(h.record_tensors.iter().map(|&x| x as i64)),
            ),
            ("places", rows(&places)),
            ("lengths", h.lengths.as_flattened().to_vec()),
            ("blocks", rows(&blocks)),
            (
                "context_of_top",
                h.blocks.iter().flat_map(|b| b.context_of_top).collect(),
            ),
            ("element_lanes_2", rows(&h.element_lanes[0])),
            ("element_lanes_4", rows(&h.element_lanes[1])),
            ("column_lanes", rows(&h.column_lanes)),
            ("column_blocks", rows(&h.column_blocks)),
            ("merges_2", rows(&h.merges[0])),
            ("merges_4", rows(&h.merges[1])),
            ("plain", rows(&h.plain)),
        ])
    }
}

/// Adds this module's functions to `layertap._native`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(exphuf_code_lengths, m)?)?;
    m.add_function(wrap_pyfunction!(exphuf_reversed_codes, m)?)?;
    m.add_function(wrap_pyfunction!(exphuf_coded_heads, m)?)?;
    m.add_function(wrap_pyfunction!(exphuf_encode, m)?)?;
    m.add_function(wrap_pyfunction!(exphuf_batch_heads, m)?)?;
    Ok(())
}
