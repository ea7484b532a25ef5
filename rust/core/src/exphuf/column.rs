//! The column block (docs/FORMAT.md, codec `exp-huf`, block mode 2): its layout, shared by
//! [`column_encode`](super::column_encode) and [`column_decode`](super::column_decode).
//!
//! The tensor is read as `rows x columns` (columns: its last dimension). Each element's top 9
//! bits are sent as a Huffman code in a stream, its low `8W - 9` bits in one plane of their own
//! (packed in element order). A stream holds whole columns, each from its first row to its last,
//! one column after the other; the context of an element is picked by the symbol of the element
//! before it in its stream (the same channel one row back, but at a column's first row the
//! previous column's last). So a stream is a chain in which each code's table follows from the
//! code before it, and a decoder can resolve several codes with one lookup (a table per context
//! whose entries hold up to three symbols and the context after them), where the element-order
//! blocks of mode 1 take a lookup, a context and the raw bits per element. The many short
//! streams (the writer aims at a few thousand elements' worth each) also give a GPU decoder one
//! lane per stream.

use super::block::MAX_CONTEXTS;
use super::huffman::SYMBOLS;

/// Block mode: coded by columns.
pub const MODE_COLUMNS: u8 = 2;
/// Bytes after the mode before the tables: contexts, 3 reserved, columns u32, streams u32, and
/// the context map (a nibble per symbol).
pub const FIXED_LEN: usize = 12 + SYMBOLS / 2;

/// Columns of stream `k` of a block of `columns` columns cut into `streams` streams.
pub fn stream_columns(columns: usize, streams: usize, k: usize) -> std::ops::Range<usize> {
    k * columns / streams..(k + 1) * columns / streams
}

/// The fixed part of a column block after its mode byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    /// Number of contexts (1 to [`MAX_CONTEXTS`]).
    pub contexts: usize,
    /// Elements of a row (the tensor's last dimension); divides the element count.
    pub columns: usize,
    /// Number of streams, 1 to `columns`.
    pub streams: usize,
    /// Context of each symbol.
    pub context_of_symbol: [u8; SYMBOLS],
}

impl Head {
    /// Appends the encoded fixed part.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&[self.contexts as u8, 0, 0, 0]);
        out.extend_from_slice(&(self.columns as u32).to_le_bytes());
        out.extend_from_slice(&(self.streams as u32).to_le_bytes());
        for pair in self.context_of_symbol.chunks(2) {
            out.push(pair[0] | pair[1] << 4);
        }
    }

    /// Parses the fixed part (`FIXED_LEN` bytes) of the block of a tensor of `n` elements.
    pub fn parse(b: &[u8], n: usize) -> Result<Head, String> {
        let contexts = b[0] as usize;
        if !(1..=MAX_CONTEXTS).contains(&contexts) {
            return Err(format!("block has {contexts} contexts (1 to 16 allowed)"));
        }
        if b[1..4] != [0, 0, 0] {
            return Err("block's reserved bytes are not zero".into());
        }
        let columns = u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")) as usize;
        let streams = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")) as usize;
        if columns == 0 || !n.is_multiple_of(columns) {
            return Err(format!(
                "block of {n} elements in rows of {columns} columns"
            ));
        }
        if !(1..=columns).contains(&streams) {
            return Err(format!(
                "block has {streams} streams for {columns} columns (1 to {columns} allowed)"
            ));
        }
        let mut context_of_symbol = [0u8; SYMBOLS];
        for (s, c) in context_of_symbol.iter_mut().enumerate() {
            *c = (b[12 + s / 2] >> (4 * (s % 2))) & 15;
            if *c as usize >= contexts {
                return Err(format!("context map names context {c} of {contexts}"));
            }
        }
        Ok(Head {
            contexts,
            columns,
            streams,
            context_of_symbol,
        })
    }
}

/// Transposes an 8 x 8 block of 16-bit values held as eight rows (SSE2 unpacks): the column
/// transposes of the encoder (rows of elements to columns of tops) and the decoder (back).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse2")]
#[inline]
pub fn transpose8x8(a: [std::arch::x86_64::__m128i; 8]) -> [std::arch::x86_64::__m128i; 8] {
    use std::arch::x86_64::*;
    let t0 = _mm_unpacklo_epi16(a[0], a[1]);
    let t1 = _mm_unpackhi_epi16(a[0], a[1]);
    let t2 = _mm_unpacklo_epi16(a[2], a[3]);
    let t3 = _mm_unpackhi_epi16(a[2], a[3]);
    let t4 = _mm_unpacklo_epi16(a[4], a[5]);
    let t5 = _mm_unpackhi_epi16(a[4], a[5]);
    let t6 = _mm_unpacklo_epi16(a[6], a[7]);
    let t7 = _mm_unpackhi_epi16(a[6], a[7]);
    let u0 = _mm_unpacklo_epi32(t0, t2);
    let u1 = _mm_unpackhi_epi32(t0, t2);
    let u2 = _mm_unpacklo_epi32(t1, t3);
    let u3 = _mm_unpackhi_epi32(t1, t3);
    let u4 = _mm_unpacklo_epi32(t4, t6);
    let u5 = _mm_unpackhi_epi32(t4, t6);
    let u6 = _mm_unpacklo_epi32(t5, t7);
    let u7 = _mm_unpackhi_epi32(t5, t7);
    [
        _mm_unpacklo_epi64(u0, u4),
        _mm_unpackhi_epi64(u0, u4),
        _mm_unpacklo_epi64(u1, u5),
        _mm_unpackhi_epi64(u1, u5),
        _mm_unpacklo_epi64(u2, u6),
        _mm_unpackhi_epi64(u2, u6),
        _mm_unpacklo_epi64(u3, u7),
        _mm_unpackhi_epi64(u3, u7),
    ]
}
