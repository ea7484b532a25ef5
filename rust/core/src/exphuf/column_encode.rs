//! The encoder of a column block (layout in [`column`](super::column)): each element's index
//! in the encoding table (its context's offset plus its top) in stream order, computed in
//! tiles that transpose the rows (in SSE2 or AVX-512 registers for 2-byte elements) and
//! counted, the codes of each context, the plane of raw bits, then the streams, coded two at a
//! time and written one after the other. What it writes, byte for byte, is what the plain
//! encoder of `column_encode_reference.rs` writes (a proptest holds them together).

use super::block::{raw_bits, symbol_of_top, top, top_of_symbol, value, MAX_CONTEXTS};
use super::block_encode::{context_map, Bits};
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

/// How the contexts follow from a top (see [`context_map`]): the most common exponent and the
/// mantissa bits among the 8 after the sign.
#[derive(Debug, Clone, Copy)]
pub struct Contexts {
    /// The most common exponent of the block (of a sample).
    pub mode: u8,
    /// Mantissa bits among the 8 after the sign (bf16 and f32: 0; f16: 3).
    pub exp_shift: u32,
}

/// Appends the column block of `data` (`W`-byte elements in rows of `columns`, which divides
/// their count) in `streams` streams, mode byte included, with the contexts of `ctx`.
pub fn encode<const W: usize>(
    data: &[u8],
    columns: usize,
    streams: usize,
    ctx: Contexts,
    out: &mut Vec<u8>,
) {
    let n = data.len() / W;
    debug_assert!(n > 0 && n.is_multiple_of(columns) && (1..=columns).contains(&streams));
    INDEXES.with_borrow_mut(|kept| {
        // A thread keeps its buffer up to KEEP_MAX elements (8 MiB), which saves faulting in
        // and zeroing fresh pages for every block; a larger block's buffer is its own, so that
        // a writer's threads do not each hold the largest tensor they ever encoded.
        let mut own = Vec::new();
        let at = if n <= KEEP_MAX { kept } else { &mut own };
        if at.len() < n {
            at.resize(n, 0);
        }
        encode_with::<W>(data, columns, streams, ctx, &mut at[..n], out);
    });
}

/// Elements a thread's kept buffer of table indexes holds at most.
const KEEP_MAX: usize = 1 << 22;

thread_local! {
    /// The table index of each element of the block being encoded, in stream order.
    static INDEXES: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`encode`] with `at` (one entry per element) to hold the table indexes.
