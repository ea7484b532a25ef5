//! The heads of a batch of stored exp-huf payloads parsed for a decoder that runs elsewhere:
//! the Triton decoder of `layertap.gpu.exphuf_decode`, which copies the payloads to the GPU as
//! they are (back to back in one buffer) and decodes their streams there. What it needs of the
//! host is here, in flat arrays it uploads as they are: each record's tensors and where their
//! data will be, every block's code-length tables (checked: a prefix code each) and context
//! map, and one row per stream (a lane of its kernels) with the stream's bit range in the
//! device buffer. The checks are the core decoder's (the same `block::Head::parse`,
//! `block::parse_lengths`, [`check_lengths`](huffman::check_lengths), stream
//! and plane bounds, in the same order); what a stream holds is the kernels' to check.
//!
//! A batch of 64 records of a small model (`[256, 7, 384]` bf16) is parsed in well under a
//! millisecond here, where the Python parse it replaces took 7-30 ms, what bounded the
//! decoder's records a second for such records.

use super::block::{self, parse_lengths, segment, symbol_of_top, MODE_CODED, MODE_RAW};
use super::column::{self, stream_columns, MODE_COLUMNS};
use super::huffman::{self, SYMBOLS};
use super::{check_end, coded, MAX_RATIO};
use crate::blob;
use crate::dtype::Dtype;
use std::collections::BTreeMap;

/// One tensor of a record, and where the decoder puts its data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorPlace {
    /// Its name in the record.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions, outermost first.
    pub shape: Vec<u64>,
    /// 2 or 4 where a coded block's lanes decode it (into the output of elements of that many
    /// bytes); 0 where its bytes are copied as they are (other dtypes, raw blocks).
    pub width: usize,
    /// Its first element in the output of `width`-byte elements, or (width 0) its first byte
    /// in the output of copied bytes.
    pub start: u64,
}

/// One coded block (mode 1 or 2) of the batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodedBlock {
    /// The batch's index of its tensor (in [`BatchHeads::tensors`]).
    pub tensor: usize,
    /// Its context 0's table in [`BatchHeads::lengths`]; its other contexts follow.
    pub first_table: usize,
    /// Its number of contexts.
    pub contexts: usize,
    /// The context an element's top 9 bits (sign, 8 bits) pick, for the element that follows.
    pub context_of_top: [u8; SYMBOLS],
}

/// A stream of a block coded by element (mode 1): `[bit, end bit, out start, count, stride,
/// block, stream]`, its bits `[bit, end bit)` of the device buffer, its elements
/// `[out start, out start + count)` of the output of its width.
pub type ElementLane = [i64; 7];
/// A stream of a block coded by column (mode 2): `[bit, end bit, tops start, count, block,
/// stream, longest]`, its codes' tops `[tops start, tops start + count)` of the batch's tops
/// (column-major in its block), `longest` the count of its block's longest stream.
pub type ColumnLane = [i64; 7];
/// The merge of a block coded by column: `[raw plane's bit, tops start, out start, elements,
/// columns, rows]`.
pub type Merge = [i64; 6];

/// What the host parsed of a batch: everything a device decoder needs besides the bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchHeads {
    /// Per record: its `__metadata__`.
    pub metadata: Vec<BTreeMap<String, String>>,
    /// Per record `r`: its tensors are `tensors[record_tensors[r]..record_tensors[r + 1]]`.
    pub record_tensors: Vec<usize>,
    /// Every record's tensors in data order, the records' back to back.
    pub tensors: Vec<TensorPlace>,
    /// Every coded block's code-length tables, each a prefix code of lengths 0 to 11.
    pub lengths: Vec<[u8; SYMBOLS]>,
    /// The coded blocks, in the order of the records and their tensors.
    pub blocks: Vec<CodedBlock>,
    /// The streams of blocks coded by element, of 2-byte elements (`[0]`) and 4-byte ones.
    pub element_lanes: [Vec<ElementLane>; 2],
    /// The elements of the outputs of 2- and 4-byte elements (coded blocks of both modes).
    pub elements: [u64; 2],
    /// The streams of blocks coded by column, in block order.
    pub column_lanes: Vec<ColumnLane>,
    /// The blocks coded by column: `[block, first table, contexts]`.
    pub column_blocks: Vec<[i64; 3]>,
    /// The merges of blocks coded by column, of 2- and 4-byte elements.
    pub merges: [Vec<Merge>; 2],
    /// The tops of all blocks coded by column (their elements).
    pub tops: u64,
    /// The copies of bytes stored as they are: `[device byte, bytes, out byte]`.
    pub plain: Vec<[i64; 3]>,
    /// The bytes of the output of copies (each copy's start a multiple of 8).
    pub plain_bytes: u64,
}

