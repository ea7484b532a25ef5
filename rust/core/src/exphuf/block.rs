//! One tensor's block (docs/FORMAT.md, codec `exp-huf`): its layout, shared by
//! [`block_encode`](super::block_encode) and [`block_decode`](super::block_decode).
//!
//! Elements are `W` bytes (2 or 4), little-endian. Each is sent as the Huffman code of its top 9
//! bits (sign and the next 8) in the table of its context, then its low `8W - 9` bits as they
//! are. The elements are cut into `streams` segments of consecutive elements, each coded into a
//! stream of its own: the decoder follows the streams side by side, so that their bit positions,
//! each a chain of dependent loads, advance in parallel. Within a segment, the context of an
//! element is picked by the symbol of the element `stride` before it (the same channel one row
//! back: the previous layer of `[tokens, layers, hidden]`, the previous token of
//! `[tokens, hidden]`), which predicts sign and exponent well in activations; the first
//! `stride` elements of a segment have context 0.

use super::huffman::{MAX_CODE_LEN, SYMBOLS};

/// Block mode: the tensor's bytes as they are.
pub const MODE_RAW: u8 = 0;
/// Block mode: coded.
pub const MODE_CODED: u8 = 1;
/// Contexts a block may have at most.
pub const MAX_CONTEXTS: usize = 16;
/// Stream counts a block may have.
pub const STREAM_COUNTS: [usize; 4] = [1, 2, 4, 8];
/// Bytes after the mode before the tables: contexts, streams, reserved u16, stride u32, and the
/// context map (a nibble per symbol).
pub const FIXED_LEN: usize = 8 + SYMBOLS / 2;
/// Entries of one context's decoding table.
pub const TABLE_LEN: usize = 1 << MAX_CODE_LEN;

/// The symbol of an element's top 9 bits `t` (sign, then 8 bits): the sign moves to the lowest
/// bit, so that the symbols of one exponent range are neighbours (short tables).
#[inline(always)]
pub fn symbol_of_top(t: usize) -> usize {
    ((t & 0xFF) << 1) | (t >> 8)
}

/// Inverse of [`symbol_of_top`].
#[inline(always)]
pub fn top_of_symbol(s: usize) -> usize {
    ((s & 1) << 8) | (s >> 1)
}

/// Bits of an element below its top 9.
pub const fn raw_bits<const W: usize>() -> u32 {
    8 * W as u32 - 9
}

/// The most bits one element takes in a stream.
pub const fn max_bits<const W: usize>() -> u32 {
    MAX_CODE_LEN + raw_bits::<W>()
}

/// Element range of segment `k` of `n` elements cut into `streams` segments.
pub fn segment(n: usize, streams: usize, k: usize) -> std::ops::Range<usize> {
    k * n / streams..(k + 1) * n / streams
}

/// The top 9 bits of a `W`-byte little-endian element given as its bytes.
#[inline(always)]
pub fn top<const W: usize>(b: &[u8]) -> usize {
    if W == 2 {
        (u16::from_le_bytes([b[0], b[1]]) >> 7) as usize
    } else {
        (u32::from_le_bytes([b[0], b[1], b[2], b[3]]) >> 23) as usize
    }
}

