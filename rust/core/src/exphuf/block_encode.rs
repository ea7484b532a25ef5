//! The encoder of a block (layout in [`block`](super::block)): picks the contexts, counts the
//! symbols of each context, builds the codes, and writes the streams one after the other.

use super::block::{
    max_bits, raw_bits, segment, symbol_of_top, top, top_of_symbol, value, Head, MAX_CONTEXTS,
    MODE_CODED, MODE_RAW,
};
use super::huffman::{self, SYMBOLS};

/// Streams the encoder writes.
const ENCODER_STREAMS: usize = 4;
/// Entries of the encoder's tables: one per context and top-9 value.
const ENC_LEN: usize = MAX_CONTEXTS * SYMBOLS;
/// Tensors of fewer elements are stored raw: their tables would cost more than they save.
const MIN_CODED: usize = 64;

/// How the encoder picks contexts.
pub struct Plan {
    /// Element distance of the element that picks the context (0: no context).
    pub stride: usize,
    /// Mantissa bits among the 8 after the sign (bf16 and f32: 0; f16: 3), so that contexts
    /// follow the exponent.
    pub exp_shift: u32,
}

/// How the encoder lays out a coded block (docs/FORMAT.md, codec 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Mode 2: codes by column, raw bits in a plane (what the writer writes).
    ByColumn,
    /// Mode 1: codes and raw bits in element order (what the GPU encoder writes).
    ByElement,
}

/// Appends the block of `data` (`W`-byte elements), mode byte included, to `out`; a block that
/// would not be smaller than the data is stored raw.
pub fn encode<const W: usize>(data: &[u8], plan: &Plan, layout: Layout, out: &mut Vec<u8>) {
    let n = data.len() / W;
    let start = out.len();
    if layout == Layout::ByElement {
        return encode_with_streams::<W>(data, plan, ENCODER_STREAMS, out);
    }
    if n >= MIN_CODED {
        // Rows of the last dimension; a 1-dimensional tensor is one row.
        let columns = if plan.stride > 0 && n.is_multiple_of(plan.stride) {
            plan.stride
        } else {
            n
        };
        let ctx = super::column_encode::Contexts {
            mode: common_exponent::<W>(data, plan.exp_shift),
            exp_shift: plan.exp_shift,
        };
        let streams = super::column_encode::streams_for(n, columns);
        super::column_encode::encode::<W>(data, columns, streams, ctx, out);
        if out.len() - start < data.len() + 1 {
            return;
        }
        out.truncate(start);
    }
    out.push(MODE_RAW);
    out.extend_from_slice(data);
}

/// [`encode`] into `streams` streams (one of 1, 2, 4, 8).
pub(crate) fn encode_with_streams<const W: usize>(
    data: &[u8],
    plan: &Plan,
    streams: usize,
    out: &mut Vec<u8>,
) {
    let n = data.len() / W;
    debug_assert_eq!(data.len(), n * W);
    let start = out.len();
    if n >= MIN_CODED {
        encode_coded::<W>(data, plan, streams, out);
        if out.len() - start < data.len() + 1 {
            return;
        }
        out.truncate(start);
    }
    out.push(MODE_RAW);
    out.extend_from_slice(data);
}

/// Context of each top-9 value: 8 exponent buckets around the most common exponent (of a
/// sample), times the sign. Context 0, also that of elements without a context, is the most
/// common exponent's, positive.
pub(crate) fn contexts<const W: usize>(data: &[u8], exp_shift: u32) -> [u8; SYMBOLS] {
    context_map(common_exponent::<W>(data, exp_shift), exp_shift)
}

/// The most common exponent of a sample of `data` (what [`context_map`] takes as `mode`).
pub(crate) fn common_exponent<const W: usize>(data: &[u8], exp_shift: u32) -> u8 {
    let n = data.len() / W;
    let mut hist = [0u32; 256];
    for x in data.chunks_exact(W).step_by((n / 4096).max(1)) {
        hist[(top::<W>(x) & 0xFF) >> exp_shift] += 1;
    }
    // The last of tied counts (the torch encoder picks the same).
    (0..256).max_by_key(|&e| hist[e]).unwrap_or(0) as u8
}

/// Context of each top-9 value for the most common exponent `mode`: its exponent's bucket
/// around `mode`, clamped to -4..3, and its sign.
pub(crate) fn context_map(mode: u8, exp_shift: u32) -> [u8; SYMBOLS] {
    std::array::from_fn(|t| {
        let e = ((t & 0xFF) >> exp_shift) as i32;
        let bucket = (e - mode as i32).clamp(-4, 3) & 7;
        ((t >> 8) * 8) as u8 | bucket as u8
    })
}

