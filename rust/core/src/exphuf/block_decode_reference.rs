//! The decoder of a block as it was before its streams were read through register bit buffers
//! and u16 tables (one 8-byte load per element, u32 tables): kept for the tests, which show that
//! [`block_decode`](super::block_decode) decodes what it decodes and refuses what it refuses.

use super::block::{
    max_bits, parse_lengths, raw_bits, segment, symbol_of_top, top, top_of_symbol, Head, FIXED_LEN,
    MODE_CODED, MODE_RAW, TABLE_LEN,
};
use super::huffman::{self, SYMBOLS};

const TABLE_MASK: u64 = TABLE_LEN as u64 - 1;

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
    // Offset in `table` of the context each top-9 value picks.
    let ctx_base: [u32; SYMBOLS] =
        std::array::from_fn(|t| head.context_of_symbol[symbol_of_top(t)] as u32 * TABLE_LEN as u32);
    let r = raw_bits::<W>();
    let mut table = vec![0u32; head.contexts * TABLE_LEN];
    for (c, t) in table.chunks_exact_mut(TABLE_LEN).enumerate() {
        let lengths = parse_lengths(src, at).map_err(|e| format!("context {c}: {e}"))?;
        huffman::check_lengths(&lengths).map_err(|e| format!("context {c}: {e}"))?;
        huffman::fill_decode_table(
            &lengths,
            |s, len| (top_of_symbol(s) as u32) << r | len as u32,
            t,
        );
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
    let (bits, bad) = run(src, &table, &ctx_base, head.stride, dst, &bases);
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

/// One element from `bits` (the stream's next bits) and its table entry `e`: the element and
/// how many bits it took. An entry without a code (0) takes only the raw bits and sets `bad`.
#[inline(always)]
fn element<const W: usize>(bits: u64, e: u32, bad: &mut bool) -> (u32, u64) {
    let r = raw_bits::<W>();
    let len = e & 15;
    *bad |= len == 0;
    let raw_mask = (1u32 << r) - 1;
    (
        (e & !raw_mask) | ((bits >> len) as u32 & raw_mask),
        (len + r) as u64,
    )
}

/// Decodes the elements of `dst` from the `S` streams starting at bytes `bases` of `src`.
/// Returns each stream's end bit position, and whether a bit pattern without a code was met.
/// `table` holds `TABLE_LEN` entries per context, `ctx_base` offsets of whole tables in it.
fn run<const W: usize, const S: usize>(
    src: &[u8],
    table: &[u32],
    ctx_base: &[u32; SYMBOLS],
    stride: usize,
    dst: &mut [u8],
    bases: &[usize; 8],
) -> ([u64; 8], bool) {
    assert!(ctx_base
        .iter()
        .all(|&b| b as usize + TABLE_LEN <= table.len()));
    let n = dst.len() / W;
    let starts: [usize; S] = std::array::from_fn(|k| segment(n, S, k).start);
    let lens: [usize; S] = std::array::from_fn(|k| segment(n, S, k).len());
    let mut bit = [0u64; 8];
    for k in 0..S {
        bit[k] = 8 * bases[k] as u64;
    }
    let mut bad = false;

    // Element `j` of segment `k`, with every access checked.
    let checked = |k: usize, j: usize, dst: &mut [u8], bit: &mut [u64; 8], bad: &mut bool| {
        let i = starts[k] + j;
        let base = if stride == 0 || j < stride {
            0
        } else {
            let p = (i - stride) * W;
            ctx_base[top::<W>(&dst[p..p + W])] as usize
        };
        let bits = peek(src, bit[k]);
        let (v, took) = element::<W>(bits, table[base + (bits & TABLE_MASK) as usize], bad);
        bit[k] += took;
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
    let mut j = lead;
    while j < common {
        // Steps that cannot take any stream's 8-byte reads past the end of `src`.
        let mut steps = common - j;
        for b in &bit[..S] {
            let room = src.len().saturating_sub((b >> 3) as usize + 8);
            steps = steps.min((room * 8 / max_bits).saturating_sub(1));
        }
        if steps == 0 {
            for k in 0..S {
                checked(k, j, dst, &mut bit, &mut bad);
            }
            j += 1;
            continue;
        }
        let (src_p, dst_p, table_p) = (src.as_ptr(), dst.as_mut_ptr(), table.as_ptr());
        for j in j..j + steps {
            for k in 0..S {
                // SAFETY: `j < common <= lens[k]`, so element `starts[k] + j` lies inside
                // `dst` (`n * W` bytes), and so does element `starts[k] + j - stride` when
                // stride is not 0 (`j >= lead = stride` then). Each stream is at most
                // `steps * max_bits` bits past `bit[k]`, which leaves more than 8 bytes before
                // the end of `src`, so the 8-byte read lies inside `src`. `ctx_base` holds
                // offsets of whole tables (asserted above) and the index adds less than
                // TABLE_LEN, so the entry lies inside `table`. The slices outlive the loop.
                unsafe {
                    let out = dst_p.add((starts[k] + j) * W);
                    let base = if stride == 0 {
                        0
                    } else {
                        let prev = out.sub(stride * W);
                        let t = if W == 2 {
                            (u16::from_le_bytes(prev.cast::<[u8; 2]>().read()) >> 7) as usize
                        } else {
                            (u32::from_le_bytes(prev.cast::<[u8; 4]>().read()) >> 23) as usize
                        };
                        *ctx_base.get_unchecked(t) as usize
                    };
                    let word = src_p.add((bit[k] >> 3) as usize).cast::<[u8; 8]>();
                    let bits = u64::from_le_bytes(word.read()) >> (bit[k] & 7);
                    let e = *table_p.add(base + (bits & TABLE_MASK) as usize);
                    let (v, took) = element::<W>(bits, e, &mut bad);
                    bit[k] += took;
                    if W == 2 {
                        out.cast::<[u8; 2]>().write((v as u16).to_le_bytes());
                    } else {
                        out.cast::<[u8; 4]>().write(v.to_le_bytes());
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