fn encode_with<const W: usize>(
    data: &[u8],
    columns: usize,
    streams: usize,
    ctx: Contexts,
    at: &mut [u16],
    out: &mut Vec<u8>,
) {
    let n = data.len() / W;
    let rows = n / columns;
    let ctx_of_top = context_map(ctx.mode, ctx.exp_shift);
    // Counts per (context, top), indexed like the encoding table.
    let mut hist = vec![0u32; ENC_LEN];
    let counts: &mut [u32; ENC_LEN] = (&mut hist[..]).try_into().expect("histogram size");
    table_indexes::<W>(data, columns, streams, ctx, &ctx_of_top, at, counts);

    // Codes per context: the encoding table holds each reversed code and its length, indexed
    // like the histogram (two arrays: a code costs two loads instead of a load and two
    // operations to split an entry).
    let mut lengths = vec![[0u8; SYMBOLS]; MAX_CONTEXTS];
    let mut table = Table {
        code: vec![0u16; ENC_LEN],
        len: vec![0u8; ENC_LEN],
    };
    for (c, l) in lengths.iter_mut().enumerate() {
        let of_context: [u32; SYMBOLS] =
            std::array::from_fn(|s| hist[c * SYMBOLS + top_of_symbol(s)]);
        *l = huffman::code_lengths(&of_context);
        let codes = huffman::reversed_codes(l);
        for t in 0..SYMBOLS {
            let s = symbol_of_top(t);
            table.code[c * SYMBOLS + t] = codes[s];
            table.len[c * SYMBOLS + t] = l[s];
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
    #[cfg(target_arch = "x86_64")]
    let bmi2 = std::arch::is_x86_feature_detected!("bmi2");
    #[cfg(not(target_arch = "x86_64"))]
    let bmi2 = false;
    let seq = |k: usize| {
        let cols = stream_columns(columns, streams, k);
        &at[cols.start * rows..cols.end * rows]
    };
    // Two streams at a time (their codes' chains side by side), then the last alone.
    for k in (0..streams).step_by(2) {
        let lens = if k + 1 < streams {
            encode_streams(seq(k), seq(k + 1), &table, bmi2, out)
        } else {
            encode_streams(seq(k), &[], &table, bmi2, out)
        };
        for (j, len) in lens.iter().enumerate().take(streams - k) {
            let at = lens_at + 8 * (k + j);
            out[at..at + 8].copy_from_slice(&(*len as u64).to_le_bytes());
        }
    }
}

/// Each element's index in the encoding table, `at[c * rows + r]` for row `r`'s element of
/// column `c` (stream order): its context's offset (`ctx_of_top` of the top before it in its
/// stream, times [`SYMBOLS`]) plus its top, and its top alone for the first element of a
/// stream (context 0). The top before an element is the same column's one row back, at a
/// column's first row the previous column's last. Adds each index's count to `counts`.
pub(crate) fn table_indexes<const W: usize>(
    data: &[u8],
    columns: usize,
    streams: usize,
    ctx: Contexts,
    ctx_of_top: &[u8; SYMBOLS],
    at: &mut [u16],
    counts: &mut [u32; ENC_LEN],
) {
    let n = data.len() / W;
    let rows = n / columns;
    let ctx_off: [u16; SYMBOLS] = std::array::from_fn(|t| ctx_of_top[t] as u16 * SYMBOLS as u16);
    let top_at = |r: usize, c: usize| top::<W>(&data[W * (r * columns + c)..]);
    // Rows 1 and on: the SIMD tiles, then what they leave one element at a time.
    let (rows8, cols8) = (rows / 8 * 8, columns / 8 * 8);
    #[cfg(target_arch = "x86_64")]
    let done = if W == 2 {
        let mut from = 0;
        if std::arch::is_x86_feature_detected!("avx512bw") {
            // SAFETY: the CPU has AVX-512F and BW.
            from = unsafe { indexes_avx512(data, columns, ctx, at) };
        }
        indexes_sse2(data, columns, from, ctx, at);
        (rows8, cols8)
    } else {
        (0, 0)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = (0, 0);
    let _ = ctx;
    const TILE: usize = 32;
    if done == (0, 0) {
        // No SIMD tiles (4-byte elements, or fewer than 8 rows and columns): the tops in stream order first, in tiles so that
        // both sides are read and written a cache line at a time, then each stream's from its
        // end backwards, each top plus the offset of the one before it (reading an element's
        // top and the one a row back from the data costs a row's stride each).
        for r0 in (0..rows).step_by(TILE) {
            for c0 in (0..columns).step_by(TILE) {
                // The same columns' next tile down, prefetched (as the SIMD tiles do).
                #[cfg(target_arch = "x86_64")]
                for r in r0 + TILE..(r0 + 2 * TILE).min(rows) {
                    let row = data.as_ptr().wrapping_add(W * (r * columns + c0));
                    for line in (0..W * TILE).step_by(64) {
                        // SAFETY: SSE is part of x86_64; a prefetch reads nothing and never
                        // faults.
                        unsafe {
                            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                            _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(line).cast());
                        }
                    }
                }
                for c in c0..(c0 + TILE).min(columns) {
                    for r in r0..(r0 + TILE).min(rows) {
                        at[c * rows + r] = top_at(r, c) as u16;
                    }
                }
            }
        }
        for k in 0..streams {
            let cols = stream_columns(columns, streams, k);
            let seq = &mut at[cols.start * rows..cols.end * rows];
            for j in (1..seq.len()).rev() {
                seq[j] += ctx_off[seq[j - 1] as usize & (SYMBOLS - 1)];
                counts[seq[j] as usize & (ENC_LEN - 1)] += 1;
            }
            counts[seq[0] as usize & (SYMBOLS - 1)] += 1;
        }
        return;
    }
    let index = |r: usize, c: usize| ctx_off[top_at(r - 1, c)] + top_at(r, c) as u16;
    // What the tiles leave: their rows past their columns, then the rows below them (tiled,
    // so that both sides are read and written a cache line at a time).
    let mut fill = |rs: std::ops::Range<usize>, cs: std::ops::Range<usize>| {
        for r0 in rs.clone().step_by(TILE) {
            let r1 = (r0 + TILE).min(rs.end);
            for c0 in cs.clone().step_by(TILE) {
                for c in c0..(c0 + TILE).min(cs.end) {
                    for r in r0..r1 {
                        at[c * rows + r] = index(r, c);
                    }
                }
            }
        }
    };
    fill(1..done.0, done.1..columns);
    fill(done.0.max(1)..rows, 0..columns);
    // Row 0: the first column of a stream has no top before it, the others the previous
    // column's last.
    for k in 0..streams {
        let cols = stream_columns(columns, streams, k);
        at[cols.start * rows] = top_at(0, cols.start) as u16;
        for c in cols.start + 1..cols.end {
            at[c * rows] = ctx_off[top_at(rows - 1, c - 1)] + top_at(0, c) as u16;
        }
    }
    count_indexes(at, counts);
}

/// Adds each index of `at` to `counts`, counting in [`COUNT_TABLES`] tables summed at the end:
/// neighbouring elements mostly share their index (activations' exponents vary little), and in
/// one table each increment of an entry waits for the store of the one before it (that loop
/// took about 13% of a block's encode, perf through the writer; four tables: the core's encode
/// 1.04-1.07x bp16-zstd's speed -> 1.12-1.14x, `benches/exphuf.rs` quick, MiniLM, in turns;
/// counting four far-apart parts of `at` in rotation did no better). The tables lie
/// `SPACED` entries apart, not a power of two: the same entry of tables 32 KiB apart shares its
/// address's low 12 bits, and the CPU then holds each load back behind the other tables' stores
/// (the encoder took twice its time, measured).
fn count_indexes(at: &[u16], counts: &mut [u32; ENC_LEN]) {
    const SPACED: usize = ENC_LEN + 16;
    let mut tables = vec![0u32; (COUNT_TABLES - 1) * SPACED + ENC_LEN];
    let groups = at.chunks_exact(COUNT_TABLES);
    for &a in groups.remainder() {
        tables[a as usize & (ENC_LEN - 1)] += 1;
    }
    for q in groups {
        for (j, &a) in q.iter().enumerate() {
            // The mask only tells the compiler what is already true (an index is below ENC_LEN).
            tables[j * SPACED + (a as usize & (ENC_LEN - 1))] += 1;
        }
    }
    for (i, c) in counts.iter_mut().enumerate() {
        *c += (0..COUNT_TABLES)
            .map(|j| tables[j * SPACED + i])
            .sum::<u32>();
    }
}

/// Tables [`count_indexes`] counts in (2 and 8 did no better than 4, one run each).
const COUNT_TABLES: usize = 4;

/// [`table_indexes`] of 2-byte elements for rows `0..rows / 8 * 8` and columns
/// `from..columns / 8 * 8` (row 0's left for the caller): 8 x 8 tiles whose contexts are
/// computed in SSE2 registers from each row and the row before it, then transposed.
#[cfg(target_arch = "x86_64")]
fn indexes_sse2(data: &[u8], columns: usize, from: usize, ctx: Contexts, at: &mut [u16]) {
    use super::column::transpose8x8;
    use std::arch::x86_64::*;
    let n = data.len() / 2;
    let rows = n / columns;
    let (rows8, cols8) = (rows / 8 * 8, columns / 8 * 8);
    // SAFETY: SSE2 is part of x86_64; every load reads the 16 bytes of an 8-element slice of
    // `data` and every store writes those of an 8-element slice of `at`, both bounds checked
    // when taken.
    unsafe {
        let mode = _mm_set1_epi16(ctx.mode as i16);
        let shift = _mm_cvtsi32_si128(ctx.exp_shift as i32);
        // The context offset of tops `t` (see `context_map`): the sign's 8 contexts, and the
        // exponent's bucket around the mode, clamped to -4..3, times SYMBOLS.
        let offset = |t: __m128i| {
            let e = _mm_srl_epi16(_mm_and_si128(t, _mm_set1_epi16(0xFF)), shift);
            let d = _mm_max_epi16(_mm_sub_epi16(e, mode), _mm_set1_epi16(-4));
            let d = _mm_and_si128(_mm_min_epi16(d, _mm_set1_epi16(3)), _mm_set1_epi16(7));
            _mm_or_si128(
                _mm_slli_epi16::<12>(_mm_srli_epi16::<8>(t)),
                _mm_slli_epi16::<9>(d),
            )
        };
        let tops = |r: usize, c0: usize| {
            let row = &data[2 * (r * columns + c0)..2 * (r * columns + c0 + 8)];
            _mm_srli_epi16::<7>(_mm_loadu_si128(row.as_ptr().cast()))
        };
        for r0 in (0..rows8).step_by(8) {
            // The 8 rows two tiles down (16 bytes a column) are prefetched, 128 bytes a tile:
            // a block's data is seldom in cache (the writer encodes a record once), and the
            // hardware's prefetchers fell behind 8 rows read side by side (the writer encoded
            // MiniLM's bf16 records 24% faster with these). A prefetch past `data`'s end reads
            // nothing and never faults.
            let ahead = data.as_ptr().wrapping_add(2 * (r0 + 16) * columns);
            for c0 in (from..cols8).step_by(8) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(16 * c0).cast());
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(16 * c0 + 64).cast());
                let a: [__m128i; 8] = std::array::from_fn(|i| tops(r0 + i, c0));
                let before = if r0 > 0 { tops(r0 - 1, c0) } else { a[0] };
                let idx: [__m128i; 8] = std::array::from_fn(|i| {
                    _mm_or_si128(offset(if i == 0 { before } else { a[i - 1] }), a[i])
                });
                for (j, v) in transpose8x8(idx).into_iter().enumerate() {
                    let col = &mut at[(c0 + j) * rows + r0..(c0 + j) * rows + r0 + 8];
                    _mm_storeu_si128(col.as_mut_ptr().cast(), v);
                }
            }
        }
    }
}

