//! The encoder of a column block (layout in [`column`](super::column)): the tops of the
//! elements in stream order (a transpose), each context's symbol counts along the streams, the
//! codes, the plane of raw bits, then the streams one after the other.

use super::block::{raw_bits, symbol_of_top, top, top_of_symbol, value, MAX_CONTEXTS};
use super::block_encode::Bits;
use super::column::{stream_columns, Head, MODE_COLUMNS};
use super::huffman::{self, MAX_CODE_LEN, SYMBOLS};

/// Elements the writer puts in a stream, about: enough that a stream's length field and its
/// last byte's padding cost nothing, few enough that a GPU gives each stream a lane.
pub const ELEMENTS_PER_STREAM: usize = 8192;
/// Entries of the encoder's tables: one per context and top-9 value.
const ENC_LEN: usize = MAX_CONTEXTS * SYMBOLS;

/// The streams the writer cuts a block of `n` elements in rows of `columns` into: one per
/// [`ELEMENTS_PER_STREAM`] rounded down to a multiple of 4, and at least 4 where there are as
/// many columns, so that a CPU decodes every stream four side by side (one stream alone is a
/// chain of dependent lookups; 3 more stream lengths cost 24 bytes).
pub fn streams_for(n: usize, columns: usize) -> usize {
    (n / ELEMENTS_PER_STREAM / 4 * 4).clamp(4.min(columns), columns)
}

/// The tops (top 9 bits) of `data`'s `W`-byte elements, `rows x columns` in row order, into
/// `tops` in column order: `tops[c * rows + r]` is row `r`'s element of column `c`. In tiles,
/// so that both sides are read and written a cache line at a time.
pub(crate) fn tops_by_column<const W: usize>(data: &[u8], columns: usize, tops: &mut Vec<u16>) {
    const TILE: usize = 32;
    let n = data.len() / W;
    let rows = n / columns;
    tops.clear();
    tops.resize(n, 0);
    #[cfg(target_arch = "x86_64")]
    if W == 2 {
        tops_by_column_sse2(data, columns, tops);
        return;
    }
    for r0 in (0..rows).step_by(TILE) {
        let r1 = (r0 + TILE).min(rows);
        for c0 in (0..columns).step_by(TILE) {
            let c1 = (c0 + TILE).min(columns);
            for c in c0..c1 {
                let col = &mut tops[c * rows..(c + 1) * rows];
                for (r, t) in col.iter_mut().enumerate().take(r1).skip(r0) {
                    let i = (r * columns + c) * W;
                    *t = top::<W>(&data[i..i + W]) as u16;
                }
            }
        }
    }
}

/// [`tops_by_column`] for 2-byte elements: 8 x 8 blocks transposed in SSE2 registers, rows of
/// 8 at a time over the whole width (so that the rows are read in order).
#[cfg(target_arch = "x86_64")]
fn tops_by_column_sse2(data: &[u8], columns: usize, tops: &mut [u16]) {
    use super::column::transpose8x8;
    use std::arch::x86_64::*;
    let n = data.len() / 2;
    let rows = n / columns;
    let (rows8, cols8) = (rows / 8 * 8, columns / 8 * 8);
    let top_at = |r: usize, c: usize| top::<2>(&data[2 * (r * columns + c)..]) as u16;
    for r0 in (0..rows8).step_by(8) {
        for c0 in (0..cols8).step_by(8) {
            // SAFETY: SSE2 is part of x86_64; every load reads the 16 bytes of an 8-element
            // slice of `data` and every store writes those of an 8-element slice of `tops`,
            // both bounds checked when taken.
            unsafe {
                let a: [__m128i; 8] = std::array::from_fn(|i| {
                    let row =
                        &data[2 * ((r0 + i) * columns + c0)..2 * ((r0 + i) * columns + c0 + 8)];
                    _mm_srli_epi16::<7>(_mm_loadu_si128(row.as_ptr().cast()))
                });
                let cols_of = transpose8x8(a);
                for (j, v) in cols_of.into_iter().enumerate() {
                    let col = &mut tops[(c0 + j) * rows + r0..(c0 + j) * rows + r0 + 8];
                    _mm_storeu_si128(col.as_mut_ptr().cast(), v);
                }
            }
        }
    }
    for r in 0..rows8 {
        for c in cols8..columns {
            tops[c * rows + r] = top_at(r, c);
        }
    }
    for r in rows8..rows {
        for c in 0..columns {
            tops[c * rows + r] = top_at(r, c);
        }
    }
}

