//! The column encoder written the plainest way (tops gathered one at a time, counted along
//! each stream, codes pushed a byte at a time): what the encoder of
//! [`column_encode`](super::column_encode) must write byte for byte, whatever it does to be
//! fast (the GPU encoder and the shared vectors are checked against these bytes).

use super::block::{raw_bits, symbol_of_top, top, top_of_symbol, value, MAX_CONTEXTS};
use super::block_encode::context_map;
use super::column::{stream_columns, Head, MODE_COLUMNS};
use super::column_encode::Contexts;
use super::huffman::{self, SYMBOLS};

/// Appends the column block of `data`, as [`column_encode::encode`](super::column_encode::encode).
pub fn encode<const W: usize>(
    data: &[u8],
    columns: usize,
    streams: usize,
    ctx: Contexts,
    out: &mut Vec<u8>,
) {
    let n = data.len() / W;
    let rows = n / columns;
    let ctx_of_top = context_map(ctx.mode, ctx.exp_shift);
    let top_at = |c: usize, r: usize| top::<W>(&data[W * (r * columns + c)..]);
    // Each stream's (context, top) pairs, in stream order.
    let pairs: Vec<Vec<(usize, usize)>> = (0..streams)
        .map(|k| {
            let mut before: Option<usize> = None;
            let mut seq = Vec::new();
            for c in stream_columns(columns, streams, k) {
                for r in 0..rows {
                    let t = top_at(c, r);
                    seq.push((before.map_or(0, |p| ctx_of_top[p] as usize), t));
                    before = Some(t);
                }
            }
            seq
        })
        .collect();
    let mut counts = vec![[0u32; SYMBOLS]; MAX_CONTEXTS];
    for &(c, t) in pairs.iter().flatten() {
        counts[c][symbol_of_top(t)] += 1;
    }
    let lengths: Vec<[u8; SYMBOLS]> = counts.iter().map(huffman::code_lengths).collect();
    let codes: Vec<[u16; SYMBOLS]> = lengths.iter().map(huffman::reversed_codes).collect();

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
    let mut streams_out = Vec::new();
    for seq in &pairs {
        let mut bits = Vec::new();
        let mut w = BitWriter::default();
        for &(c, t) in seq {
            let s = symbol_of_top(t);
            w.put(codes[c][s] as u64, lengths[c][s] as u32, &mut bits);
        }
        w.finish(&mut bits);
        out.extend_from_slice(&(bits.len() as u64).to_le_bytes());
        streams_out.push(bits);
    }
    let r = raw_bits::<W>();
    let mut plane = Vec::new();
    let mut w = BitWriter::default();
    for x in data.chunks_exact(W) {
        w.put((value::<W>(x) & ((1 << r) - 1)) as u64, r, &mut plane);
    }
    w.finish(&mut plane);
    out.extend_from_slice(&plane);
    for bits in streams_out {
        out.extend_from_slice(&bits);
    }
}

/// Bits written least significant first, a byte pushed whenever 8 are held.
#[derive(Default)]
struct BitWriter {
    acc: u64,
    nbits: u32,
}

impl BitWriter {
    fn put(&mut self, c: u64, len: u32, out: &mut Vec<u8>) {
        self.acc |= c << self.nbits;
        self.nbits += len;
        while self.nbits >= 8 {
            out.push(self.acc as u8);
            self.acc >>= 8;
            self.nbits -= 8;
        }
    }

    fn finish(self, out: &mut Vec<u8>) {
        if self.nbits > 0 {
            out.push(self.acc as u8);
        }
    }
}