/// [`indexes_sse2`] four tiles at a time, side by side in the 128-bit lanes of AVX-512
/// vectors, for columns `0..columns / 32 * 32`; returns `columns / 32 * 32`.
///
/// # Safety
/// The CPU must have AVX-512F and AVX-512BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn indexes_avx512(data: &[u8], columns: usize, ctx: Contexts, at: &mut [u16]) -> usize {
    use std::arch::x86_64::*;
    let n = data.len() / 2;
    let rows = n / columns;
    let (rows8, cols32) = (rows / 8 * 8, columns / 32 * 32);
    let mode = _mm512_set1_epi16(ctx.mode as i16);
    let shift = _mm_cvtsi32_si128(ctx.exp_shift as i32);
    // As in `indexes_sse2`.
    let offset = |t: __m512i| {
        let e = _mm512_srl_epi16(_mm512_and_si512(t, _mm512_set1_epi16(0xFF)), shift);
        let d = _mm512_max_epi16(_mm512_sub_epi16(e, mode), _mm512_set1_epi16(-4));
        let d = _mm512_and_si512(
            _mm512_min_epi16(d, _mm512_set1_epi16(3)),
            _mm512_set1_epi16(7),
        );
        _mm512_or_si512(
            _mm512_slli_epi16::<12>(_mm512_srli_epi16::<8>(t)),
            _mm512_slli_epi16::<9>(d),
        )
    };
    let tops = |r: usize, c0: usize| {
        let row = &data[2 * (r * columns + c0)..2 * (r * columns + c0 + 32)];
        // SAFETY: the load reads the 64 bytes of `row`.
        _mm512_srli_epi16::<7>(unsafe { _mm512_loadu_si512(row.as_ptr().cast()) })
    };
    for r0 in (0..rows8).step_by(8) {
        // As in `indexes_sse2`: 512 bytes a step of 32 columns.
        let ahead = data.as_ptr().wrapping_add(2 * (r0 + 16) * columns);
        for c0 in (0..cols32).step_by(32) {
            for line in 0..8 {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(16 * c0 + 64 * line).cast());
            }
            let a: [__m512i; 8] = std::array::from_fn(|i| tops(r0 + i, c0));
            let before = if r0 > 0 { tops(r0 - 1, c0) } else { a[0] };
            let idx: [__m512i; 8] = std::array::from_fn(|i| {
                _mm512_or_si512(offset(if i == 0 { before } else { a[i - 1] }), a[i])
            });
            // The transpose of `transpose8x8`, in each 128-bit lane: lane `q` of vector `j`
            // is column `c0 + 8q + j`'s rows `r0..r0 + 8`.
            let t: [__m512i; 8] = std::array::from_fn(|i| {
                let (x, y) = (idx[i / 2 * 2], idx[i / 2 * 2 + 1]);
                if i % 2 == 0 {
                    _mm512_unpacklo_epi16(x, y)
                } else {
                    _mm512_unpackhi_epi16(x, y)
                }
            });
            let u: [__m512i; 8] = std::array::from_fn(|i| {
                let (x, y) = (t[i / 4 * 4 + i / 2 % 2], t[i / 4 * 4 + i / 2 % 2 + 2]);
                if i % 2 == 0 {
                    _mm512_unpacklo_epi32(x, y)
                } else {
                    _mm512_unpackhi_epi32(x, y)
                }
            });
            let cols: [__m512i; 8] = std::array::from_fn(|j| {
                let (x, y) = (u[j / 2], u[j / 2 + 4]);
                if j % 2 == 0 {
                    _mm512_unpacklo_epi64(x, y)
                } else {
                    _mm512_unpackhi_epi64(x, y)
                }
            });
            for (j, v) in cols.into_iter().enumerate() {
                let lanes = [
                    _mm512_castsi512_si128(v),
                    _mm512_extracti32x4_epi32::<1>(v),
                    _mm512_extracti32x4_epi32::<2>(v),
                    _mm512_extracti32x4_epi32::<3>(v),
                ];
                for (q, lane) in lanes.into_iter().enumerate() {
                    let c = c0 + 8 * q + j;
                    let col = &mut at[c * rows + r0..c * rows + r0 + 8];
                    // SAFETY: the store writes the 16 bytes of `col`.
                    unsafe { _mm_storeu_si128(col.as_mut_ptr().cast(), lane) };
                }
            }
        }
    }
    cols32
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