/// A `W`-byte little-endian element given as its bytes.
#[inline(always)]
pub fn value<const W: usize>(b: &[u8]) -> u32 {
    if W == 2 {
        u16::from_le_bytes([b[0], b[1]]) as u32
    } else {
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

/// The fixed part of a coded block after its mode byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    /// Number of contexts (1 to [`MAX_CONTEXTS`]).
    pub contexts: usize,
    /// Number of streams (one of [`STREAM_COUNTS`]).
    pub streams: usize,
    /// Distance in elements to the element that picks the context (0: none).
    pub stride: usize,
    /// Context of each symbol.
    pub context_of_symbol: [u8; SYMBOLS],
}

impl Head {
    /// Appends the encoded fixed part.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.push(self.contexts as u8);
        out.push(self.streams as u8);
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(&(self.stride as u32).to_le_bytes());
        for pair in self.context_of_symbol.chunks(2) {
            out.push(pair[0] | pair[1] << 4);
        }
    }

    /// Parses the fixed part (`FIXED_LEN` bytes).
    pub fn parse(b: &[u8]) -> Result<Head, String> {
        let (contexts, streams) = (b[0] as usize, b[1] as usize);
        if !(1..=MAX_CONTEXTS).contains(&contexts) {
            return Err(format!("block has {contexts} contexts (1 to 16 allowed)"));
        }
        if !STREAM_COUNTS.contains(&streams) {
            return Err(format!(
                "block has {streams} streams (1, 2, 4 or 8 allowed)"
            ));
        }
        if b[2] != 0 || b[3] != 0 {
            return Err("block's reserved bytes are not zero".into());
        }
        let stride = u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")) as usize;
        let mut context_of_symbol = [0u8; SYMBOLS];
        for (s, c) in context_of_symbol.iter_mut().enumerate() {
            *c = (b[8 + s / 2] >> (4 * (s % 2))) & 15;
            if *c as usize >= contexts {
                return Err(format!("context map names context {c} of {contexts}"));
            }
        }
        Ok(Head {
            contexts,
            streams,
            stride,
            context_of_symbol,
        })
    }
}

/// Appends one context's code lengths: first symbol (u16), count (u16), then a nibble per
/// symbol from the first on, low nibble first, the last byte's high nibble zero if unused.
pub fn write_lengths(lengths: &[u8; SYMBOLS], out: &mut Vec<u8>) {
    let first = lengths.iter().position(|&x| x > 0).unwrap_or(0);
    let end = lengths.iter().rposition(|&x| x > 0).map_or(0, |p| p + 1);
    let count = end.saturating_sub(first);
    out.extend_from_slice(&(first as u16).to_le_bytes());
    out.extend_from_slice(&(count as u16).to_le_bytes());
    for pair in lengths[first..end].chunks(2) {
        out.push(pair[0] | pair.get(1).copied().unwrap_or(0) << 4);
    }
}

/// Parses one context's code lengths at `*at` of `src`, advancing `*at`.
pub fn parse_lengths(src: &[u8], at: &mut usize) -> Result<[u8; SYMBOLS], String> {
    let fixed = src.get(*at..*at + 4).ok_or("block is cut off")?;
    let first = u16::from_le_bytes([fixed[0], fixed[1]]) as usize;
    let count = u16::from_le_bytes([fixed[2], fixed[3]]) as usize;
    if first + count > SYMBOLS {
        return Err(format!(
            "code lengths of symbols {first}..{} are out of range",
            first + count
        ));
    }
    let packed = src
        .get(*at + 4..*at + 4 + count.div_ceil(2))
        .ok_or("block is cut off")?;
    let mut lengths = [0u8; SYMBOLS];
    for j in 0..count {
        lengths[first + j] = (packed[j / 2] >> (4 * (j % 2))) & 15;
    }
    if count % 2 == 1 && packed[count / 2] >> 4 != 0 {
        return Err("code lengths' padding nibble is not zero".into());
    }
    *at += 4 + packed.len();
    Ok(lengths)
}

/// The 8 bytes of `src` from byte `p` on as a little-endian u64, zero past its end.
#[inline(always)]
pub fn read_u64(src: &[u8], p: usize) -> u64 {
    match src.get(p..p.saturating_add(8)) {
        Some(b) => u64::from_le_bytes(b.try_into().expect("8 bytes")),
        None => {
            let mut b = [0u8; 8];
            let rest = src.get(p..).unwrap_or(&[]);
            b[..rest.len()].copy_from_slice(rest);
            u64::from_le_bytes(b)
        }
    }
}

/// The next 57 or more bits of a stream from bit `bit` of `src` on, bounds checked (zero
/// past the end): what the decoders of both block modes look codes up by.
#[inline(always)]
pub fn peek(src: &[u8], bit: u64) -> u64 {
    read_u64(src, (bit >> 3) as usize) >> (bit & 7)
}
