//! The decoder of a block (layout in [`block`](super::block)). It checks everything it reads:
//! counts, context map, code lengths (a prefix code), stream lengths, that every stream holds
//! exactly the bits its elements take, with zero padding, and that no bit pattern without a
//! code is met.

use super::block::{
    max_bits, parse_lengths, raw_bits, segment, symbol_of_top, top, top_of_symbol, Head, FIXED_LEN,
    MODE_CODED, MODE_RAW, TABLE_LEN,
};
use super::huffman::{self, MAX_CODE_LEN, SYMBOLS};

const TABLE_MASK: u64 = TABLE_LEN as u64 - 1;
/// Bits that index the decoder's first, small table (`1 << FAST_BITS` entries a context). On
/// MiniLM's activations 98% of codes are this short or shorter; the others take a second
/// lookup in the full table. 16 contexts of full tables (64 KiB) do not stay in a core's L1
/// cache beside the streams; the small tables (8 KiB) do.
const FAST_BITS: u32 = 8;
const FAST_LEN: usize = 1 << FAST_BITS;
const FAST_MASK: u64 = FAST_LEN as u64 - 1;

/// Decodes the block at `*at` of `src` into `dst` (the tensor's bytes, `W`-byte elements),
/// advancing `*at` past it. `Err` says what is wrong.
pub fn decode<const W: usize>(src: &[u8], at: &mut usize, dst: &mut [u8]) -> Result<(), String> {
    let mode = *src.get(*at).ok_or("block is cut off")?;
    *at += 1;
    match mode {
        MODE_RAW => {
            let raw = src
                .get(*at..*at + dst.len())
                .ok_or("raw block is cut off")?;
            dst.copy_from_slice(raw);
            *at += dst.len();
            Ok(())
        }
        MODE_CODED => decode_coded::<W>(src, at, dst),
        m => Err(format!("block mode {m} is unknown")),
    }
}

fn decode_coded<const W: usize>(src: &[u8], at: &mut usize, dst: &mut [u8]) -> Result<(), String> {
    let fixed = src.get(*at..*at + FIXED_LEN).ok_or("block is cut off")?;
    let head = Head::parse(fixed)?;
    *at += FIXED_LEN;
    // Context of each top-9 value.
    let ctx_of_top: [u8; SYMBOLS] =
        std::array::from_fn(|t| head.context_of_symbol[symbol_of_top(t)]);
    // Entries `top 9 bits << 4 | code length` (0: no code), TABLE_LEN a context, and the small
    // tables of the codes of at most FAST_BITS bits (0 for the others too).
    let mut tables = Tables {
        full: vec![0u16; head.contexts * TABLE_LEN],
        fast: vec![0u16; head.contexts * FAST_LEN],
    };
    for (c, (t, f)) in tables
        .full
        .chunks_exact_mut(TABLE_LEN)
        .zip(tables.fast.chunks_exact_mut(FAST_LEN))
        .enumerate()
    {
        let lengths = parse_lengths(src, at).map_err(|e| format!("context {c}: {e}"))?;
        huffman::check_lengths(&lengths).map_err(|e| format!("context {c}: {e}"))?;
        huffman::fill_decode_table(
            &lengths,
            |s, len| (top_of_symbol(s) as u16) << 4 | len as u16,
            t,
        );
        // A code of at most FAST_BITS bits fills every entry whose low bits are its own, so
        // the first FAST_LEN entries hold each such code once.
        for (fe, &e) in f.iter_mut().zip(t.iter()) {
            *fe = if (e & 15) as u32 <= FAST_BITS { e } else { 0 };
        }
    }

    let streams = head.streams;
    let lens = src.get(*at..*at + 8 * streams).ok_or("block is cut off")?;
    let mut bases = [0usize; 8];
    let mut ends = [0usize; 8];
    let mut next = *at + 8 * streams;
    for k in 0..streams {
        let len = u64::from_le_bytes(lens[8 * k..8 * k + 8].try_into().expect("8 bytes"));
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= src.len().saturating_sub(next))
            .ok_or("a stream runs past the payload")?;
        bases[k] = next;
        next += len;
        ends[k] = next;
    }
    let src = &src[..next];
    let run = match streams {
        1 => run::<W, 1>,
        2 => run::<W, 2>,
        4 => run::<W, 4>,
        _ => run::<W, 8>,
    };
    let (bits, bad) = run(src, &tables, &ctx_of_top, head.stride, dst, &bases);
    if bad {
        return Err("a stream holds a bit pattern that is no code".into());
    }
    for k in 0..streams {
        let used = bits[k] - 8 * bases[k] as u64;
        let len = (ends[k] - bases[k]) as u64;
        if used.div_ceil(8) != len {
            return Err(format!(
                "stream {k} holds {len} bytes but its elements take {used} bits"
            ));
        }
        if !used.is_multiple_of(8) && src[ends[k] - 1] >> (used % 8) != 0 {
            return Err(format!("stream {k}: padding bits are not zero"));
        }
    }
    *at = next;
    Ok(())
}