/// Appends a coded block up to its streams: the mode byte, the fixed part (the context map of
/// `ctx_of_top`, indexed by top-9 value), each context's code lengths (indexed by symbol), and
/// `streams` stream lengths of zero, for the caller to fill in. Shared with the head of blocks
/// that another encoder coded ([`super::write_coded_head`]), so both write the same bytes.
pub(crate) fn write_head(
    stride: usize,
    streams: usize,
    ctx_of_top: &[u8; SYMBOLS],
    lengths: &[[u8; SYMBOLS]],
    out: &mut Vec<u8>,
) {
    out.push(MODE_CODED);
    Head {
        contexts: lengths.len(),
        streams,
        stride,
        context_of_symbol: std::array::from_fn(|s| ctx_of_top[top_of_symbol(s)]),
    }
    .write(out);
    for l in lengths {
        super::block::write_lengths(l, out);
    }
    out.resize(out.len() + 8 * streams, 0);
}

/// Adds the (context, top 9 bits) counts of a segment to `hist`, indexed by
/// `ctx_off[context] + top`.
fn count<const W: usize>(seg: &[u8], stride: usize, ctx_off: &[u16; SYMBOLS], hist: &mut [u32]) {
    let hist: &mut [u32; ENC_LEN] = hist.try_into().expect("histogram size");
    let n = seg.len() / W;
    let free = if stride == 0 { n } else { stride.min(n) };
    for x in seg[..free * W].chunks_exact(W) {
        hist[top::<W>(x)] += 1;
    }
    if free < n {
        for (x, p) in seg[stride * W..].chunks_exact(W).zip(seg.chunks_exact(W)) {
            // The mask only tells the compiler what is already true (offset + top < ENC_LEN).
            hist[(ctx_off[top::<W>(p)] as usize + top::<W>(x)) & (ENC_LEN - 1)] += 1;
        }
    }
}