/// Why a batch cannot be decoded: record `record` (of the batch) is not a valid exp-huf
/// payload, for `problem`'s reason (naming the tensor, and the context of a bad table).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("record {record} of the batch is not a valid exp-huf payload: {problem}")]
pub struct BatchProblem {
    /// The record's index in the batch.
    pub record: usize,
    /// What is wrong with it.
    pub problem: String,
}

/// Parses the batch of `payloads`, each a record's stored bytes (safetensors header, then its
/// tensors' blocks) and where it lies in the device's copy of the batch (its first byte's
/// offset there: lanes and copies are positions in that copy). `Err` names the first record
/// that is not a valid exp-huf payload and why.
pub fn parse_batch(payloads: &[(&[u8], u64)]) -> Result<BatchHeads, BatchProblem> {
    let mut batch = BatchHeads {
        record_tensors: vec![0],
        ..BatchHeads::default()
    };
    for (record, &(stored, base)) in payloads.iter().enumerate() {
        batch
            .parse_record(stored, base)
            .map_err(|problem| BatchProblem { record, problem })?;
    }
    Ok(batch)
}

/// The header of a stored payload (kept as it is before the blocks), checked for the blob its
/// data offsets give (no raw length is known here), and its length.
fn payload_header(stored: &[u8]) -> Result<(blob::BlobHeader, usize), String> {
    if stored.len() < 8 {
        return Err("payload shorter than a safetensors header".into());
    }
    let n = u64::from_le_bytes(stored[..8].try_into().expect("8 bytes"));
    if n > (stored.len() - 8) as u64 || n > blob::MAX_HEADER_LEN as u64 {
        return Err(format!(
            "safetensors header length {n} does not fit the payload"
        ));
    }
    let head_len = 8 + n as usize;
    let json = blob::header_json(&stored[8..head_len])?;
    // The blob ends where the tensor ending last does; the header's check then holds it to
    // that (a tensor with bad offsets is refused by it, whatever it made of the length here).
    let data_end = json
        .iter()
        .filter(|(name, _)| *name != "__metadata__")
        .filter_map(|(_, v)| v.get("data_offsets")?.as_array()?.get(1)?.as_u64())
        .max()
        .unwrap_or(0);
    let raw_len = head_len as u128 + data_end as u128;
    if raw_len > MAX_RATIO as u128 * stored.len() as u128 {
        return Err(format!(
            "raw length {raw_len} is more than {} stored bytes can decode to",
            stored.len()
        ));
    }
    Ok((
        blob::header_of_json(json, head_len, raw_len as usize)?,
        head_len,
    ))
}

/// A count or position as the arrays hold it (every one is below 2^63: payloads are in memory).
fn i(x: impl TryInto<i64>) -> i64 {
    x.try_into().ok().expect("a position in memory fits i64")
}