/// A block's decoding tables (see [`decode_coded`]).
struct Tables {
    full: Vec<u16>,
    fast: Vec<u16>,
}

/// The next 57 or more bits of `src` from bit `bit` on, bounds checked (zero past the end).
#[inline(always)]
fn peek(src: &[u8], bit: u64) -> u64 {
    let p = (bit >> 3) as usize;
    let word = match src.get(p..p + 8) {
        Some(b) => u64::from_le_bytes(b.try_into().expect("8 bytes")),
        None => {
            let mut b = [0u8; 8];
            let rest = src.get(p..).unwrap_or(&[]);
            b[..rest.len()].copy_from_slice(rest);
            u64::from_le_bytes(b)
        }
    };
    word >> (bit & 7)
}

/// One element from `bits` (the stream's next bits) and its full-table entry `e`: the element
/// and how many bits it took. An entry without a code (0) takes only the raw bits and sets
/// `bad`.
#[inline(always)]
fn element<const W: usize>(bits: u64, e: u16, bad: &mut bool) -> (u32, u32) {
    let r = raw_bits::<W>();
    let len = (e & 15) as u32;
    *bad |= len == 0;
    let raw_mask = (1u32 << r) - 1;
    (
        (e as u32 >> 4) << r | ((bits >> len) as u32 & raw_mask),
        len + r,
    )
}

/// The table entry of the code at the start of `bits` in the context whose tables start at
/// entry `c * FAST_LEN` of `fast` and `c * TABLE_LEN` of `full`: from the small table, or,
/// for a longer code (or none), from the full one.
///
/// # Safety
/// `c` must be a context of the tables (below `fast.len() / FAST_LEN`, and `full` as long as
/// `TABLE_LEN / FAST_LEN` times `fast`).
#[inline(always)]
unsafe fn entry(fast: *const u16, full: *const u16, c: usize, bits: u64) -> u16 {
    // SAFETY: the index is below `(c + 1) * FAST_LEN`, inside `fast` (the caller's contract).
    let e = unsafe { *fast.add(c * FAST_LEN + (bits & FAST_MASK) as usize) };
    if e != 0 {
        return e;
    }
    // SAFETY: the index is below `(c + 1) * TABLE_LEN`, inside `full`.
    unsafe { *full.add(c * TABLE_LEN + (bits & TABLE_MASK) as usize) }
}

/// Elements a stream decodes per refill of its 64-bit buffer: a refill leaves at least 57
/// bits, and an element takes at most `max_bits` (bf16 18, f32 34).
const fn per_refill<const W: usize>() -> usize {
    (57 / max_bits::<W>()) as usize
}