/// Appends the column block of `data` (`W`-byte elements in rows of `columns`, which divides
/// their count) in `streams` streams, mode byte included, with the context map `ctx_of_top`
/// (indexed by top-9 value).
pub fn encode<const W: usize>(
    data: &[u8],
    columns: usize,
    streams: usize,
    ctx_of_top: &[u8; SYMBOLS],
    out: &mut Vec<u8>,
) {
    let n = data.len() / W;
    let rows = n / columns;
    debug_assert!(n > 0 && n.is_multiple_of(columns) && (1..=columns).contains(&streams));
    let mut tops = Vec::new();
    tops_by_column::<W>(data, columns, &mut tops);
    let ctx_off: [u16; SYMBOLS] = std::array::from_fn(|t| ctx_of_top[t] as u16 * SYMBOLS as u16);

    // Counts per (context, top): the first element of a stream has context 0, every other one
    // the context of the top before it. Each top is replaced by its index in the tables,
    // `ctx_off[top before] + top`, which the streams' coding then takes as it is; from the end
    // of a stream backwards, so that the top before is still there.
    let mut hist = vec![0u32; ENC_LEN];
    for k in 0..streams {
        let cols = stream_columns(columns, streams, k);
        let seq = &mut tops[cols.start * rows..cols.end * rows];
        for j in (1..seq.len()).rev() {
            let at =
                (ctx_off[seq[j - 1] as usize & (SYMBOLS - 1)] + seq[j]) as usize & (ENC_LEN - 1);
            seq[j] = at as u16;
            hist[at] += 1;
        }
        hist[seq[0] as usize & (SYMBOLS - 1)] += 1;
    }

    // Codes per context; the encoding table holds `reversed code | length << 16`, indexed like
    // the histogram.
    let mut lengths = vec![[0u8; SYMBOLS]; MAX_CONTEXTS];
    let mut table = vec![0u32; ENC_LEN];
    for (c, l) in lengths.iter_mut().enumerate() {
        let counts: [u32; SYMBOLS] = std::array::from_fn(|s| hist[c * SYMBOLS + top_of_symbol(s)]);
        *l = huffman::code_lengths(&counts);
        let codes = huffman::reversed_codes(l);
        for t in 0..SYMBOLS {
            let s = symbol_of_top(t);
            table[c * SYMBOLS + t] = codes[s] as u32 | (l[s] as u32) << 16;
        }
    }

    out.push(MODE_COLUMNS);
    Head {
        contexts: MAX_CONTEXTS,
        columns,
        streams,
        context_of_symbol: std::array::from_fn(|s| ctx_of_top[top_of_symbol(s)]),
    }
    .write(out);
    for l in &lengths {
        super::block::write_lengths(l, out);
    }
    let lens_at = out.len();
    out.resize(out.len() + 8 * streams, 0);
    raw_plane::<W>(data, out);
    out.reserve((n * MAX_CODE_LEN as usize).div_ceil(8) + 8 * streams);
    for k in 0..streams {
        let cols = stream_columns(columns, streams, k);
        let start = out.len();
        encode_stream(&tops[cols.start * rows..cols.end * rows], &table, out);
        let len = (out.len() - start) as u64;
        out[lens_at + 8 * k..lens_at + 8 * k + 8].copy_from_slice(&len.to_le_bytes());
    }
}