impl BatchHeads {
    fn parse_record(&mut self, stored: &[u8], base: u64) -> Result<(), String> {
        let (header, head_len) = payload_header(stored)?;
        let mut at = head_len;
        for t in &header.tensors {
            let size = t.range.len();
            let (width, start) = match coded(t.spec.dtype) {
                Some((w, _)) => self.block(stored, &mut at, base, size / w, w),
                None => match stored.get(at..at + size) {
                    Some(_) => {
                        at += size;
                        Ok((0, self.plain(base + (at - size) as u64, size)))
                    }
                    None => Err("payload is cut off".to_string()),
                },
            }
            .map_err(|e| format!("tensor {:?}: {e}", t.spec.name))?;
            self.tensors.push(TensorPlace {
                name: t.spec.name.clone(),
                dtype: t.spec.dtype,
                shape: t.spec.shape.clone(),
                width,
                start,
            });
        }
        check_end(stored, at)?;
        self.metadata.push(header.metadata);
        self.record_tensors.push(self.tensors.len());
        Ok(())
    }

    /// A copy of `len` bytes from byte `from` of the device buffer: where it lands.
    fn plain(&mut self, from: u64, len: usize) -> u64 {
        let out = self.plain_bytes;
        self.plain.push([i(from), i(len), i(out)]);
        self.plain_bytes += crate::format::align8(len as u64);
        out
    }

    /// The block at `*at` of `src` (device offset `base`) of the tensor being parsed, of `n`
    /// elements of `w` bytes: `*at` moves past it. Returns where its data will be (as
    /// [`TensorPlace`]'s `width` and `start`).
    fn block(
        &mut self,
        src: &[u8],
        at: &mut usize,
        base: u64,
        n: usize,
        w: usize,
    ) -> Result<(usize, u64), String> {
        let mode = *src.get(*at).ok_or("block is cut off")?;
        match mode {
            MODE_RAW => {
                let from = *at + 1;
                src.get(from..from + n * w).ok_or("raw block is cut off")?;
                *at = from + n * w;
                Ok((0, self.plain(base + from as u64, n * w)))
            }
            MODE_CODED => self.by_element(src, at, base, n, w),
            MODE_COLUMNS => self.by_column(src, at, base, n, w),
            m => Err(format!("block mode {m} is unknown")),
        }
    }

    /// The code-length tables of a block's `contexts` at `*p` of `src`, checked (`*p` moves
    /// past them), and its context map: the block's entry in [`BatchHeads::blocks`], whose
    /// index this returns.
    fn tables(
        &mut self,
        src: &[u8],
        p: &mut usize,
        contexts: usize,
        context_of_symbol: &[u8; SYMBOLS],
    ) -> Result<usize, String> {
        let first_table = self.lengths.len();
        for c in 0..contexts {
            let at = *p;
            let lengths = parse_lengths(src, p).map_err(|e| format!("context {c}: {e}"))?;
            // Only the symbols the table gives (parse_lengths read and bounded them), tens of
            // the 512: the others are 0, and checking them was half this parse's time.
            let first = u16::from_le_bytes([src[at], src[at + 1]]) as usize;
            let count = u16::from_le_bytes([src[at + 2], src[at + 3]]) as usize;
            huffman::check_lengths(&lengths[first..first + count])
                .map_err(|e| format!("context {c}: {e}"))?;
            self.lengths.push(lengths);
        }
        self.blocks.push(CodedBlock {
            tensor: self.tensors.len(),
            first_table,
            contexts,
            context_of_top: std::array::from_fn(|t| context_of_symbol[symbol_of_top(t)]),
        });
        Ok(self.blocks.len() - 1)
    }

    /// The stream lengths at `*p` of `src`, `streams` of them, each inside the payload after
    /// them and `skip` more bytes (mode 2's raw plane): their ends from the first stream's
    /// start, and where that is.
    fn stream_ends(
        src: &[u8],
        p: usize,
        streams: usize,
        skip: usize,
    ) -> Result<(Vec<usize>, usize), String> {
        let lens = src
            .get(p..p.saturating_add(8 * streams))
            .ok_or("block is cut off")?;
        let first = (p + 8 * streams)
            .checked_add(skip)
            .filter(|&e| e <= src.len())
            .ok_or("the raw plane runs past the payload")?;
        let mut ends = Vec::with_capacity(streams);
        let mut next = first;
        for len in lens.chunks_exact(8) {
            let len = u64::from_le_bytes(len.try_into().expect("8 bytes"));
            next += usize::try_from(len)
                .ok()
                .filter(|&l| l <= src.len() - next)
                .ok_or("a stream runs past the payload")?;
            ends.push(next - first);
        }
        Ok((ends, first))
    }

