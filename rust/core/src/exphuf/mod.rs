//! Codec `exp-huf` (docs/FORMAT.md, "Codec 3"): the record's safetensors header as it is, then
//! each tensor in data order, floating tensors (`BF16`, `F16`, `F32`) as a coded block and the
//! others as they are.
//!
//! A coded block sends each element as a Huffman code of its top 9 bits (sign and exponent for
//! bf16 and f32; sign, exponent and 3 mantissa bits for f16) followed by its other bits
//! unchanged: in activations the exponent holds nearly all the redundancy, and the mantissa
//! bits are close to random, so no match finding is spent on them. The code table is chosen by
//! the same channel's element one row back, which predicts sign and exponent. Two layouts:
//! mode 1 in element order, codes and raw bits together (`block.rs`, what the GPU encoder
//! writes), and mode 2 by column, the raw bits in a plane of their own (`column.rs`, what the
//! writer writes, which decodes several codes a lookup).

pub mod batch_heads;
mod block;
mod block_decode;
#[cfg(test)]
mod block_decode_reference;
mod block_encode;
mod column;
mod column_decode;
#[cfg(test)]
mod column_decode_reference;
mod column_encode;
#[cfg(test)]
mod column_encode_reference;
pub mod huffman;
pub mod tables;

use crate::blob;
use crate::dtype::Dtype;

/// Contexts of a coded block as this crate's encoder writes them (each with a table of
/// [`huffman::SYMBOLS`] code lengths): what [`write_coded_head`] takes.
pub const CONTEXTS: usize = block::MAX_CONTEXTS;

/// A payload decodes to at most this many times its stored length: a coded element takes at
/// least 9 of its 16 bits (f32: 24 of 32) and everything else is stored as it is.
pub const MAX_RATIO: u64 = 2;

/// Element width in bytes of the dtypes that are coded, and how many of the 8 bits after the
/// sign are mantissa (the encoder's contexts follow the exponent).
fn coded(dtype: Dtype) -> Option<(usize, u32)> {
    match dtype {
        Dtype::BF16 => Some((2, 0)),
        Dtype::F16 => Some((2, 3)),
        Dtype::F32 => Some((4, 0)),
        _ => None,
    }
}

/// Whether exp-huf codes tensors of `dtype` in blocks (the others it stores as they are).
pub fn is_coded(dtype: Dtype) -> bool {
    coded(dtype).is_some()
}

/// Checks the framing of a block given already encoded for a tensor of `elements` elements of
/// `dtype` (a coded dtype): its mode, head, code-length tables (a prefix code each) and stream
/// lengths, and that the block ends where its last stream does. The streams themselves are
/// not decoded (a reader does that, and rejects a bad one): this costs a few hundred bytes'
/// reading, not a decode, and catches a block cut short or padded, or written for another
/// tensor's size. `Err` says what is wrong.
pub fn check_block(block: &[u8], dtype: Dtype, elements: usize) -> Result<(), String> {
    let (w, _) = coded(dtype).ok_or_else(|| format!("{dtype:?} is not coded in blocks"))?;
    let mode = *block.first().ok_or("block is empty")?;
    match mode {
        block::MODE_RAW => {
            let want = 1 + elements * w;
            if block.len() != want {
                return Err(format!(
                    "raw block of {} bytes for {elements} elements of {w} bytes (needs {want})",
                    block.len()
                ));
            }
            Ok(())
        }
        block::MODE_CODED => {
            let fixed = block
                .get(1..1 + block::FIXED_LEN)
                .ok_or("block is cut off")?;
            let head = block::Head::parse(fixed)?;
            let mut at = 1 + block::FIXED_LEN;
            for c in 0..head.contexts {
                let lengths = block::parse_lengths(block, &mut at)
                    .map_err(|e| format!("context {c}: {e}"))?;
                huffman::check_lengths(&lengths).map_err(|e| format!("context {c}: {e}"))?;
            }
            let lens = block
                .get(at..at + 8 * head.streams)
                .ok_or("block is cut off")?;
            at += 8 * head.streams;
            let mut total = 0u64;
            for (k, len) in lens.chunks_exact(8).enumerate() {
                let len = u64::from_le_bytes(len.try_into().expect("8 bytes"));
                // Every element of a segment takes at least its raw bits and at most max_bits.
                let n = block::segment(elements, head.streams, k).len() as u64;
                let (lo, hi) = match w {
                    2 => (block::raw_bits::<2>(), block::max_bits::<2>()),
                    _ => (block::raw_bits::<4>(), block::max_bits::<4>()),
                };
                let (lo, hi) = (
                    (n * (lo as u64 + 1)).div_ceil(8),
                    (n * hi as u64).div_ceil(8),
                );
                if len < lo || len > hi {
                    return Err(format!(
                        "stream {k} of {len} bytes for {n} elements (they take {lo} to {hi})"
                    ));
                }
                total += len;
            }
            let rest = (block.len() - at) as u64;
            if rest != total {
                return Err(format!(
                    "block holds {rest} bytes of streams; its stream lengths add up to {total}"
                ));
            }
            Ok(())
        }
        column::MODE_COLUMNS => check_column_block(block, w, elements),
        m => Err(format!("block mode {m} is unknown")),
    }
}

