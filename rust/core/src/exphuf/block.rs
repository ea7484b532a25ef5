//! One tensor's coded block (docs/FORMAT.md, codec `exp-huf`): the layout, the encoder and the
//! decoder. Elements are `W` bytes (2 or 4), little-endian; each is sent as the Huffman code of
//! its top 9 bits (sign and the next 8) in the table of its context, then its low `8W - 9` bits
//! as they are. The context of element `i` is picked by the symbol of element `i - stride` (the
//! same channel one row back: the previous layer of `[tokens, layers, hidden]`, the previous
//! token of `[tokens, hidden]`), which predicts sign and exponent well in activations.
//!
//! Element `i` goes to stream `i % streams`: the decoder follows the streams side by side, so
//! their bit positions, each a chain of dependent loads, advance in parallel.

use super::huffman::{self, MAX_CODE_LEN, SYMBOLS};

/// Contexts a block may have at most.
pub const MAX_CONTEXTS: usize = 16;
/// Bytes before the tables: nctx, streams, reserved u16, stride u32, the 256-byte context map.
const FIXED_LEN: usize = 8 + SYMBOLS / 2;
/// Streams the encoder writes.
const ENCODER_STREAMS: usize = 4;
/// Entries of one context's decoding table.
const TABLE_LEN: usize = 1 << MAX_CODE_LEN;
const TABLE_MASK: u64 = TABLE_LEN as u64 - 1;

/// The block's symbol of an element's top 9 bits `t` (sign, then 8 bits): the sign moves to
/// the lowest bit, so that the symbols of one exponent range are neighbours (small tables).
#[inline(always)]
fn symbol_of_top(t: u32) -> usize {
    (((t & 0xFF) << 1) | (t >> 8)) as usize
}

/// Inverse of [`symbol_of_top`].
#[inline(always)]
fn top_of_symbol(s: usize) -> u32 {
    (((s & 1) << 8) | (s >> 1)) as u32
}