    /// A block coded by element (mode 1) whose mode byte is at `*at`.
    fn by_element(
        &mut self,
        src: &[u8],
        at: &mut usize,
        base: u64,
        n: usize,
        w: usize,
    ) -> Result<(usize, u64), String> {
        let fixed = src
            .get(*at + 1..*at + 1 + block::FIXED_LEN)
            .ok_or("block is cut off")?;
        let head = block::Head::parse(fixed)?;
        let mut p = *at + 1 + block::FIXED_LEN;
        let b = self.tables(src, &mut p, head.contexts, &head.context_of_symbol)?;
        let (ends, first) = Self::stream_ends(src, p, head.streams, 0)?;
        let start = self.elements[w / 4];
        let mut from = first;
        for (k, &end) in ends.iter().enumerate() {
            let seg = segment(n, head.streams, k);
            let bit = 8 * (base + from as u64);
            let to = first + end;
            self.element_lanes[w / 4].push([
                i(bit),
                i(bit + 8 * (to - from) as u64),
                i(start + seg.start as u64),
                i(seg.len()),
                i(head.stride),
                i(b),
                i(k),
            ]);
            from = to;
        }
        self.elements[w / 4] += n as u64;
        *at = from;
        Ok((w, start))
    }

    /// A block coded by column (mode 2) whose mode byte is at `*at`.
    fn by_column(
        &mut self,
        src: &[u8],
        at: &mut usize,
        base: u64,
        n: usize,
        w: usize,
    ) -> Result<(usize, u64), String> {
        let fixed = src
            .get(*at + 1..*at + 1 + column::FIXED_LEN)
            .ok_or("block is cut off")?;
        let head = column::Head::parse(fixed, n)?;
        let mut p = *at + 1 + column::FIXED_LEN;
        let b = self.tables(src, &mut p, head.contexts, &head.context_of_symbol)?;
        let raw_bits = (8 * w - 9) as u64;
        let plane_bits = n as u64 * raw_bits;
        let plane_len = usize::try_from(plane_bits.div_ceil(8)).unwrap_or(usize::MAX);
        let (ends, first) = Self::stream_ends(src, p, head.streams, plane_len)?;
        if !plane_bits.is_multiple_of(8) && src[first - 1] >> (plane_bits % 8) != 0 {
            return Err("the raw plane's padding bits are not zero".into());
        }
        let rows = n / head.columns;
        let lanes_from = self.column_lanes.len();
        let mut longest = 0;
        let mut from = first;
        for (k, &end) in ends.iter().enumerate() {
            let columns = stream_columns(head.columns, head.streams, k);
            let count = columns.len() * rows;
            longest = longest.max(count);
            let to = first + end;
            self.column_lanes.push([
                i(8 * (base + from as u64)),
                i(8 * (base + to as u64)),
                i(columns.start as u64 * rows as u64 + self.tops),
                i(count),
                i(b),
                i(k),
                0,
            ]);
            from = to;
        }
        for lane in &mut self.column_lanes[lanes_from..] {
            lane[6] = i(longest);
        }
        let first_table = self.blocks[b].first_table;
        self.column_blocks
            .push([i(b), i(first_table), i(head.contexts)]);
        let start = self.elements[w / 4];
        let plane_at = first - plane_len;
        self.merges[w / 4].push([
            i(8 * (base + plane_at as u64)),
            i(self.tops),
            i(start),
            i(n),
            i(head.columns),
            i(rows),
        ]);
        self.tops += n as u64;
        self.elements[w / 4] += n as u64;
        *at = from;
        Ok((w, start))
    }
}

#[cfg(test)]
mod tests;