/// [`check_block`] of a column block (mode 2) of `elements` elements of `w` bytes.
fn check_column_block(block: &[u8], w: usize, elements: usize) -> Result<(), String> {
    let fixed = block
        .get(1..1 + column::FIXED_LEN)
        .ok_or("block is cut off")?;
    let head = column::Head::parse(fixed, elements)?;
    let mut at = 1 + column::FIXED_LEN;
    for c in 0..head.contexts {
        let lengths =
            block::parse_lengths(block, &mut at).map_err(|e| format!("context {c}: {e}"))?;
        huffman::check_lengths(&lengths).map_err(|e| format!("context {c}: {e}"))?;
    }
    let lens = block
        .get(at..at + 8 * head.streams)
        .ok_or("block is cut off")?;
    at += 8 * head.streams;
    let raw = if w == 2 {
        block::raw_bits::<2>()
    } else {
        block::raw_bits::<4>()
    };
    let plane = (elements as u64 * raw as u64).div_ceil(8);
    let rows = (elements / head.columns) as u64;
    let mut total = plane;
    for (k, len) in lens.chunks_exact(8).enumerate() {
        let len = u64::from_le_bytes(len.try_into().expect("8 bytes"));
        // Every code takes 1 to MAX_CODE_LEN bits.
        let n = column::stream_columns(head.columns, head.streams, k).len() as u64 * rows;
        let (lo, hi) = (
            n.div_ceil(8),
            (n * huffman::MAX_CODE_LEN as u64).div_ceil(8),
        );
        if len < lo || len > hi {
            return Err(format!(
                "stream {k} of {len} bytes for {n} elements (they take {lo} to {hi})"
            ));
        }
        total += len;
    }
    let rest = (block.len() - at) as u64;
    if rest != total {
        return Err(format!(
            "block holds {rest} bytes of raw plane and streams; its plane and stream lengths add up to {total}"
        ));
    }
    Ok(())
}

/// Appends the head of a coded block whose streams another encoder made (the torch encoder of
/// `layertap.gpu.exphuf`, which counts and packs on the GPU and leaves the tables to this one):
/// everything before the streams, as this crate's encoder writes it. `mode` is the most common
/// exponent of the encoder's sample (it sets the context map), `lengths` the code lengths of
/// each of [`CONTEXTS`] contexts (`16 * 512`, indexed by context, then
/// symbol), `stream_lens` the streams' byte lengths (1, 2, 4 or 8 of them). `Err` says what is
/// wrong with them (a table that is not a prefix code, a stream count the format lacks).
pub fn write_coded_head(
    dtype: Dtype,
    stride: usize,
    mode: u8,
    lengths: &[u8],
    stream_lens: &[u64],
    out: &mut Vec<u8>,
) -> Result<(), String> {
    let (_, exp_shift) = coded(dtype).ok_or_else(|| format!("{dtype:?} is not coded in blocks"))?;
    if !block::STREAM_COUNTS.contains(&stream_lens.len()) {
        return Err(format!(
            "{} streams (1, 2, 4 or 8 allowed)",
            stream_lens.len()
        ));
    }
    let tables = match lengths.as_chunks::<{ huffman::SYMBOLS }>() {
        (tables, []) if tables.len() == block::MAX_CONTEXTS => tables,
        _ => {
            return Err(format!(
                "{} code lengths, not {} contexts of {}",
                lengths.len(),
                block::MAX_CONTEXTS,
                huffman::SYMBOLS
            ))
        }
    };
    for (c, table) in tables.iter().enumerate() {
        huffman::check_lengths(table).map_err(|e| format!("context {c}: {e}"))?;
    }
    let ctx_of_top = block_encode::context_map(mode, exp_shift);
    block_encode::write_head(stride, stream_lens.len(), &ctx_of_top, tables, out);
    let lens_at = out.len() - 8 * stream_lens.len();
    for (k, len) in stream_lens.iter().enumerate() {
        out[lens_at + 8 * k..lens_at + 8 * k + 8].copy_from_slice(&len.to_le_bytes());
    }
    Ok(())
}

/// The bytes `range` of the concatenation of `pieces`: borrowed when one piece holds them all,
/// else copied into `scratch`.
fn gather<'a>(
    pieces: &[&'a [u8]],
    range: std::ops::Range<usize>,
    scratch: &'a mut Vec<u8>,
) -> &'a [u8] {
    let mut at = 0;
    scratch.clear();
    for p in pieces {
        let (start, end) = (at, at + p.len());
        at = end;
        if end <= range.start || start >= range.end {
            continue;
        }
        let part = &p[range.start.max(start) - start..range.end.min(end) - start];
        if part.len() == range.len() {
            return part;
        }
        scratch.extend_from_slice(part);
    }
    scratch
}

/// Capacity of an output buffer that [`encode`] does not grow for a blob of `total` bytes of a
/// few tensors: `encode` reserves room for every coded element at its longest, `max_bits` (bf16
/// 18 of its 16 bits, the most of any dtype; f32 34 of 32), and each tensor adds its tables.
pub fn out_capacity(total: usize) -> usize {
    total / 16 * block::max_bits::<2>() as usize + (64 << 10)
}