/// Appends the raw plane: each element's low `8W - 9` bits in element order, least significant
/// bit first, zero bits to the byte.
fn raw_plane<const W: usize>(data: &[u8], out: &mut Vec<u8>) {
    let r = raw_bits::<W>();
    let mask = (1u64 << r) - 1;
    let n = data.len() / W;
    let most = (n * r as usize).div_ceil(8);
    out.reserve(most + 8);
    let group = (57 / r) as usize;
    let mut bits = Bits {
        dst: out.spare_capacity_mut().as_mut_ptr().cast::<u8>(),
        pos: 0,
        acc: 0,
        nbits: 0,
    };
    // Each store is safe: `group` puts of `r` bits follow at most 7 bits held, so at most 64
    // are held, and the elements put so far take at most `most` bytes, within the `most + 8`
    // reserved above.
    let groups = data.chunks_exact(group * W);
    let rest = groups.remainder();
    for g in groups {
        if W == 2 {
            // 8 elements' 7 bits: 56 bits at once.
            bits.put(pack_low7(g.try_into().expect("16 bytes")), 56);
        } else {
            for x in g.chunks_exact(W) {
                bits.put(value::<W>(x) as u64 & mask, r);
            }
        }
        // SAFETY: see above.
        unsafe { bits.store() };
    }
    for x in rest.chunks_exact(W) {
        bits.put(value::<W>(x) as u64 & mask, r);
        // SAFETY: see above.
        unsafe { bits.store() };
    }
    let len = bits.pos + (bits.nbits > 0) as usize;
    assert!(len <= most);
    // SAFETY: the stores above wrote every byte below `len` (see `encode_stream` of
    // block_encode), within the reserved capacity.
    unsafe { out.set_len(out.len() + len) };
}

/// The low 7 bits of 8 little-endian 2-byte elements, element 0's lowest: 56 bits.
#[inline(always)]
fn pack_low7(b: &[u8; 16]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        // SAFETY: SSE2 is part of x86_64; the load reads the 16 bytes of `b`.
        unsafe {
            let v = _mm_and_si128(_mm_loadu_si128(b.as_ptr().cast()), _mm_set1_epi16(0x7F));
            // Pairs: a + b << 7 (14 bits in each 32-bit lane), then pairs of those: 28 bits in
            // each 64-bit lane.
            let p = _mm_madd_epi16(v, _mm_set1_epi32(0x0080_0001));
            let q = _mm_or_si128(
                _mm_and_si128(p, _mm_set1_epi64x(0xFFFF_FFFF)),
                _mm_slli_epi64::<14>(_mm_srli_epi64::<32>(p)),
            );
            let lo = _mm_cvtsi128_si64(q) as u64;
            let hi = _mm_cvtsi128_si64(_mm_srli_si128::<8>(q)) as u64;
            lo | hi << 28
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        (0..8).fold(0u64, |w, k| {
            w | ((u16::from_le_bytes([b[2 * k], b[2 * k + 1]]) & 0x7F) as u64) << (7 * k)
        })
    }
}

/// Appends the stream of `seq` (in stream order, each element's index in `table`: its
/// context's offset plus its top) to `out`.
fn encode_stream(seq: &[u16], table: &[u32], out: &mut Vec<u8>) {
    let table: &[u32; ENC_LEN] = table.try_into().expect("encoder table size");
    let group = (57 / MAX_CODE_LEN) as usize;
    let most = (seq.len() * MAX_CODE_LEN as usize).div_ceil(8);
    out.reserve(most + 8);
    let mut bits = Bits {
        dst: out.spare_capacity_mut().as_mut_ptr().cast::<u8>(),
        pos: 0,
        acc: 0,
        nbits: 0,
    };
    // Each store is safe: at most `group` codes of at most MAX_CODE_LEN bits follow at most 7
    // bits held, and the codes put so far take at most `most` bytes, within `most + 8` reserved.
    let groups = seq.chunks_exact(group);
    let rest = groups.remainder();
    for g in groups {
        for &at in g {
            let e = table[at as usize & (ENC_LEN - 1)];
            bits.put((e & 0xFFFF) as u64, e >> 16);
        }
        // SAFETY: see above.
        unsafe { bits.store() };
    }
    for &at in rest {
        let e = table[at as usize & (ENC_LEN - 1)];
        bits.put((e & 0xFFFF) as u64, e >> 16);
        // SAFETY: see above.
        unsafe { bits.store() };
    }
    let len = bits.pos + (bits.nbits > 0) as usize;
    assert!(len <= most);
    // SAFETY: as in `raw_plane`.
    unsafe { out.set_len(out.len() + len) };
}