/// Loads element `i` of `W`-byte little-endian elements.
#[inline(always)]
fn load<const W: usize>(data: &[u8], i: usize) -> u32 {
    let b = &data[i * W..i * W + W];
    if W == 2 {
        u16::from_le_bytes([b[0], b[1]]) as u32
    } else {
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

#[inline(always)]
fn store<const W: usize>(data: &mut [u8], i: usize, v: u32) {
    data[i * W..i * W + W].copy_from_slice(&v.to_le_bytes()[..W]);
}

/// Bits of an element below its top 9.
const fn raw_bits<const W: usize>() -> u32 {
    8 * W as u32 - 9
}

/// How the encoder assigns contexts: `exp_shift` is how many of the 8 bits after the sign are
/// mantissa (bf16 and f32: 0; f16: 3), so contexts follow the exponent.
pub struct Plan {
    /// Element distance of the context (0: no context).
    pub stride: usize,
    /// Mantissa bits among the 8 after the sign.
    pub exp_shift: u32,
}

/// Encodes `data` (`W`-byte elements) as a block (mode byte included) appended to `out`; a block
/// that would not be smaller than the data is stored raw (mode 0).
pub fn encode<const W: usize>(data: &[u8], plan: &Plan, out: &mut Vec<u8>) {
    encode_with_streams::<W>(data, plan, ENCODER_STREAMS, out);
}

/// [`encode`] into `streams` streams (1, 2, 4 or 8).
pub(crate) fn encode_with_streams<const W: usize>(
    data: &[u8],
    plan: &Plan,
    streams: usize,
    out: &mut Vec<u8>,
) {
    let n = data.len() / W;
    debug_assert_eq!(data.len(), n * W);
    let start = out.len();
    if n >= 64 {
        encode_coded::<W>(data, plan, streams, out);
        if out.len() - start < data.len() + 1 {
            return;
        }
        out.truncate(start);
    }
    out.push(0);
    out.extend_from_slice(data);
}

/// Context of each top-9 value (indexed by the top 9 bits, not the symbol): 8 exponent buckets
/// around the most common exponent, times the sign; bucket 0 (context 0, the one of elements
/// without a context) is the most common exponent.
fn contexts<const W: usize>(data: &[u8], exp_shift: u32) -> [u8; SYMBOLS] {
    let n = data.len() / W;
    let r = raw_bits::<W>();
    let mut hist = [0u32; 256];
    let step = (n / 4096).max(1);
    for i in (0..n).step_by(step) {
        hist[(((load::<W>(data, i) >> r) & 0xFF) >> exp_shift) as usize] += 1;
    }
    let mode = (0..256).max_by_key(|&e| hist[e]).unwrap_or(0) as i32;
    let mut ctx = [0u8; SYMBOLS];
    for (t, c) in ctx.iter_mut().enumerate() {
        let e = ((t & 0xFF) >> exp_shift) as i32;
        let bucket = (e - mode).clamp(-4, 3) & 7;
        *c = ((t >> 8) * 8) as u8 | bucket as u8;
    }
    ctx
}

/// The top 9 bits of a `W`-byte little-endian element given as its bytes.
#[inline(always)]
fn top<const W: usize>(b: &[u8]) -> usize {
    if W == 2 {
        (u16::from_le_bytes([b[0], b[1]]) >> 7) as usize
    } else {
        (u32::from_le_bytes([b[0], b[1], b[2], b[3]]) >> 23) as usize
    }
}

/// Entries of the encoder's tables: one per context and top-9 value.
const ENC_LEN: usize = MAX_CONTEXTS * SYMBOLS;

fn encode_coded<const W: usize>(data: &[u8], plan: &Plan, streams: usize, out: &mut Vec<u8>) {
    let n = data.len() / W;
    let stride = if plan.stride < n { plan.stride } else { 0 };
    let ctx_of_top = contexts::<W>(data, plan.exp_shift);
    // Offset of each top-9 value's context in tables of SYMBOLS entries per context.
    let ctx_off: [u16; SYMBOLS] = std::array::from_fn(|t| ctx_of_top[t] as u16 * SYMBOLS as u16);

    // Symbol counts per context, indexed by context offset + top 9 bits (masks keep indexes in
    // range for the compiler: they are already).
    let mut hist = vec![0u32; ENC_LEN];
    let free = if stride == 0 { n } else { stride };
    for x in data[..free * W].chunks_exact(W) {
        hist[top::<W>(x)] += 1;
    }
    if stride > 0 {
        for (x, p) in data[stride * W..].chunks_exact(W).zip(data.chunks_exact(W)) {
            hist[(ctx_off[top::<W>(p)] as usize + top::<W>(x)) & (ENC_LEN - 1)] += 1;
        }
    }

    // Codes per context; the encoding table holds `reversed code | length << 16`.
    let mut lengths = vec![[0u8; SYMBOLS]; MAX_CONTEXTS];
    let mut table = vec![0u32; ENC_LEN];
    for (c, l) in lengths.iter_mut().enumerate() {
        let mut counts = [0u32; SYMBOLS];
        for t in 0..SYMBOLS {
            counts[symbol_of_top(t as u32)] = hist[c * SYMBOLS + t];
        }
        *l = huffman::code_lengths(&counts);
        let codes = huffman::reversed_codes(l);
        for t in 0..SYMBOLS {
            let s = symbol_of_top(t as u32);
            table[c * SYMBOLS + t] = codes[s] as u32 | (l[s] as u32) << 16;
        }
    }
    write_head(out, streams, stride, &ctx_of_top, &lengths);

    let streams_out = match streams {
        1 => encode_streams::<W, 1>(data, stride, &ctx_off, &table),
        2 => encode_streams::<W, 2>(data, stride, &ctx_off, &table),
        4 => encode_streams::<W, 4>(data, stride, &ctx_off, &table),
        _ => encode_streams::<W, 8>(data, stride, &ctx_off, &table),
    };
    for s in &streams_out {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    }
    for s in &streams_out {
        out.extend_from_slice(s);
    }
}

/// Writes the block's mode, counts, stride, context map and code lengths.
fn write_head(
    out: &mut Vec<u8>,
    streams: usize,
    stride: usize,
    ctx_of_top: &[u8; SYMBOLS],
    lengths: &[[u8; SYMBOLS]],
) {
    out.push(1);
    out.push(lengths.len() as u8);
    out.push(streams as u8);
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&(stride as u32).to_le_bytes());
    for pair in 0..SYMBOLS / 2 {
        let lo = ctx_of_top[top_of_symbol(2 * pair) as usize];
        let hi = ctx_of_top[top_of_symbol(2 * pair + 1) as usize];
        out.push(lo | hi << 4);
    }
    for l in lengths {
        let first = l.iter().position(|&x| x > 0).unwrap_or(0);
        let end = l.iter().rposition(|&x| x > 0).map_or(0, |p| p + 1);
        let count = end.saturating_sub(first);
        out.extend_from_slice(&(first as u16).to_le_bytes());
        out.extend_from_slice(&(count as u16).to_le_bytes());
        for pair in l[first..end].chunks(2) {
            out.push(pair[0] | pair.get(1).copied().unwrap_or(0) << 4);
        }
    }
}

/// The `S` streams of the elements of `data`.
fn encode_streams<const W: usize, const S: usize>(
    data: &[u8],
    stride: usize,
    ctx_off: &[u16; SYMBOLS],
    table: &[u32],
) -> Vec<Vec<u8>> {
    let n = data.len() / W;
    let r = raw_bits::<W>();
    let table: &[u32; ENC_LEN] = table.try_into().expect("encoder table size");
    let bound = (n.div_ceil(S) * (MAX_CODE_LEN + r) as usize).div_ceil(8);
    let mut w: [BitWriter; S] = std::array::from_fn(|_| BitWriter::new(bound));
    #[inline(always)]
    fn put<const W: usize>(w: &mut BitWriter, x: &[u8], e: u32) {
        let r = raw_bits::<W>();
        let v = if W == 2 {
            u16::from_le_bytes([x[0], x[1]]) as u32
        } else {
            u32::from_le_bytes([x[0], x[1], x[2], x[3]])
        };
        let len = e >> 16;
        w.put((e & 0xFFFF) as u64 | ((v & ((1 << r) - 1)) as u64) << len, len + r);
    }
    // Elements before `lead` (the first row, rounded up to whole groups) one at a time.
    let lead = if stride == 0 { 0 } else { stride.next_multiple_of(S).min(n) };
    for i in 0..lead {
        let x = &data[i * W..i * W + W];
        let off = if i < stride { 0 } else { ctx_off[top::<W>(&data[(i - stride) * W..])] as usize };
        put::<W>(&mut w[i % S], x, table[(off + top::<W>(x)) & (ENC_LEN - 1)]);
    }
    let body = (n - lead) / S * S;
    let xs = data[lead * W..(lead + body) * W].chunks_exact(W * S);
    if stride == 0 {
        for g in xs {
            for (k, wk) in w.iter_mut().enumerate() {
                let x = &g[k * W..k * W + W];
                put::<W>(wk, x, table[top::<W>(x)]);
            }
        }
    } else {
        let ps = data[(lead - stride) * W..].chunks_exact(W * S);
        for (g, p) in xs.zip(ps) {
            for (k, wk) in w.iter_mut().enumerate() {
                let x = &g[k * W..k * W + W];
                let off = ctx_off[top::<W>(&p[k * W..k * W + W])] as usize;
                put::<W>(wk, x, table[(off + top::<W>(x)) & (ENC_LEN - 1)]);
            }
        }
    }
    for i in lead + body..n {
        let x = &data[i * W..i * W + W];
        let off = if stride == 0 { 0 } else { ctx_off[top::<W>(&data[(i - stride) * W..])] as usize };
        put::<W>(&mut w[i % S], x, table[(off + top::<W>(x)) & (ENC_LEN - 1)]);
    }
    w.into_iter().map(BitWriter::finish).collect()
}

/// Writes bits least significant first; `buf` has room for the stream plus 8 bytes, so the
/// whole accumulator is stored at every step and the position advances by the full bytes.
struct BitWriter {
    buf: Vec<u8>,
    pos: usize,
    acc: u64,
    nbits: u32,
}

impl BitWriter {
    fn new(bound: usize) -> BitWriter {
        BitWriter {
            buf: vec![0; bound + 8],
            pos: 0,
            acc: 0,
            nbits: 0,
        }
    }

    /// Appends the low `n` bits of `bits` (`n` <= 34, higher bits zero).
    #[inline(always)]
    fn put(&mut self, bits: u64, n: u32) {
        self.acc |= bits << self.nbits;
        self.nbits += n;
        self.buf[self.pos..self.pos + 8].copy_from_slice(&self.acc.to_le_bytes());
        let whole = self.nbits >> 3;
        self.pos += whole as usize;
        // At most 7 + 34 bits were held, so `whole` <= 5 and the shift is in range.
        self.acc >>= 8 * whole;
        self.nbits &= 7;
    }

    fn finish(mut self) -> Vec<u8> {
        if self.nbits > 0 {
            self.buf[self.pos] = self.acc as u8;
            self.pos += 1;
        }
        self.buf.truncate(self.pos);
        self.buf
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding

/// Reads a little-endian integer of `N` bytes at `*at` of `src`, advancing `*at`.
fn take<const N: usize>(src: &[u8], at: &mut usize) -> Result<[u8; N], String> {
    let b = src
        .get(*at..*at + N)
        .ok_or("exp-huf block is cut off")?
        .try_into()
        .expect("N bytes");
    *at += N;
    Ok(b)
}

/// Decodes the block at `*at` of `src` into `dst` (the tensor's bytes, `W`-byte elements),
/// advancing `*at` past it. `Err` says what is wrong.
pub fn decode<const W: usize>(src: &[u8], at: &mut usize, dst: &mut [u8]) -> Result<(), String> {
    let [mode] = take::<1>(src, at)?;
    match mode {
        0 => {
            let raw = src
                .get(*at..*at + dst.len())
                .ok_or("exp-huf raw block is cut off")?;
            dst.copy_from_slice(raw);
            *at += dst.len();
            Ok(())
        }
        1 => decode_coded::<W>(src, at, dst),
        m => Err(format!("exp-huf block mode {m} is unknown")),
    }
}

fn decode_coded<const W: usize>(
    src: &[u8],
    at: &mut usize,
    dst: &mut [u8],
) -> Result<(), String> {
    let n = dst.len() / W;
    let r = raw_bits::<W>();
    let fixed = src.get(*at..*at + FIXED_LEN).ok_or("exp-huf block is cut off")?;
    let (nctx, streams) = (fixed[0] as usize, fixed[1] as usize);
    if !(1..=MAX_CONTEXTS).contains(&nctx) {
        return Err(format!("exp-huf block has {nctx} contexts (1 to 16 allowed)"));
    }
    if ![1, 2, 4, 8].contains(&streams) {
        return Err(format!("exp-huf block has {streams} streams (1, 2, 4 or 8 allowed)"));
    }
    if fixed[2] != 0 || fixed[3] != 0 {
        return Err("exp-huf block: reserved bytes are not zero".into());
    }
    let stride = u32::from_le_bytes(fixed[4..8].try_into().expect("4 bytes")) as usize;
    // Table offset of the context each top-9 value of the element one stride back selects.
    let mut ctx_base = [0u32; SYMBOLS];
    for (p, &b) in fixed[8..].iter().enumerate() {
        for (sym, c) in [(2 * p, b & 15), (2 * p + 1, b >> 4)] {
            if c as usize >= nctx {
                return Err(format!("exp-huf context map names context {c} of {nctx}"));
            }
            ctx_base[top_of_symbol(sym) as usize] = c as u32 * TABLE_LEN as u32;
        }
    }
    *at += FIXED_LEN;

    let mut table = vec![0u32; nctx * TABLE_LEN];
    for c in 0..nctx {
        let first = u16::from_le_bytes(take::<2>(src, at)?) as usize;
        let count = u16::from_le_bytes(take::<2>(src, at)?) as usize;
        if first + count > SYMBOLS {
            return Err(format!(
                "exp-huf table {c}: symbols {first}..{} are out of range",
                first + count
            ));
        }
        let packed = src
            .get(*at..*at + count.div_ceil(2))
            .ok_or("exp-huf block is cut off")?;
        *at += packed.len();
        let mut lengths = [0u8; SYMBOLS];
        for j in 0..count {
            lengths[first + j] = (packed[j / 2] >> (4 * (j % 2))) & 15;
        }
        if count % 2 == 1 && packed[count / 2] >> 4 != 0 {
            return Err(format!("exp-huf table {c}: padding nibble is not zero"));
        }
        huffman::check_lengths(&lengths).map_err(|e| format!("exp-huf table {c}: {e}"))?;
        huffman::fill_decode_table(
            &lengths,
            |s, len| top_of_symbol(s) << r | len as u32,
            &mut table[c * TABLE_LEN..(c + 1) * TABLE_LEN],
        );
    }

    let mut bases = [0usize; 8];
    let mut ends = [0usize; 8];
    let mut next = *at + 8 * streams;
    for k in 0..streams {
        let len = u64::from_le_bytes(take::<8>(src, at)?);
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= src.len() - next.min(src.len()))
            .ok_or("exp-huf stream runs past the payload")?;
        bases[k] = next;
        ends[k] = next + len;
        next += len;
    }
    let streams_src = &src[..next];
    let stride = if stride < n { stride } else { 0 };
    let mut pos = [0u64; 8];
    let bad = match streams {
        1 => run::<W, 1>(streams_src, &table, &ctx_base, stride, dst, &bases, &mut pos),
        2 => run::<W, 2>(streams_src, &table, &ctx_base, stride, dst, &bases, &mut pos),
        4 => run::<W, 4>(streams_src, &table, &ctx_base, stride, dst, &bases, &mut pos),
        _ => run::<W, 8>(streams_src, &table, &ctx_base, stride, dst, &bases, &mut pos),
    };
    if bad {
        return Err("exp-huf stream holds a bit pattern that is no code".into());
    }
    for k in 0..streams {
        let bits = pos[k];
        let len = (ends[k] - bases[k]) as u64;
        if bits.div_ceil(8) != len {
            return Err(format!(
                "exp-huf stream {k} holds {len} bytes but its codes take {bits} bits"
            ));
        }
        if bits % 8 != 0 && src[ends[k] - 1] >> (bits % 8) != 0 {
            return Err(format!("exp-huf stream {k}: padding bits are not zero"));
        }
    }
    *at = next;
    Ok(())
}

/// The next 57 or more bits at bit `pos` of the stream starting at byte `base` of `src`, bounds
/// checked (zero bits past the end of `src`).
#[inline(always)]
fn peek(src: &[u8], base: usize, pos: u64) -> u64 {
    let p = base + (pos >> 3) as usize;
    let word = match src.get(p..p + 8) {
        Some(b) => u64::from_le_bytes(b.try_into().expect("8 bytes")),
        None => {
            let mut b = [0u8; 8];
            let rest = src.get(p..).unwrap_or(&[]);
            b[..rest.len()].copy_from_slice(rest);
            u64::from_le_bytes(b)
        }
    };
    word >> (pos & 7)
}

/// One element from `bits` (the stream's next bits) with the table entries `entries` of its
/// context: returns the element and the bits it took; an entry without a code (0) takes only
/// the raw bits and sets `bad`.
#[inline(always)]
fn element<const W: usize>(bits: u64, e: u32, bad: &mut bool) -> (u32, u32) {
    let r = raw_bits::<W>();
    let len = e & 15;
    *bad |= len == 0;
    let raw_mask = (1u32 << r) - 1;
    ((e & !raw_mask) | ((bits >> len) as u32 & raw_mask), len + r)
}

/// Decodes the `dst.len() / W` elements from the `S` streams starting at `bases` into `dst`,
/// leaving each stream's bit count in `pos`. Returns whether a bit pattern without a code was
/// met. `table` has `TABLE_LEN` entries per context and `ctx_base` holds only offsets of whole
/// tables in it (both checked by the caller).
fn run<const W: usize, const S: usize>(
    src: &[u8],
    table: &[u32],
    ctx_base: &[u32; SYMBOLS],
    stride: usize,
    dst: &mut [u8],
    bases: &[usize; 8],
    pos: &mut [u64; 8],
) -> bool {
    let n = dst.len() / W;
    let r = raw_bits::<W>();
    let max_bits = (MAX_CODE_LEN + r) as usize;
    let mut bad = false;
    debug_assert!(ctx_base.iter().all(|&b| b as usize + TABLE_LEN <= table.len()));
    // The checked path: the first row (rounded up to whole groups) and the last partial group.
    let one = |i: usize, dst: &mut [u8], pos: &mut [u64; 8], bad: &mut bool| {
        let base = if stride == 0 || i < stride {
            0
        } else {
            ctx_base[(load::<W>(dst, i - stride) >> r) as usize] as usize
        };
        let bits = peek(src, bases[i % S], pos[i % S]);
        let (v, took) = element::<W>(bits, table[base + (bits & TABLE_MASK) as usize], bad);
        pos[i % S] += took as u64;
        store::<W>(dst, i, v);
    };
    let lead = if stride == 0 { 0 } else { stride.next_multiple_of(S).min(n) };
    for i in 0..lead {
        one(i, dst, pos, &mut bad);
    }
    let end = lead + (n - lead) / S * S;
    let mut i = lead;
    while i < end {
        // Groups that cannot take any stream's reads past the end of `src`: each element takes
        // at most `max_bits` bits.
        let mut groups = (end - i) / S;
        for k in 0..S {
            let at = bases[k] + (pos[k] >> 3) as usize + 8;
            let room = src.len().saturating_sub(at);
            groups = groups.min((room * 8 / max_bits).saturating_sub(1));
        }
        if groups == 0 {
            for j in i..i + S {
                one(j, dst, pos, &mut bad);
            }
            i += S;
            continue;
        }
        let group_end = i + groups * S;
        let (src_p, dst_p, table_p) = (src.as_ptr(), dst.as_mut_ptr(), table.as_ptr());
        while i < group_end {
            for k in 0..S {
                // SAFETY: `i + k < end <= n`, so element `i + k` (and, for `i + k >= stride`,
                // element `i + k - stride`) lies inside `dst`, which is `n * W` bytes long.
                // Every stream is at most `groups` groups, so `groups * max_bits` bits, away
                // from the end of `src` minus 8 bytes, so the 8-byte read lies inside `src`.
                // `ctx_base` entries are offsets of whole tables (checked when built) and the
                // index adds less than TABLE_LEN, so it lies inside `table`. All three slices are
                // borrowed for the whole loop.
                unsafe {
                    let base = if stride == 0 {
                        0
                    } else {
                        let prev = load_ptr::<W>(dst_p, i + k - stride);
                        *ctx_base.get_unchecked((prev >> r) as usize) as usize
                    };
                    let p = src_p.add(bases[k] + (pos[k] >> 3) as usize);
                    let bits = u64::from_le(p.cast::<u64>().read_unaligned()) >> (pos[k] & 7);
                    let e = *table_p.add(base + (bits & TABLE_MASK) as usize);
                    let (v, took) = element::<W>(bits, e, &mut bad);
                    pos[k] += took as u64;
                    store_ptr::<W>(dst_p, i + k, v);
                }
            }
            i += S;
        }
        if bad {
            return true;
        }
    }
    for j in end..n {
        one(j, dst, pos, &mut bad);
    }
    bad
}

/// Element `i` of `W`-byte elements at `p`.
///
/// # Safety
/// `p` must be valid for reads of `(i + 1) * W` bytes.
#[inline(always)]
unsafe fn load_ptr<const W: usize>(p: *const u8, i: usize) -> u32 {
    // SAFETY: the caller guarantees the bytes are readable; reads are unaligned.
    unsafe {
        if W == 2 {
            u16::from_le(p.add(i * W).cast::<u16>().read_unaligned()) as u32
        } else {
            u32::from_le(p.add(i * W).cast::<u32>().read_unaligned())
        }
    }
}

/// Writes `v` as element `i` of `W`-byte elements at `p`.
///
/// # Safety
/// `p` must be valid for writes of `(i + 1) * W` bytes.
#[inline(always)]
unsafe fn store_ptr<const W: usize>(p: *mut u8, i: usize, v: u32) {
    // SAFETY: the caller guarantees the bytes are writable; writes are unaligned.
    unsafe {
        if W == 2 {
            p.add(i * W).cast::<u16>().write_unaligned((v as u16).to_le())
        } else {
            p.add(i * W).cast::<u32>().write_unaligned(v.to_le())
        }
    }
}
