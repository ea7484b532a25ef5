//! A plain decoder of column blocks, written from docs/FORMAT.md ("Mode 2, coded by column")
//! alone: element by element, a bounds-checked read of the stream for each code, the raw bits
//! read from the plane one element at a time. Tests hold the fast decoder
//! ([`column_decode`](super::column_decode)) to it, damaged blocks included.

use super::block::{parse_lengths, raw_bits, top_of_symbol};
use super::column::{stream_columns, Head, FIXED_LEN};
use super::huffman::{self, MAX_CODE_LEN};
use std::collections::HashMap;

/// Bit `bit` on of `src` (zero past its end), 64 bits.
fn bits_at(src: &[u8], bit: u64) -> u64 {
    let mut b = [0u8; 8];
    for (i, x) in b.iter_mut().enumerate() {
        *x = src.get((bit >> 3) as usize + i).copied().unwrap_or(0);
    }
    u64::from_le_bytes(b) >> (bit & 7)
}

/// Decodes the column block whose mode byte was read (`*at` past it) into `dst`.
pub fn decode<const W: usize>(src: &[u8], at: &mut usize, dst: &mut [u8]) -> Result<(), String> {
    let n = dst.len() / W;
    let fixed = src.get(*at..*at + FIXED_LEN).ok_or("block is cut off")?;
    let head = Head::parse(fixed, n)?;
    *at += FIXED_LEN;
    // Per context: the symbol of each (code length, code as read) pair.
    let mut tables = Vec::new();
    for c in 0..head.contexts {
        let lengths = parse_lengths(src, at).map_err(|e| format!("context {c}: {e}"))?;
        huffman::check_lengths(&lengths).map_err(|e| format!("context {c}: {e}"))?;
        let codes = huffman::reversed_codes(&lengths);
        let t: HashMap<(u8, u16), usize> = (0..lengths.len())
            .filter(|&s| lengths[s] > 0)
            .map(|s| ((lengths[s], codes[s]), s))
            .collect();
        tables.push(t);
    }
    let s_count = head.streams;
    let lens = src.get(*at..*at + 8 * s_count).ok_or("block is cut off")?;
    let r = raw_bits::<W>() as u64;
    let plane_at = *at + 8 * s_count;
    let plane_len = ((n as u64 * r).div_ceil(8)) as usize;
    if plane_at + plane_len > src.len() {
        return Err("the raw plane runs past the payload".into());
    }
    let mut next = plane_at + plane_len;
    let rows = n / head.columns;
    let mut tops = vec![0usize; n];
    for k in 0..s_count {
        let len = u64::from_le_bytes(lens[8 * k..8 * k + 8].try_into().expect("8 bytes"));
        if len > (src.len() - next) as u64 {
            return Err("a stream runs past the payload".into());
        }
        let (base, len) = (next, len as usize);
        let stream = &src[..base + len];
        let mut bit = 8 * base as u64;
        let mut ctx = 0usize;
        let cols = stream_columns(head.columns, s_count, k);
        for j in 0..cols.len() * rows {
            let i = (j % rows) * head.columns + cols.start + j / rows;
            let next = bits_at(stream, bit);
            let (s, l) = (1..=MAX_CODE_LEN as u8)
                .find_map(|l| {
                    let code = (next & ((1 << l) - 1)) as u16;
                    tables[ctx].get(&(l, code)).map(|&s| (s, l))
                })
                .ok_or("a stream holds a bit pattern that is no code")?;
            bit += l as u64;
            tops[i] = top_of_symbol(s);
            ctx = head.context_of_symbol[s] as usize;
        }
        let used = bit - 8 * base as u64;
        if used.div_ceil(8) != len as u64 {
            return Err(format!(
                "stream {k} holds {len} bytes but its elements take {used} bits"
            ));
        }
        if !used.is_multiple_of(8) && src[base + len - 1] >> (used % 8) != 0 {
            return Err(format!("stream {k}: padding bits are not zero"));
        }
        next = base + len;
    }
    let plane = &src[plane_at..plane_at + plane_len];
    if !(n as u64 * r).is_multiple_of(8) && plane[plane_len - 1] >> ((n as u64 * r) % 8) != 0 {
        return Err("the raw plane's padding bits are not zero".into());
    }
    for (i, t) in tops.iter().enumerate() {
        let raw = bits_at(plane, i as u64 * r) & ((1 << r) - 1);
        let v = (*t as u64) << r | raw;
        dst[i * W..i * W + W].copy_from_slice(&v.to_le_bytes()[..W]);
    }
    *at = next;
    Ok(())
}