pub use block_encode::Layout;

/// Encodes a blob given as pieces (any split; the writers give the header, then each tensor's
/// bytes) into `out` (cleared first), its blocks coded by column. `Err` says why the pieces are
/// not a blob.
pub fn encode(pieces: &[&[u8]], out: &mut Vec<u8>) -> Result<(), String> {
    encode_as(pieces, Layout::ByColumn, out)
}

/// [`encode`] with the coded blocks laid out as `layout` says.
pub fn encode_as(pieces: &[&[u8]], layout: Layout, out: &mut Vec<u8>) -> Result<(), String> {
    out.clear();
    let total: usize = pieces.iter().map(|p| p.len()).sum();
    let mut scratch = Vec::new();
    let prefix = gather(pieces, 0..8.min(total), &mut scratch);
    if prefix.len() < 8 {
        return Err("blob shorter than a safetensors header".into());
    }
    let n = u64::from_le_bytes(prefix.try_into().expect("8 bytes"));
    if n > blob::MAX_HEADER_LEN as u64 || 8 + n > total as u64 {
        return Err(format!(
            "safetensors header length {n} does not fit the blob"
        ));
    }
    let head = gather(pieces, 0..8 + n as usize, &mut scratch).to_vec();
    let header = blob::parse_header_of(&head, total)?;
    out.reserve(total / 2 + head.len());
    out.extend_from_slice(&head);
    for t in &header.tensors {
        let data = gather(pieces, t.range.clone(), &mut scratch);
        match coded(t.spec.dtype) {
            Some((w, exp_shift)) => {
                let stride = match t.spec.shape.as_slice() {
                    [.., _, last] => *last as usize,
                    _ => 0,
                };
                let plan = block_encode::Plan { stride, exp_shift };
                if w == 2 {
                    block_encode::encode::<2>(data, &plan, layout, out);
                } else {
                    block_encode::encode::<4>(data, &plan, layout, out);
                }
            }
            None => out.extend_from_slice(data),
        }
    }
    Ok(())
}

/// Decodes a stored payload into the blob of `raw_len` bytes. `Err` says what is wrong.
pub fn decode(stored: &[u8], raw_len: u64) -> Result<Vec<u8>, String> {
    let (header, head_len) = parse_head(stored, raw_len)?;
    let mut out = vec![0u8; raw_len as usize];
    out[..head_len].copy_from_slice(&stored[..head_len]);
    let mut at = head_len;
    for t in &header.tensors {
        decode_tensor(stored, &mut at, t, &mut out[t.range.clone()], 1)?;
    }
    check_end(stored, at)?;
    Ok(out)
}

/// The blob's header of a stored payload (stored as it is, before the tensors' blocks), parsed
/// for a blob of `raw_len` bytes, and its length (where the first tensor's block starts).
pub fn parse_head(stored: &[u8], raw_len: u64) -> Result<(blob::BlobHeader, usize), String> {
    if raw_len > MAX_RATIO * stored.len() as u64 {
        return Err(format!(
            "raw length {raw_len} is more than {} stored bytes can decode to",
            stored.len()
        ));
    }
    let raw_len = raw_len as usize;
    if stored.len() < 8 {
        return Err("payload shorter than a safetensors header".into());
    }
    let n = u64::from_le_bytes(stored[..8].try_into().expect("8 bytes"));
    if n > blob::MAX_HEADER_LEN as u64 || 8 + n > stored.len().min(raw_len) as u64 {
        return Err(format!(
            "safetensors header length {n} does not fit the payload"
        ));
    }
    let head_len = 8 + n as usize;
    Ok((
        blob::parse_header_of(&stored[..head_len], raw_len)?,
        head_len,
    ))
}

/// Decodes tensor `t`, whose stored form starts at `*at` of `stored`, into `dst` (its
/// `t.range.len()` bytes; tensors come in the header's order, the first at the end of the
/// head), and moves `*at` past it; a large block on up to `threads` threads (the caller's among
/// them).
pub fn decode_tensor(
    stored: &[u8],
    at: &mut usize,
    t: &blob::TensorInfo,
    dst: &mut [u8],
    threads: usize,
) -> Result<(), String> {
    match coded(t.spec.dtype) {
        Some((2, _)) => block_decode::decode::<2>(stored, at, dst, threads),
        Some(_) => block_decode::decode::<4>(stored, at, dst, threads),
        None => match stored.get(*at..*at + dst.len()) {
            Some(src) => {
                dst.copy_from_slice(src);
                *at += dst.len();
                Ok(())
            }
            None => Err("payload is cut off".to_string()),
        },
    }
    .map_err(|e| format!("tensor {:?}: {e}", t.spec.name))
}

/// `Err` unless the last tensor's block ended at `at`, the payload's end.
pub fn check_end(stored: &[u8], at: usize) -> Result<(), String> {
    if at != stored.len() {
        return Err(format!(
            "{} bytes after the last tensor's block",
            stored.len() - at
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