/// Decodes the elements of `dst` from the `S` streams starting at bytes `bases` of `src`.
/// Returns each stream's end bit position, and whether a bit pattern without a code was met.
///
/// The streams are followed side by side, so that their chains of dependent loads (the next
/// bits pick a table entry, whose length says where the next code starts) overlap. Each chain
/// step is one small-table load and a shift of a 64-bit buffer, refilled with one unaligned
/// load every [`per_refill`] elements.
fn run<const W: usize, const S: usize>(
    src: &[u8],
    tables: &Tables,
    ctx_of_top: &[u8; SYMBOLS],
    stride: usize,
    dst: &mut [u8],
    bases: &[usize; 8],
) -> ([u64; 8], bool) {
    let contexts = tables.fast.len() / FAST_LEN;
    assert!(tables.full.len() == contexts * TABLE_LEN);
    assert!(ctx_of_top.iter().all(|&c| (c as usize) < contexts));
    const { assert!(MAX_CODE_LEN >= FAST_BITS) };
    let n = dst.len() / W;
    let starts: [usize; S] = std::array::from_fn(|k| segment(n, S, k).start);
    let lens: [usize; S] = std::array::from_fn(|k| segment(n, S, k).len());
    let mut bit = [0u64; 8];
    for k in 0..S {
        bit[k] = 8 * bases[k] as u64;
    }
    let mut bad = false;
    let (fast_p, full_p) = (tables.fast.as_ptr(), tables.full.as_ptr());

    // Element `j` of segment `k`, with every access checked.
    let checked = |k: usize, j: usize, dst: &mut [u8], bit: &mut [u64; 8], bad: &mut bool| {
        let i = starts[k] + j;
        let c = if stride == 0 || j < stride {
            0
        } else {
            let p = (i - stride) * W;
            ctx_of_top[top::<W>(&dst[p..p + W])] as usize
        };
        let bits = peek(src, bit[k]);
        let e = tables.full[c * TABLE_LEN + (bits & TABLE_MASK) as usize];
        let (v, took) = element::<W>(bits, e, bad);
        bit[k] += took as u64;
        dst[i * W..i * W + W].copy_from_slice(&v.to_le_bytes()[..W]);
    };

    let common = lens.iter().copied().min().unwrap_or(0);
    let lead = if stride == 0 { 0 } else { stride.min(common) };
    for j in 0..lead {
        for k in 0..S {
            checked(k, j, dst, &mut bit, &mut bad);
        }
    }
    // The first `lead` elements of each segment are done; from here on every element of the
    // first `common` has its context element in its own segment (or stride is 0).
    let max_bits = max_bits::<W>() as usize;
    let g = per_refill::<W>();
    let mut j = lead;
    while j < common {
        // Groups of `g` steps that cannot take any stream's 8-byte reads past the end of `src`.
        let mut steps = common - j;
        for b in &bit[..S] {
            let room = src.len().saturating_sub((b >> 3) as usize + 8);
            steps = steps.min((room * 8 / max_bits).saturating_sub(1));
        }
        steps -= steps % g;
        if steps == 0 {
            for k in 0..S {
                checked(k, j, dst, &mut bit, &mut bad);
            }
            j += 1;
            continue;
        }
        let (src_p, dst_p) = (src.as_ptr(), dst.as_mut_ptr());
        for j in (j..j + steps).step_by(g) {
            let mut buf = [0u64; S];
            for k in 0..S {
                // SAFETY: each stream is at most `steps * max_bits` bits past `bit[k]`, which
                // leaves more than 8 bytes before the end of `src`, so the 8-byte read lies
                // inside `src`.
                let word = unsafe { src_p.add((bit[k] >> 3) as usize).cast::<[u8; 8]>().read() };
                buf[k] = u64::from_le_bytes(word) >> (bit[k] & 7);
            }
            for jj in j..j + g {
                for k in 0..S {
                    // SAFETY: `jj < common <= lens[k]`, so element `starts[k] + jj` lies
                    // inside `dst` (`n * W` bytes), and so does element `starts[k] + jj -
                    // stride` when stride is not 0 (`jj >= lead = stride` then). `ctx_of_top`
                    // names contexts of the tables (asserted above), as [`entry`] needs. The
                    // slices outlive the loop.
                    unsafe {
                        let out = dst_p.add((starts[k] + jj) * W);
                        let c = if stride == 0 {
                            0
                        } else {
                            let prev = out.sub(stride * W);
                            let t = if W == 2 {
                                (u16::from_le_bytes(prev.cast::<[u8; 2]>().read()) >> 7) as usize
                            } else {
                                (u32::from_le_bytes(prev.cast::<[u8; 4]>().read()) >> 23) as usize
                            };
                            *ctx_of_top.get_unchecked(t) as usize
                        };
                        let e = entry(fast_p, full_p, c, buf[k]);
                        let (v, took) = element::<W>(buf[k], e, &mut bad);
                        // `g` elements take at most 57 bits, all inside the buffer.
                        buf[k] >>= took;
                        bit[k] += took as u64;
                        if W == 2 {
                            out.cast::<[u8; 2]>().write((v as u16).to_le_bytes());
                        } else {
                            out.cast::<[u8; 4]>().write(v.to_le_bytes());
                        }
                    }
                }
            }
        }
        j += steps;
        if bad {
            return (bit, true);
        }
    }
    for (k, &len) in lens.iter().enumerate() {
        for j in common..len {
            checked(k, j, dst, &mut bit, &mut bad);
        }
    }
    (bit, bad)
}