fn encode_coded<const W: usize>(data: &[u8], plan: &Plan, streams: usize, out: &mut Vec<u8>) {
    let n = data.len() / W;
    let stride = if plan.stride < n { plan.stride } else { 0 };
    let ctx_of_top = contexts::<W>(data, plan.exp_shift);
    let ctx_off: [u16; SYMBOLS] = std::array::from_fn(|t| ctx_of_top[t] as u16 * SYMBOLS as u16);

    let mut hist = vec![0u32; ENC_LEN];
    for k in 0..streams {
        let seg = segment(n, streams, k);
        count::<W>(
            &data[seg.start * W..seg.end * W],
            stride,
            &ctx_off,
            &mut hist,
        );
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

    write_head(stride, streams, &ctx_of_top, &lengths, out);
    let lens_at = out.len() - 8 * streams;
    out.reserve((n * max_bits::<W>() as usize).div_ceil(8) + 8 * streams);
    for k in 0..streams {
        let seg = segment(n, streams, k);
        let start = out.len();
        encode_stream::<W>(
            &data[seg.start * W..seg.end * W],
            stride,
            &ctx_off,
            &table,
            out,
        );
        let len = (out.len() - start) as u64;
        out[lens_at + 8 * k..lens_at + 8 * k + 8].copy_from_slice(&len.to_le_bytes());
    }
}

/// Appends the stream of a segment's elements to `out`.
///
/// Bits are written least significant first into a 64-bit accumulator, which is stored whole
/// straight into `out`'s spare capacity (reserved for the longest stream, plus the 8 bytes the
/// last store may reach) once per `group` elements, as many as fit in the 57 bits above the
/// at most 7 left from the last store (bf16: 3 of at most 18 bits; f32: 1); the position
/// advances by the full bytes, and the length is set once at the end. Between stores an element
/// costs a shift and an OR on the accumulator and an add on its count: a short chain, where a
/// store and a shift by the bytes stored per element made a long one. The state is a local
/// [`Bits`], which the compiler keeps in registers.
fn encode_stream<const W: usize>(
    seg: &[u8],
    stride: usize,
    ctx_off: &[u16; SYMBOLS],
    table: &[u32],
    out: &mut Vec<u8>,
) {
    let table: &[u32; ENC_LEN] = table.try_into().expect("encoder table size");
    let r = raw_bits::<W>();
    let raw_mask = (1u32 << r) - 1;
    let group = (57 / max_bits::<W>()) as usize;
    let n = seg.len() / W;
    let most = (n * max_bits::<W>() as usize).div_ceil(8);
    out.reserve(most + 8);
    let mut bits = Bits {
        dst: out.spare_capacity_mut().as_mut_ptr().cast::<u8>(),
        pos: 0,
        acc: 0,
        nbits: 0,
    };
    // The code of entry `e` then the element's raw bits, and their count.
    let code = |x: &[u8], e: u32| {
        let len = e >> 16;
        (
            (e & 0xFFFF) as u64 | ((value::<W>(x) & raw_mask) as u64) << len,
            len + r,
        )
    };
    // Each `store` below is safe: the elements put so far took at most `max_bits` each, so
    // `pos <= most` and the 8 bytes lie inside the `most + 8` bytes of spare capacity reserved
    // above; a store follows at most `group` puts, which leave at most 7 + 57 bits held.
    let free = if stride == 0 { n } else { stride.min(n) };
    for x in seg[..free * W].chunks_exact(W) {
        let (c, len) = code(x, table[top::<W>(x)]);
        bits.put(c, len);
        // SAFETY: see above.
        unsafe { bits.store() };
    }
    if free < n {
        let entry = |x: &[u8], p: &[u8]| {
            code(
                x,
                table[(ctx_off[top::<W>(p)] as usize + top::<W>(x)) & (ENC_LEN - 1)],
            )
        };
        // Elements `free..n` and those a row before them, `group` at a time, then the rest.
        let xs = seg[stride * W..].chunks_exact(group * W);
        let ps = seg[..(n - stride) * W].chunks_exact(group * W);
        let (x_rest, p_rest) = (xs.remainder(), ps.remainder());
        for (xg, pg) in xs.zip(ps) {
            for (x, p) in xg.chunks_exact(W).zip(pg.chunks_exact(W)) {
                let (c, len) = entry(x, p);
                bits.put(c, len);
            }
            // SAFETY: see above.
            unsafe { bits.store() };
        }
        for (x, p) in x_rest.chunks_exact(W).zip(p_rest.chunks_exact(W)) {
            let (c, len) = entry(x, p);
            bits.put(c, len);
            // SAFETY: see above.
            unsafe { bits.store() };
        }
    }
    // The last byte, padded with zero bits (the last store wrote it already).
    let len = bits.pos + (bits.nbits > 0) as usize;
    assert!(len <= most);
    // SAFETY: every byte below `len` was written by the 8-byte stores above (each store starts
    // at the position before it advanced, by at most 7 bytes, and the last covers the padded
    // byte), and `len` is within the reserved capacity.
    unsafe { out.set_len(out.len() + len) };
}

/// A stream being written: `nbits` bits held in `acc` (those above are zero), to be stored at
/// byte `pos` of `dst`.
pub(crate) struct Bits {
    pub(crate) dst: *mut u8,
    pub(crate) pos: usize,
    pub(crate) acc: u64,
    pub(crate) nbits: u32,
}

impl Bits {
    /// Adds the low `len` bits of `c` (the others zero); `nbits + len` must be at most 64.
    #[inline(always)]
    pub(crate) fn put(&mut self, c: u64, len: u32) {
        self.acc |= c << self.nbits;
        self.nbits += len;
    }

    /// Stores the accumulator at `pos` and moves past its full bytes.
    ///
    /// # Safety
    /// The 8 bytes from `dst + pos` must be writable, and `nbits` below 64.
    #[inline(always)]
    pub(crate) unsafe fn store(&mut self) {
        // SAFETY: the caller's.
        unsafe {
            self.dst
                .add(self.pos)
                .cast::<[u8; 8]>()
                .write_unaligned(self.acc.to_le_bytes());
        }
        let whole = self.nbits >> 3;
        self.pos += whole as usize;
        // `whole` <= 7, so the shift is in range.
        self.acc >>= 8 * whole;
        self.nbits &= 7;
    }
}

/// The encoder's streams written the plainest way (bytes pushed one at a time), kept to show
/// that the encoder writes the same bytes.
#[cfg(test)]
mod reference {
    use super::*;
    use proptest::prelude::*;

    fn count<const W: usize>(
        seg: &[u8],
        stride: usize,
        ctx_off: &[u16; SYMBOLS],
        hist: &mut [u32],
    ) {
        let n = seg.len() / W;
        let free = if stride == 0 { n } else { stride.min(n) };
        for x in seg[..free * W].chunks_exact(W) {
            hist[top::<W>(x)] += 1;
        }
        if free < n {
            for (x, p) in seg[stride * W..].chunks_exact(W).zip(seg.chunks_exact(W)) {
                hist[ctx_off[top::<W>(p)] as usize + top::<W>(x)] += 1;
            }
        }
    }

    fn encode_stream<const W: usize>(
        seg: &[u8],
        stride: usize,
        ctx_off: &[u16; SYMBOLS],
        table: &[u32],
        out: &mut Vec<u8>,
    ) {
        let r = raw_bits::<W>();
        let raw_mask = (1u32 << r) - 1;
        let (mut acc, mut nbits) = (0u64, 0u32);
        let mut put = |x: &[u8], e: u32| {
            let len = e >> 16;
            acc |= ((e & 0xFFFF) as u64 | ((value::<W>(x) & raw_mask) as u64) << len) << nbits;
            nbits += len + r;
            while nbits >= 8 {
                out.push(acc as u8);
                acc >>= 8;
                nbits -= 8;
            }
        };
        let n = seg.len() / W;
        let free = if stride == 0 { n } else { stride.min(n) };
        for x in seg[..free * W].chunks_exact(W) {
            put(x, table[top::<W>(x)]);
        }
        if free < n {
            for (x, p) in seg[stride * W..].chunks_exact(W).zip(seg.chunks_exact(W)) {
                put(x, table[ctx_off[top::<W>(p)] as usize + top::<W>(x)]);
            }
        }
        if nbits > 0 {
            out.push(acc as u8);
        }
    }

    fn encode_reference<const W: usize>(data: &[u8], plan: &Plan, streams: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let n = data.len() / W;
        if n >= MIN_CODED {
            let stride = if plan.stride < n { plan.stride } else { 0 };
            let ctx_of_top = contexts::<W>(data, plan.exp_shift);
            let ctx_off: [u16; SYMBOLS] =
                std::array::from_fn(|t| ctx_of_top[t] as u16 * SYMBOLS as u16);
            let mut hist = vec![0u32; ENC_LEN];
            for k in 0..streams {
                let seg = segment(n, streams, k);
                count::<W>(
                    &data[seg.start * W..seg.end * W],
                    stride,
                    &ctx_off,
                    &mut hist,
                );
            }
            let mut lengths = vec![[0u8; SYMBOLS]; MAX_CONTEXTS];
            let mut table = vec![0u32; ENC_LEN];
            for (c, l) in lengths.iter_mut().enumerate() {
                let counts: [u32; SYMBOLS] =
                    std::array::from_fn(|s| hist[c * SYMBOLS + top_of_symbol(s)]);
                *l = huffman::code_lengths(&counts);
                let codes = huffman::reversed_codes(l);
                for t in 0..SYMBOLS {
                    let s = symbol_of_top(t);
                    table[c * SYMBOLS + t] = codes[s] as u32 | (l[s] as u32) << 16;
                }
            }
            write_head(stride, streams, &ctx_of_top, &lengths, &mut out);
            let lens_at = out.len() - 8 * streams;
            for k in 0..streams {
                let seg = segment(n, streams, k);
                let start = out.len();
                encode_stream::<W>(
                    &data[seg.start * W..seg.end * W],
                    stride,
                    &ctx_off,
                    &table,
                    &mut out,
                );
                let len = (out.len() - start) as u64;
                out[lens_at + 8 * k..lens_at + 8 * k + 8].copy_from_slice(&len.to_le_bytes());
            }
            if out.len() < data.len() + 1 {
                return out;
            }
            out.clear();
        }
        out.push(MODE_RAW);
        out.extend_from_slice(data);
        out
    }

    /// Elements of a few exponents around `centre` (`spread` of them; 0: any bits), random
    /// signs and low bits, as `W`-byte elements.
    fn elements<const W: usize>(n: usize, centre: u32, spread: u32, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        let mut out = Vec::with_capacity(n * W);
        for i in 0..n {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let r = s.wrapping_mul(0x2545_F491_4F6C_DD1D);
            let f = if spread == 0 {
                r as u32
            } else {
                let exp = centre + ((r >> 40) as u32 % spread) + (i % 7) as u32;
                ((r >> 63) as u32) << 31 | (exp & 0xFF) << 23 | (r as u32 & 0x7F_FFFF)
            };
            if W == 2 {
                out.extend_from_slice(&((f >> 16) as u16).to_le_bytes());
            } else {
                out.extend_from_slice(&f.to_le_bytes());
            }
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        #[test]
        fn same_bytes_as_the_reference(
            n in 0usize..5000,
            stride in 0usize..700,
            streams_at in 0usize..4,
            wide in any::<bool>(),
            centre in 0u32..250,
            spread in 0u32..12,
            exp_shift in 0u32..4,
            seed in any::<u64>(),
        ) {
            let streams = [1, 2, 4, 8][streams_at];
            let plan = Plan { stride, exp_shift };
            let (got, want) = if wide {
                let data = elements::<4>(n, centre, spread, seed);
                let mut got = Vec::new();
                encode_with_streams::<4>(&data, &plan, streams, &mut got);
                (got, encode_reference::<4>(&data, &plan, streams))
            } else {
                let data = elements::<2>(n, centre, spread, seed);
                let mut got = Vec::new();
                encode_with_streams::<2>(&data, &plan, streams, &mut got);
                (got, encode_reference::<2>(&data, &plan, streams))
            };
            prop_assert_eq!(got, want);
        }
    }
}