/// The encoding table: each (context, top)'s code, bit-reversed, and its length.
struct Table {
    code: Vec<u16>,
    len: Vec<u8>,
}

/// Appends the streams of `a` and `b` (in stream order, each element's index in `table`: its
/// context's offset plus its top) to `out`, one after the other; returns their lengths.
/// `bmi2`: the CPU has BMI2.
fn encode_streams(
    a: &[u16],
    b: &[u16],
    table: &Table,
    bmi2: bool,
    out: &mut Vec<u8>,
) -> [usize; 2] {
    let table = (
        table.code[..].try_into().expect("encoder table size"),
        table.len[..].try_into().expect("encoder table size"),
    );
    #[cfg(target_arch = "x86_64")]
    if bmi2 {
        // SAFETY: the CPU has BMI2.
        return unsafe { encode_streams_bmi2(a, b, table, out) };
    }
    let _ = bmi2;
    encode_streams_any(a, b, table, out)
}

/// [`encode_streams`] compiled with BMI2 (shifts by a register without the flags): 3% faster.
/// The caller checked that the CPU has BMI2; nothing else differs from the safe version.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "bmi2")]
unsafe fn encode_streams_bmi2(
    a: &[u16],
    b: &[u16],
    table: (&[u16; ENC_LEN], &[u8; ENC_LEN]),
    out: &mut Vec<u8>,
) -> [usize; 2] {
    encode_streams_any(a, b, table, out)
}

