//! The decoder of a block (layout in [`block`](super::block)). It checks everything it reads:
//! counts, context map, code lengths (a prefix code), stream lengths, that every stream holds
//! exactly the bits its elements take, with zero padding, and that no bit pattern without a
//! code is met.

use super::block::{
    max_bits, parse_lengths, peek, raw_bits, segment, symbol_of_top, top, top_of_symbol, Head,
    FIXED_LEN, MODE_CODED, MODE_RAW, TABLE_LEN,
};
use super::huffman::{self, SYMBOLS};

const TABLE_MASK: u64 = TABLE_LEN as u64 - 1;
/// Table entry of bit patterns that start no code: code length 0 (the element takes only its
/// raw bits, so positions stay bounded) and bit 4 set, which no entry of a code has (lengths are
/// at most 11 and the value starts at bit 7), so that the fast loop ORs its entries together and
/// tests one bit per run of elements instead of one compare per element.
const NO_CODE: u16 = 16;

/// Decodes the block at `*at` of `src` into `dst` (the tensor's bytes, `W`-byte elements),
/// advancing `*at` past it; a block coded by column on up to `threads` threads (the caller's
/// among them). `Err` says what is wrong.
pub fn decode<const W: usize>(
    src: &[u8],
    at: &mut usize,
    dst: &mut [u8],
    threads: usize,
) -> Result<(), String> {
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
        super::column::MODE_COLUMNS => super::column_decode::decode::<W>(src, at, dst, threads),
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
    // Entries are u16 (`top << 7 | code length`, or NO_CODE), so that the tables of the
    // contexts in use stay in L1 (16 contexts of 2,048 u32 entries are 128 KiB).
    let mut table = vec![0u16; head.contexts * TABLE_LEN];
    for (c, t) in table.chunks_exact_mut(TABLE_LEN).enumerate() {
        let lengths = parse_lengths(src, at).map_err(|e| format!("context {c}: {e}"))?;
        huffman::check_lengths(&lengths).map_err(|e| format!("context {c}: {e}"))?;
        huffman::fill_decode_table(
            &lengths,
            |s, len| (top_of_symbol(s) as u16) << 7 | len as u16,
            t,
        );
        for e in t.iter_mut().filter(|e| **e == 0) {
            *e = NO_CODE;
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
        1 => pick::<W, 1>(),
        2 => pick::<W, 2>(),
        4 => pick::<W, 4>(),
        _ => pick::<W, 8>(),
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

/// The element of table entry `e` (`top << 7 | len`) followed by its raw bits `raw`.
#[inline(always)]
fn value<const W: usize>(e: u32, raw: u32) -> u32 {
    if W == 2 {
        (e & !0x7F) | raw
    } else {
        (e >> 7) << raw_bits::<W>() | raw
    }
}

/// One element from `bits` (the stream's next bits) and its table entry `e`: the element and
/// how many bits it took. An entry without a code (length 0) takes only the raw bits and sets
/// `bad`.
#[inline(always)]
fn element<const W: usize>(bits: u64, e: u32, bad: &mut bool) -> (u32, u64) {
    let r = raw_bits::<W>();
    let len = e & 15;
    *bad |= len == 0;
    let raw_mask = (1u32 << r) - 1;
    (
        value::<W>(e, (bits >> len) as u32 & raw_mask),
        (len + r) as u64,
    )
}

/// The signature of [`run`].
type Run = fn(&[u8], &[u16], &[u32; SYMBOLS], usize, &mut [u8], &[usize; 8]) -> ([u64; 8], bool);

/// [`run`] compiled for BMI2 where the CPU has it: its shifts by a register (`shrx`) take any
/// register for the count, where the baseline's take only `cl`, which cost a move per shift and
/// registers that the streams' state then spills for.
fn pick<const W: usize, const S: usize>() -> Run {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("bmi2") {
        return |src, table, ctx_base, stride, dst, bases| {
            // SAFETY: the CPU has BMI2 (detected above).
            unsafe { run_bmi2::<W, S>(src, table, ctx_base, stride, dst, bases) }
        };
    }
    run::<W, S>
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "bmi2")]
fn run_bmi2<const W: usize, const S: usize>(
    src: &[u8],
    table: &[u16],
    ctx_base: &[u32; SYMBOLS],
    stride: usize,
    dst: &mut [u8],
    bases: &[usize; 8],
) -> ([u64; 8], bool) {
    run::<W, S>(src, table, ctx_base, stride, dst, bases)
}

/// Decodes the elements of `dst` from the `S` streams starting at bytes `bases` of `src`.
/// Returns each stream's end bit position, and whether a bit pattern without a code was met.
/// `table` holds `TABLE_LEN` entries per context, `ctx_base` offsets of whole tables in it.
#[inline(always)]
fn run<const W: usize, const S: usize>(
    src: &[u8],
    table: &[u16],
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
        let (v, took) = element::<W>(bits, table[base + (bits & TABLE_MASK) as usize] as u32, bad);
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
    // first `common` has its context element in its own segment (or stride is 0). The streams
    // are decoded side by side, element `j` of each in turn, so that their chains (entry, code
    // length, shift) overlap. Each stream's next bits are held in a register (`buf`, `nb` of
    // them valid) refilled by one unaligned 8-byte load per `group` elements (bf16: 3 of at
    // most 18 bits in the 56 a refill guarantees), the way of F. Giesen's "reading bits in far
    // too many ways", variant 4: the bits above `nb` are the stream's next ones too, so the
    // refill ORs in what is already there. Position `8 * ptr - nb` is the stream's bit.
    let max_bits = max_bits::<W>() as usize;
    let group = 56 / max_bits;
    let r = raw_bits::<W>();
    let raw_mask = (1u64 << r) - 1;
    let mut j = lead;
    while j < common {
        // Groups that cannot take any stream's 8-byte reads past the end of `src`: a read is
        // at most 8 bytes past the stream's position, which is less than 16 bytes before the
        // end of `src` at the last group's refill.
        let mut groups = (common - j) / group;
        for b in &bit[..S] {
            let room = src.len().saturating_sub((b >> 3) as usize + 16);
            groups = groups.min((room * 8 / (max_bits * group)).saturating_sub(1));
        }
        if groups == 0 {
            for k in 0..S {
                checked(k, j, dst, &mut bit, &mut bad);
            }
            j += 1;
            continue;
        }
        let (src_p, dst_p, table_p) = (src.as_ptr(), dst.as_mut_ptr(), table.as_ptr());
        let read = |p: usize| {
            // SAFETY: every `p` read below is at most 8 bytes past its stream's position, which
            // is at least 16 bytes before the end of `src` (`groups` above), so the 8 bytes lie
            // inside `src`.
            u64::from_le_bytes(unsafe { src_p.add(p).cast::<[u8; 8]>().read() })
        };
        let mut ptr = [0usize; S];
        let mut buf = [0u64; S];
        let mut nb = [0u64; S];
        // f32 (a group of 1) reads its 8 bytes at the bit position for each element instead:
        // that is one load and shift, where a refill is two shifts, an add and an OR more.
        let mut pos = bit;
        for k in 0..S {
            let (p, o) = ((bit[k] >> 3) as usize, bit[k] & 7);
            buf[k] = read(p) >> o;
            ptr[k] = p + 7;
            nb[k] = 56 - o;
        }
        let mut seen = 0u32;
        for g in 0..groups {
            for k in 0..S {
                if W == 2 {
                    buf[k] |= read(ptr[k]) << nb[k];
                    ptr[k] += ((63 - nb[k]) >> 3) as usize;
                    nb[k] = (nb[k] | 56) - group as u64 * r as u64;
                } else {
                    buf[k] = read((pos[k] >> 3) as usize) >> (pos[k] & 7);
                }
            }
            for i in 0..group {
                let j = j + g * group + i;
                for k in 0..S {
                    // SAFETY: `j < common <= lens[k]`, so element `starts[k] + j` lies inside
                    // `dst` (`n * W` bytes), and so does element `starts[k] + j - stride` when
                    // stride is not 0 (`j >= lead = stride` then). `ctx_base` holds offsets of
                    // whole tables (asserted above) and the index adds less than TABLE_LEN, so
                    // the entry lies inside `table`. The slices outlive the loop.
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
                        let e = *table_p.add(base + (buf[k] & TABLE_MASK) as usize) as u32;
                        seen |= e;
                        let len = (e & 15) as u64;
                        // The code, then the raw bits, leave the buffer by two shifts; the
                        // raw bits' part of `nb` is taken once a group, below.
                        buf[k] >>= len;
                        let v = value::<W>(e, (buf[k] & raw_mask) as u32);
                        buf[k] >>= r;
                        if W == 2 {
                            nb[k] -= len;
                        } else {
                            pos[k] += len + r as u64;
                        }
                        if W == 2 {
                            out.cast::<[u8; 2]>().write((v as u16).to_le_bytes());
                        } else {
                            out.cast::<[u8; 4]>().write(v.to_le_bytes());
                        }
                    }
                }
            }
        }
        for k in 0..S {
            bit[k] = if W == 2 {
                8 * ptr[k] as u64 - nb[k]
            } else {
                pos[k]
            };
        }
        j += groups * group;
        if seen & NO_CODE as u32 != 0 {
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
