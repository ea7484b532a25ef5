//! The tables of many tensors at once, for an encoder that counts symbols and packs streams
//! elsewhere (the torch encoder of `layertap.gpu.exphuf`, on the GPU) and leaves the tables to
//! this crate: code lengths from counts, canonical codes from lengths, block heads from lengths
//! and stream lengths. One call a batch, so that the bindings convert once and release the GIL
//! around all of it (a batch of 64 records is about 1,000 tables: milliseconds).

use super::{huffman, write_coded_head, CONTEXTS};
use crate::dtype::Dtype;

/// The code lengths of each table of [`huffman::SYMBOLS`] symbol counts in `counts` (their
/// concatenation), concatenated.
pub fn code_lengths(counts: &[u32]) -> Result<Vec<u8>, String> {
    Ok(whole_tables(counts, "counts")?
        .iter()
        .flat_map(huffman::code_lengths)
        .collect())
}

/// The canonical codes, bit-reversed as the streams send them, of each table of code lengths in
/// `lengths` (each must be a prefix code), concatenated.
pub fn reversed_codes(lengths: &[u8]) -> Result<Vec<u16>, String> {
    let mut out = Vec::with_capacity(lengths.len());
    for (i, table) in whole_tables(lengths, "code lengths")?.iter().enumerate() {
        huffman::check_lengths(table).map_err(|e| format!("table {i}: {e}"))?;
        out.extend_from_slice(&huffman::reversed_codes(table));
    }
    Ok(out)
}

/// `items` as the [`huffman::SYMBOLS`]-entry tables they are the concatenation of, or why not
/// (`what` names the items).
fn whole_tables<'a, T>(items: &'a [T], what: &str) -> Result<&'a [[T; huffman::SYMBOLS]], String> {
    match items.as_chunks() {
        (tables, []) => Ok(tables),
        _ => Err(format!(
            "{} {what} are not a whole number of {}-symbol tables",
            items.len(),
            huffman::SYMBOLS
        )),
    }
}

/// The heads ([`write_coded_head`]) of the coded blocks of `k` tensors of `dtype`: tensor `i`
/// has `strides[i]`, `modes[i]`, the [`CONTEXTS`] tables of `lengths` from `i * CONTEXTS * 512`
/// and the streams of `stream_lens` from `i * streams` (`streams = stream_lens.len() / k`).
pub fn coded_heads(
    dtype: Dtype,
    strides: &[usize],
    modes: &[u8],
    lengths: &[u8],
    stream_lens: &[u64],
) -> Result<Vec<Vec<u8>>, String> {
    let k = strides.len();
    let table_len = CONTEXTS * huffman::SYMBOLS;
    if k == 0
        || modes.len() != k
        || lengths.len() != k * table_len
        || !stream_lens.len().is_multiple_of(k)
    {
        return Err(format!(
            "{k} strides, {} modes, {} code lengths and {} stream lengths do not describe the same \
             tensors ({table_len} code lengths each)",
            modes.len(),
            lengths.len(),
            stream_lens.len()
        ));
    }
    let streams = stream_lens.len() / k;
    (0..k)
        .map(|i| {
            let mut head = Vec::new();
            write_coded_head(
                dtype,
                strides[i],
                modes[i],
                &lengths[i * table_len..(i + 1) * table_len],
                &stream_lens[i * streams..(i + 1) * streams],
                &mut head,
            )
            .map_err(|e| format!("tensor {i}: {e}"))?;
            Ok(head)
        })
        .collect()
}