/// Codes put between stores: as many as fit in the 57 bits above the at most 7 left.
const GROUP: usize = (57 / MAX_CODE_LEN) as usize;

/// [`encode_streams`]' body: `b` is written after the room `a` may take at most, the two
/// side by side while both have codes, then moved down behind `a`.
#[inline(always)]
fn encode_streams_any(
    a: &[u16],
    b: &[u16],
    table: (&[u16; ENC_LEN], &[u8; ENC_LEN]),
    out: &mut Vec<u8>,
) -> [usize; 2] {
    let most = |s: &[u16]| (s.len() * MAX_CODE_LEN as usize).div_ceil(8);
    let (most_a, most_b) = (most(a), most(b));
    out.reserve(most_a + most_b + 16);
    let dst = out.spare_capacity_mut().as_mut_ptr().cast::<u8>();
    let mut bits_a = Bits {
        dst,
        pos: 0,
        acc: 0,
        nbits: 0,
    };
    let mut bits_b = Bits {
        dst: dst.wrapping_add(most_a + 8),
        pos: 0,
        acc: 0,
        nbits: 0,
    };
    let put = |bits: &mut Bits, at: u16| {
        let i = at as usize & (ENC_LEN - 1);
        bits.put(table.0[i] as u64, table.1[i] as u32);
    };
    // Each store is safe: at most GROUP codes of at most MAX_CODE_LEN bits follow at most 7
    // bits held, and a stream's codes put so far take at most its `most` bytes, so that its 8
    // bytes lie within the `most + 8` reserved for it (a's first, then b's).
    let both = a.len().min(b.len()) / GROUP * GROUP;
    for (ga, gb) in a[..both]
        .chunks_exact(GROUP)
        .zip(b[..both].chunks_exact(GROUP))
    {
        for (&x, &y) in ga.iter().zip(gb) {
            put(&mut bits_a, x);
            put(&mut bits_b, y);
        }
        // SAFETY: see above.
        unsafe {
            bits_a.store();
            bits_b.store();
        }
    }
    for (s, bits) in [(&a[both..], &mut bits_a), (&b[both..], &mut bits_b)] {
        let groups = s.chunks_exact(GROUP);
        let rest = groups.remainder();
        for g in groups {
            for &at in g {
                put(bits, at);
            }
            // SAFETY: see above.
            unsafe { bits.store() };
        }
        for &at in rest {
            put(bits, at);
            // SAFETY: see above.
            unsafe { bits.store() };
        }
    }
    let len_a = bits_a.pos + (bits_a.nbits > 0) as usize;
    let len_b = bits_b.pos + (bits_b.nbits > 0) as usize;
    assert!(len_a <= most_a && len_b <= most_b);
    // SAFETY: the stores above wrote every byte below each stream's length from its start
    // (each store starts at the position before it advanced, by at most 7 bytes, and the last
    // covers the padded byte), all within the capacity reserved; b's bytes move down to follow
    // a's (`copy` allows the overlap), and both are then the vector's.
    unsafe {
        std::ptr::copy(bits_b.dst, dst.add(len_a), len_b);
        out.set_len(out.len() + len_a + len_b);
    }
    [len_a, len_b]
}
