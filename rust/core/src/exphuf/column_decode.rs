//! The decoder of a column block (layout in [`column`](super::column)). It checks everything
//! it reads: the head, the code lengths (a prefix code each), the stream lengths, that every
//! stream holds exactly the bits its elements' codes take with zero padding, that no bit
//! pattern without a code is met, and the raw plane's padding.
//!
//! Decoding runs in two passes. The streams are decoded into the tops of the elements in stream
//! order (`scratch`, column by column), several streams side by side so that their chains
//! overlap (four in general registers; 32 in four AVX-512 vectors where the CPU has it and the
//! block has as many streams), each step resolving up to three codes with one lookup in a table
//! of the current context ([`Tables`]); then the tops are put back in row order with the raw
//! plane's bits.

use super::block::{parse_lengths, peek, raw_bits, read_u64, symbol_of_top, top_of_symbol};
use super::column::{stream_columns, Head, FIXED_LEN};
use super::huffman::{self, MAX_CODE_LEN, SYMBOLS};
use crate::parallel::in_parts;

/// Entries of one context's tables: indexed by the stream's next `MAX_CODE_LEN` bits.
const TABLE_LEN: usize = 1 << MAX_CODE_LEN;
const MASK: u64 = TABLE_LEN as u64 - 1;
/// Blocks of fewer elements take one code a lookup in the side-by-side loop, from the tables
/// of single codes: building entries of up to three codes costs about 170 us a block here,
/// most of a block of 100,000 elements' decoding. (Tests take both from small blocks on.)
const MULTI_MIN: usize = if cfg!(test) { 2000 } else { 1 << 17 };
/// Codes one step of the multi-code loop resolves at most, and steps between refills (each
/// takes at most MAX_CODE_LEN bits of the 56 a refill guarantees).
const PER_STEP: usize = 3;
const STEPS: usize = (56 / MAX_CODE_LEN) as usize;
/// Streams decoded side by side: in general registers, and with AVX-512 (one stream a 64-bit
/// lane of a vector).
const LANES: usize = 4;
const WIDE: usize = 32;

/// Multi-code entry fields: three tops (16 bits each), then the count of codes, the bits they
/// take and the context after them (5 bits: one more than a block has, [`BAD_CONTEXT`]).
const CNT_AT: u32 = 48;
const BITS_AT: u32 = 50;
const CTX_AT: u32 = 54;
/// The context a stream enters at a bit pattern that starts no code, and never leaves (each of
/// its entries takes one bit and one top, so that the loop moves on): the side-by-side loop
/// tells a bad stream by its context at the end, with nothing to test per code. A context
/// without codes counts as this one: only a stream's last code can lead into it (no code could
/// follow), and the loop stops short of the last codes.
const BAD_CONTEXT: usize = 16;
/// The top of [`BAD_CONTEXT`]'s entries (no element's: tops are below 512).
const BAD_TOP: usize = SYMBOLS;
/// A single-code entry of a bit pattern that starts no code: [`BAD_TOP`], one bit.
const BAD_SINGLE: u16 = (BAD_TOP << 4) as u16 | 1;

/// The tables of one block: per context and then [`BAD_CONTEXT`], `single` (`top << 4 | code
/// length`, [`BAD_SINGLE`] where no code starts) and, for large blocks, `multi` (up to
/// [`PER_STEP`] codes an entry); `ctx_code`, the context after each top (and [`BAD_TOP`]).
struct Tables {
    single: Vec<u16>,
    multi: Vec<u64>,
    ctx_code: [u64; SYMBOLS + 1],
}

/// The value a top takes in `scratch`: already in place for 2-byte elements, so that putting
/// rows back is an OR with the raw bits.
#[inline(always)]
fn lane<const W: usize>(top: u64) -> u64 {
    if W == 2 {
        top << raw_bits::<2>()
    } else {
        top
    }
}

/// An entry of [`BAD_CONTEXT`].
fn bad_entry() -> u64 {
    1 << CNT_AT | 1 << BITS_AT | (BAD_CONTEXT as u64) << CTX_AT
}

impl Tables {
    /// The side-by-side loop's entry of one code for context `ctx` (times TABLE_LEN) and next
    /// bits `bits`, read from `single` as the loop goes.
    #[inline(always)]
    fn single_entry<const W: usize>(&self, ctx: usize, bits: u64) -> u64 {
        let e = self.single[ctx + (bits & MASK) as usize] as u64;
        let t = e >> 4;
        lane::<W>(t) | 1 << CNT_AT | (e & 15) << BITS_AT | self.ctx_code[t as usize] << CTX_AT
    }

    /// The side-by-side loop's entry of up to three codes for context `c` and next bits `x`:
    /// the codes in the bits read, as long as each leads into a context with codes. (A version
    /// without branches on the codes measured slower: neighbouring entries share their first
    /// codes, so the branches are well predicted.)
    #[cfg(test)]
    fn multi_entry<const W: usize>(&self, c: usize, x: usize) -> u64 {
        let (mut ctx, mut used, mut cnt, mut lanes) = (c as u64, 0u64, 0u64, 0u64);
        while cnt < PER_STEP as u64 {
            // Bits above the `MAX_CODE_LEN - used` still unread are zero here, which picks the
            // right entry for every code that fits in those read.
            let e = self.single[ctx as usize * TABLE_LEN + ((x >> used) & MASK as usize)] as u64;
            let (t, len) = (e >> 4, e & 15);
            if t as usize == BAD_TOP || used + len > MAX_CODE_LEN as u64 {
                break;
            }
            lanes |= lane::<W>(t) << (16 * cnt);
            used += len;
            cnt += 1;
            ctx = self.ctx_code[t as usize];
            if ctx as usize == BAD_CONTEXT {
                break;
            }
        }
        if cnt == 0 {
            return bad_entry();
        }
        lanes | cnt << CNT_AT | used << BITS_AT | ctx << CTX_AT
    }
}

/// A context's single-code table `t` from its code lengths (checked).
fn fill_single(lengths: &[u8; SYMBOLS], t: &mut [u16]) {
    huffman::fill_decode_table(
        lengths,
        |s, len| (top_of_symbol(s) << 4) as u16 | len as u16,
        t,
    );
    for e in t.iter_mut().filter(|e| **e == 0) {
        *e = BAD_SINGLE;
    }
}

/// Where the tails of budget `budget` start in a context's part of the tails table: budgets 0
/// to `MAX_CODE_LEN - 1` take 2^budget entries each, 2^MAX_CODE_LEN - 1 in all.
#[inline(always)]
fn tails_at(budget: u64) -> usize {
    (1 << budget) - 1
}

impl Tables {
    /// The codes after the first of a multi-code entry: up to `PER_STEP - 1` codes from context
    /// `d` in the bits `y` (below 2^`budget`), with their tops in the lanes after the first,
    /// their count, the bits they take and the context after them (`d` where there are none).
    /// Added to a first code's fields, it gives [`Tables::multi_entry`] of the bits that code
    /// starts with `y` above it and `budget` the bits it leaves.
    fn tail_entry<const W: usize>(&self, d: usize, budget: u64, y: usize) -> u64 {
        let (mut ctx, mut used, mut cnt, mut lanes) = (d as u64, 0u64, 0u64, 0u64);
        while cnt < PER_STEP as u64 - 1 && ctx as usize != BAD_CONTEXT {
            let e = self.single[ctx as usize * TABLE_LEN + (y >> used)] as u64;
            let (t, len) = (e >> 4, e & 15);
            if t as usize == BAD_TOP || used + len > budget {
                break;
            }
            lanes |= lane::<W>(t) << (16 * (cnt + 1));
            used += len;
            cnt += 1;
            ctx = self.ctx_code[t as usize];
        }
        lanes | cnt << CNT_AT | used << BITS_AT | ctx << CTX_AT
    }

    /// Context `d`'s tails (`TABLE_LEN` entries, budget `b`'s at [`tails_at`]`(b)`): the
    /// longest budget's from the tops of `single`, each shorter one's from the next longer
    /// one's, dropping the codes that run past the budget.
    fn fill_tails<const W: usize>(&self, d: usize, tails: &mut [u64]) {
        let top = MAX_CODE_LEN as u64 - 1;
        for (y, e) in tails[tails_at(top)..][..1 << top].iter_mut().enumerate() {
            *e = self.tail_entry::<W>(d, top, y);
        }
        for b in (0..top).rev() {
            let (short, long) = tails.split_at_mut(tails_at(b + 1));
            for (y, e) in short[tails_at(b)..].iter_mut().enumerate() {
                let l = long[y];
                // Within the budget as it is (the common case), or one code less and so on:
                // recomputed, few entries of a budget hold codes past it.
                *e = if (l >> BITS_AT) & 15 <= b {
                    l
                } else {
                    self.tail_entry::<W>(d, b, y)
                };
            }
        }
    }

    /// Context `c`'s multi-code entries (`entries`, `TABLE_LEN`, bad where they start no
    /// code): for each first code, in every pattern that starts with it, its fields plus the
    /// tail of the context it leads into, read from the bits above it.
    fn fill_multi<const W: usize>(&self, c: usize, tails: &[u64], entries: &mut [u64]) {
        let single = &self.single[c * TABLE_LEN..][..TABLE_LEN];
        for (p, &e) in single.iter().enumerate() {
            let (t, len) = ((e >> 4) as usize, (e & 15) as u64);
            // A code's own pattern is the one without bits above it; the others repeat it.
            if t == BAD_TOP || p >> len != 0 {
                continue;
            }
            let first = lane::<W>(t as u64) | 1 << CNT_AT | len << BITS_AT;
            let budget = MAX_CODE_LEN as u64 - len;
            let d = self.ctx_code[t] as usize;
            let tail = &tails[d * TABLE_LEN + tails_at(budget)..][..1 << budget];
            for (y, &rest) in tail.iter().enumerate() {
                entries[p | y << len] = first + rest;
            }
        }
    }

    /// The multi-code tables of a block whose contexts with codes are `has_codes`, each
    /// context's tails and then its entries on a thread of their own where there are several.
    /// The entries equal [`Tables::multi_entry`]'s (tested), built as a tail lookup and an add
    /// each instead of up to three dependent lookups with branches (about 0.7x its time on
    /// tables like activations'). With several threads the tails, then the entries, are split
    /// by context.
    fn build_multi<const W: usize>(
        &self,
        has_codes: &[bool; BAD_CONTEXT],
        threads: usize,
    ) -> Vec<u64> {
        // The block's contexts with codes (the others stay bad), then BAD_CONTEXT's table.
        let mut multi = vec![bad_entry(); (BAD_CONTEXT + 1) * TABLE_LEN];
        // BAD_CONTEXT's tails hold no code (a first code leading into it stands alone);
        // contexts without codes are never led into.
        let mut tails = vec![(BAD_CONTEXT as u64) << CTX_AT; (BAD_CONTEXT + 1) * TABLE_LEN];
        let used = |c: &usize| *c < BAD_CONTEXT && has_codes[*c];
        let contexts = (0..BAD_CONTEXT).filter(used).count();
        let per = contexts.div_ceil(threads.clamp(1, contexts.max(1))).max(1);
        let mut todo: Vec<(usize, &mut [u64])> = tails
            .chunks_exact_mut(TABLE_LEN)
            .enumerate()
            .filter(|(c, _)| used(c))
            .collect();
        in_parts(&mut todo, per, |(c, t)| self.fill_tails::<W>(*c, t));
        let tails = &tails;
        let mut todo: Vec<(usize, &mut [u64])> = multi
            .chunks_exact_mut(TABLE_LEN)
            .enumerate()
            .filter(|(c, _)| used(c))
            .collect();
        in_parts(&mut todo, per, |(c, e)| self.fill_multi::<W>(*c, tails, e));
        multi
    }
}

/// Decodes the column block whose mode byte was just read (`*at` is past it) into `dst` (the
/// tensor's bytes, `W`-byte elements), advancing `*at` past the block, on up to `threads`
/// threads (the caller's among them; a block gives each at least [`STREAMS_A_THREAD`] streams
/// and [`ROWS_A_THREAD`] rows). `Err` says what is wrong.
pub fn decode<const W: usize>(
    src: &[u8],
    at: &mut usize,
    dst: &mut [u8],
    threads: usize,
) -> Result<(), String> {
    let n = dst.len() / W;
    let fixed = src.get(*at..*at + FIXED_LEN).ok_or("block is cut off")?;
    let head = Head::parse(fixed, n)?;
    *at += FIXED_LEN;
    let mut tables = Tables {
        single: vec![BAD_SINGLE; (BAD_CONTEXT + 1) * TABLE_LEN],
        multi: Vec::new(),
        ctx_code: [BAD_CONTEXT as u64; SYMBOLS + 1],
    };
    let mut has_codes = [false; BAD_CONTEXT];
    for (c, t) in tables.single[..head.contexts * TABLE_LEN]
        .chunks_exact_mut(TABLE_LEN)
        .enumerate()
    {
        let lengths = parse_lengths(src, at).map_err(|e| format!("context {c}: {e}"))?;
        huffman::check_lengths(&lengths).map_err(|e| format!("context {c}: {e}"))?;
        has_codes[c] = lengths.iter().any(|&l| l > 0);
        fill_single(&lengths, t);
    }
    for t in 0..SYMBOLS {
        let c = head.context_of_symbol[symbol_of_top(t)] as usize;
        if has_codes[c] {
            tables.ctx_code[t] = c as u64;
        }
    }

    let streams = head.streams;
    let lens = src.get(*at..*at + 8 * streams).ok_or("block is cut off")?;
    let plane_at = *at + 8 * streams;
    let plane_len = (n as u64 * raw_bits::<W>() as u64).div_ceil(8) as usize;
    let mut bases = Vec::with_capacity(streams + 1);
    let mut next = plane_at
        .checked_add(plane_len)
        .filter(|&e| e <= src.len())
        .ok_or("the raw plane runs past the payload")?;
    for k in 0..streams {
        let len = u64::from_le_bytes(lens[8 * k..8 * k + 8].try_into().expect("8 bytes"));
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= src.len() - next)
            .ok_or("a stream runs past the payload")?;
        bases.push(next);
        next += len;
    }
    bases.push(next);
    let src = &src[..next];

    if n >= MULTI_MIN {
        tables.multi = tables.build_multi::<W>(&has_codes, threads);
    }

    let rows = n / head.columns;
    let plane = &src[plane_at..plane_at + plane_len];
    let raw_used = n as u64 * raw_bits::<W>() as u64;
    let at_of = |k: usize| stream_at(head.columns, streams, rows, k);
    let total = at_of(streams);
    // Room for the fast loop's last 8-byte store (3 tops past a stream's last). Every top is
    // written before it is read, so a buffer left from an earlier block serves as it is.
    SCRATCH.with_borrow_mut(|kept| {
        // A thread keeps its buffer up to KEEP_MAX tops (8 MiB), which saves zeroing fresh
        // pages for every block; a larger block's buffer is its own, so that a reader's
        // threads do not each hold the largest tensor they ever decoded.
        let mut own = Vec::new();
        let scratch = if total + PER_STEP <= KEEP_MAX {
            kept
        } else {
            &mut own
        };
        if scratch.len() < total + PER_STEP {
            scratch.resize(total + PER_STEP, 0);
        }
        let scratch = &mut scratch[..total + PER_STEP];
        let job = Job {
            src,
            tables: &tables,
            bases: &bases,
            columns: head.columns,
            streams,
            rows,
        };
        // Streams in parts of whole streams, a part a thread. Each part's streams write only
        // their own columns' tops (a step's store stays below its stream's end:
        // `Stream::runs`), so the parts are disjoint slices.
        let parts = threads.min(streams / STREAMS_A_THREAD).max(1);
        let mut pieces = Vec::with_capacity(parts);
        let (mut rest, mut from) = (&mut scratch[..], 0);
        for p in 0..parts {
            let ks = p * streams / parts..(p + 1) * streams / parts;
            let end = at_of(ks.end);
            let (piece, tail) = std::mem::take(&mut rest).split_at_mut(end - from);
            pieces.push((ks, piece, from, Ok(())));
            rest = tail;
            from = end;
        }
        in_parts(&mut pieces, 1, |(ks, piece, off, result)| {
            *result = job.decode_streams::<W>(ks.clone(), piece, *off);
        });
        // The first part's error, as one thread would have met the streams in order.
        pieces.into_iter().try_for_each(|p| p.3)?;

        if !raw_used.is_multiple_of(8) && plane[plane_len - 1] >> (raw_used % 8) != 0 {
            return Err("the raw plane's padding bits are not zero".into());
        }
        // Where each column's tops start: a stream's columns one after the other.
        let mut col_at = Vec::with_capacity(head.columns);
        for k in 0..streams {
            let cols = stream_columns(head.columns, streams, k).len();
            col_at.extend((0..cols).map(|j| at_of(k) + j * rows));
        }
        let tops = Tops {
            scratch: &scratch[..total],
            at: &col_at,
            rows,
        };
        // Rows in parts of whole 8s (the SIMD loops' blocks), the last part the rest.
        let parts = threads.min(rows / ROWS_A_THREAD).max(1);
        let per = rows.div_ceil(parts).next_multiple_of(8);
        let mut pieces = Vec::with_capacity(parts);
        let (mut rest, mut r) = (&mut dst[..], 0);
        while r < rows {
            let r1 = (r + per).min(rows);
            let (piece, tail) = std::mem::take(&mut rest).split_at_mut((r1 - r) * head.columns * W);
            pieces.push((r..r1, piece));
            rest = tail;
            r = r1;
        }
        in_parts(&mut pieces, 1, |(range, piece)| {
            put_rows::<W>(tops, plane, range.clone(), piece);
        });
        *at = next;
        Ok(())
    })
}

/// Streams a thread decodes at least when a block's streams are split over threads (one
/// AVX-512 group's worth: about a quarter millisecond of work, against some 20 us to start
/// a thread), and rows a thread puts back at least. Tests split the smallest blocks.
const STREAMS_A_THREAD: usize = if cfg!(test) { 1 } else { WIDE };
const ROWS_A_THREAD: usize = if cfg!(test) { 8 } else { 64 };

/// What the threads decoding one block's streams share.
struct Job<'a> {
    src: &'a [u8],
    tables: &'a Tables,
    /// Where each stream starts in `src`, and where the last one ends.
    bases: &'a [usize],
    columns: usize,
    streams: usize,
    rows: usize,
}

impl Job<'_> {
    /// Decodes streams `ks` into `scratch`, the block's buffer from top `off` on (each stream's
    /// tops from [`stream_at`], column by column), and checks each stream's end.
    fn decode_streams<const W: usize>(
        &self,
        ks: std::ops::Range<usize>,
        scratch: &mut [u16],
        off: usize,
    ) -> Result<(), String> {
        let (src, tables, bases) = (self.src, self.tables, self.bases);
        let start = |k: usize| {
            let out = stream_at(self.columns, self.streams, self.rows, k) - off;
            Stream {
                k,
                bit: 8 * bases[k] as u64,
                out,
                end: out + stream_columns(self.columns, self.streams, k).len() * self.rows,
                ctx: 0,
            }
        };
        // The rest of a stream one code at a time, then the checks of its end.
        let finish = |s: &mut Stream, scratch: &mut [u16]| -> Result<(), String> {
            one_at_a_time::<W>(src, tables, s, scratch)?;
            let k = s.k;
            let used = s.bit - 8 * bases[k] as u64;
            let len = (bases[k + 1] - bases[k]) as u64;
            if used.div_ceil(8) != len {
                return Err(format!(
                    "stream {k} holds {len} bytes but its elements take {used} bits"
                ));
            }
            if !used.is_multiple_of(8) && src[bases[k + 1] - 1] >> (used % 8) != 0 {
                return Err(format!("stream {k}: padding bits are not zero"));
            }
            Ok(())
        };
        let mut queue: Vec<Stream> = ks.rev().map(start).collect();
        #[cfg(target_arch = "x86_64")]
        if !tables.multi.is_empty()
            && queue.len() >= WIDE
            && std::arch::is_x86_feature_detected!("avx512f")
        {
            let multi = &tables.multi;
            side_by_side::<WIDE>(src.len(), &mut queue, scratch, &finish, |lanes, scratch| {
                // SAFETY: the CPU has AVX-512F (detected above).
                unsafe { fast_avx512::<W>(src, lanes, scratch, multi) }
            })?;
        }
        if tables.multi.is_empty() {
            narrowing::<W>(src, &mut queue, scratch, &finish, |c, b| {
                tables.single_entry::<W>(c, b)
            })?;
        } else {
            let multi = &tables.multi;
            assert_eq!(multi.len(), (BAD_CONTEXT + 1) * TABLE_LEN);
            narrowing::<W>(src, &mut queue, scratch, &finish, |c, b| {
                // SAFETY: `c` is a context of the table (the block's, below 16, or
                // BAD_CONTEXT: what every entry's context field holds) times TABLE_LEN, and
                // the index adds less than TABLE_LEN, so the entry lies inside `multi`
                // (asserted above).
                unsafe { *multi.get_unchecked(c + (b & MASK) as usize) }
            })?;
        }
        for mut s in queue.into_iter().rev() {
            finish(&mut s, scratch)?;
        }
        Ok(())
    }
}

/// The streams of `queue` four side by side, then the last ones (fewer than four) alone, each
/// without checks until its last round as a lane does, looking entries up with `entry`.
fn narrowing<const W: usize>(
    src: &[u8],
    queue: &mut Vec<Stream>,
    scratch: &mut [u16],
    finish: &Finish<'_>,
    entry: impl Fn(usize, u64) -> u64 + Copy,
) -> Result<(), String> {
    side_by_side::<LANES>(src.len(), queue, scratch, finish, |lanes, scratch| {
        fast::<W, LANES, _>(src, lanes, scratch, entry)
    })?;
    side_by_side::<1>(src.len(), queue, scratch, finish, |lanes, scratch| {
        fast::<W, 1, _>(src, lanes, scratch, entry)
    })
}

/// Decodes a stream from where it is to its end and checks the end.
type Finish<'a> = dyn Fn(&mut Stream, &mut [u16]) -> Result<(), String> + 'a;

/// Decodes the streams of `queue` (a stack: the next one last) `N` side by side with `fast`
/// while at least `N` are left; each lane takes the next stream when its own is near its end
/// (streams differ in length by a column), which `finish` decodes to its end and checks. The
/// streams begun and not finished go back on `queue`, for a narrower loop.
///
/// Tried (2026-12-06), no gain: once the queue was empty, idle wide lanes mirroring running ones
/// (their tops thrown away in room past the streams) until fewer than 8 real lanes were left.
/// The four-lane loop's share of a read fell from 8.9% to 5.7% and the wide loop's rose from 25%
/// to 29%: the wide loop with a quarter of its lanes real costs what the narrow one does.
fn side_by_side<const N: usize>(
    src_len: usize,
    queue: &mut Vec<Stream>,
    scratch: &mut [u16],
    finish: &Finish<'_>,
    mut fast: impl FnMut(&mut [Stream; N], &mut [u16]) -> Result<(), String>,
) -> Result<(), String> {
    if queue.len() < N {
        return Ok(());
    }
    let mut lanes: [Stream; N] = std::array::from_fn(|_| queue.pop().expect("N streams"));
    loop {
        fast(&mut lanes, scratch)?;
        for i in 0..N {
            if !lanes[i].runs(src_len) {
                finish(&mut lanes[i], scratch)?;
                match queue.pop() {
                    Some(s) => lanes[i] = s,
                    None => {
                        // Fewer streams than lanes are left: back on the queue, in order.
                        let mut left: Vec<Stream> =
                            lanes.into_iter().filter(|l| l.out < l.end).collect();
                        left.sort_by_key(|l| std::cmp::Reverse(l.k));
                        queue.extend(left);
                        return Ok(());
                    }
                }
            }
        }
    }
}

/// Tops a thread's kept scratch buffer holds at most.
const KEEP_MAX: usize = 1 << 22;

thread_local! {
    /// The tops of the block being decoded, in stream order.
    static SCRATCH: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A stream being decoded: its bit position in `src`, the next and end positions of its tops
/// in `scratch`, and the context of its next code (times `TABLE_LEN`).
struct Stream {
    k: usize,
    bit: u64,
    out: usize,
    end: usize,
    ctx: usize,
}

/// A round takes at most PER_STEP * STEPS tops a stream, and its last store reaches PER_STEP
/// tops further.
const ROUND: usize = PER_STEP * STEPS + PER_STEP;

impl Stream {
    /// Whether the multi-code loop can take a round of this stream: it has more than a round's
    /// tops left, and its refills (at most 8 bytes past its position) read 8 bytes inside a
    /// `src_len`-byte source.
    fn runs(&self, src_len: usize) -> bool {
        self.end - self.out >= ROUND && (self.bit >> 3) as usize + 16 <= src_len
    }
}

/// Decodes the rest of stream `s` one code at a time, every access checked.
fn one_at_a_time<const W: usize>(
    src: &[u8],
    tables: &Tables,
    s: &mut Stream,
    scratch: &mut [u16],
) -> Result<(), String> {
    while s.out < s.end {
        let bits = peek(src, s.bit);
        let e = tables.single[s.ctx + (bits & MASK) as usize] as u64;
        let t = e >> 4;
        if t as usize == BAD_TOP {
            return Err("a stream holds a bit pattern that is no code".into());
        }
        scratch[s.out] = lane::<W>(t) as u16;
        s.out += 1;
        s.bit += e & 15;
        s.ctx = tables.ctx_code[t as usize] as usize * TABLE_LEN;
    }
    Ok(())
}

/// Decodes the `N` streams `st` side by side, one lookup `entry(context, next bits)` a step
/// (an entry of up to three codes), while each has more than a round's codes left and its
/// reads stay inside `src`; the streams' positions are left where it stopped.
fn fast<const W: usize, const N: usize, E: Fn(usize, u64) -> u64>(
    src: &[u8],
    st: &mut [Stream; N],
    scratch: &mut [u16],
    entry: E,
) -> Result<(), String> {
    assert!(st.iter().all(|s| s.end <= scratch.len()));
    let read = |p: usize| -> u64 {
        // SAFETY: callers check `p + 8 <= src.len()`.
        u64::from_le_bytes(unsafe { src.as_ptr().add(p).cast::<[u8; 8]>().read() })
    };
    if !st.iter().all(|s| s.runs(src.len())) {
        return Ok(());
    }
    let mut buf = [0u64; N];
    let mut bit: [u64; N] = std::array::from_fn(|i| st[i].bit);
    let mut out: [usize; N] = std::array::from_fn(|i| st[i].out);
    let mut ctx: [usize; N] = std::array::from_fn(|i| st[i].ctx);
    let scr = scratch.as_mut_ptr();
    loop {
        if (0..N).any(|i| st[i].end - out[i] < ROUND || (bit[i] >> 3) as usize + 8 > src.len()) {
            break;
        }
        for i in 0..N {
            // At least 57 of the stream's next bits: the STEPS steps below take at most 55.
            buf[i] = read((bit[i] >> 3) as usize) >> (bit[i] & 7);
        }
        for _ in 0..STEPS {
            for i in 0..N {
                let e = entry(ctx[i], buf[i]);
                // SAFETY: `out[i] + 4 <= st[i].end <= scratch.len()`: the round began with at
                // least ROUND tops left and each step moves at most PER_STEP.
                unsafe {
                    scr.add(out[i]).cast::<u64>().write_unaligned(e);
                    out[i] += ((e >> CNT_AT) & 3) as usize;
                    let len = (e >> BITS_AT) & 15;
                    buf[i] >>= len;
                    bit[i] += len;
                    ctx[i] = ((e >> CTX_AT) & 31) as usize * TABLE_LEN;
                }
            }
        }
    }
    for i in 0..N {
        if ctx[i] == BAD_CONTEXT * TABLE_LEN {
            return Err("a stream holds a bit pattern that is no code".into());
        }
        st[i].bit = bit[i];
        st[i].out = out[i];
        st[i].ctx = ctx[i];
    }
    Ok(())
}

/// [`fast`] for [`WIDE`] streams in AVX-512, one a 64-bit lane, in vectors of eight whose
/// chains overlap: a gather of the eight entries (of up to three codes each) a step and
/// vector, their tops stored lane by lane, and a gather of the streams' next bytes a round.
/// Same stopping rule and result as [`fast`] on the multi-code tables `multi`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fast_avx512<const W: usize>(
    src: &[u8],
    st: &mut [Stream; WIDE],
    scratch: &mut [u16],
    multi: &[u64],
) -> Result<(), String> {
    use std::arch::x86_64::*;
    const G: usize = WIDE / 8;
    assert!(st.iter().all(|s| s.end <= scratch.len()));
    assert_eq!(multi.len(), (BAD_CONTEXT + 1) * TABLE_LEN);
    let lanes = |f: &dyn Fn(&Stream) -> u64| -> [__m512i; G] {
        let v: [u64; WIDE] = std::array::from_fn(|i| f(&st[i]));
        // SAFETY: AVX-512F is enabled for this function; each load reads 64 bytes of `v`.
        std::array::from_fn(|g| unsafe { _mm512_loadu_epi64(v[8 * g..].as_ptr().cast()) })
    };
    let mut bit = lanes(&|s| s.bit);
    let mut out = lanes(&|s| s.out as u64);
    let mut ctx = lanes(&|s| s.ctx as u64);
    let end = lanes(&|s| s.end as u64);
    let round = _mm512_set1_epi64(ROUND as i64);
    // A round's refill reads the 8 bytes at a stream's byte position; [`Stream::runs`] keeps
    // 16 bytes inside `src` (the rule the lanes are swapped by).
    let last = _mm512_set1_epi64(src.len() as i64 - 16);
    let (mask, seven, three, fifteen) = (
        _mm512_set1_epi64(MASK as i64),
        _mm512_set1_epi64(7),
        _mm512_set1_epi64(3),
        _mm512_set1_epi64(15),
    );
    let (table, dst) = (multi.as_ptr().cast::<i64>(), scratch.as_mut_ptr());
    let mut buf = [_mm512_setzero_si512(); G];
    'rounds: loop {
        for g in 0..G {
            // Every lane has at least ROUND tops left and 16 bytes of `src` from its
            // position: `Stream::runs`.
            let tops_left = _mm512_cmpge_epu64_mask(_mm512_sub_epi64(end[g], out[g]), round);
            let in_src = _mm512_cmple_epi64_mask(_mm512_srli_epi64::<3>(bit[g]), last);
            if tops_left & in_src != 0xFF {
                break 'rounds;
            }
        }
        for g in 0..G {
            // SAFETY: each lane reads the 8 bytes at its byte position, inside `src`
            // (checked just above; `src.len() >= 16` then, so `last` is not negative).
            let word = unsafe {
                _mm512_i64gather_epi64(_mm512_srli_epi64::<3>(bit[g]), src.as_ptr().cast(), 1)
            };
            buf[g] = _mm512_srlv_epi64(word, _mm512_and_si512(bit[g], seven));
        }
        for _ in 0..STEPS {
            for g in 0..G {
                let at = _mm512_add_epi64(ctx[g], _mm512_and_si512(buf[g], mask));
                // SAFETY: a lane's context is one of the table's (its field holds at most
                // BAD_CONTEXT) times TABLE_LEN, plus less than TABLE_LEN: inside `multi`
                // (asserted).
                let e = unsafe { _mm512_i64gather_epi64(at, table, 8) };
                let (mut es, mut outs) = ([0u64; 8], [0u64; 8]);
                // SAFETY: each lane writes the 8 bytes of tops `out..out + 4`, below its
                // stream's end (the round began with ROUND tops left, a step moves at most
                // PER_STEP), inside `scratch` (asserted).
                unsafe {
                    _mm512_storeu_epi64(es.as_mut_ptr().cast(), e);
                    _mm512_storeu_epi64(outs.as_mut_ptr().cast(), out[g]);
                    for i in 0..8 {
                        dst.add(outs[i] as usize)
                            .cast::<u64>()
                            .write_unaligned(es[i]);
                    }
                }
                out[g] = _mm512_add_epi64(
                    out[g],
                    _mm512_and_si512(_mm512_srli_epi64::<CNT_AT>(e), three),
                );
                let len = _mm512_and_si512(_mm512_srli_epi64::<BITS_AT>(e), fifteen);
                buf[g] = _mm512_srlv_epi64(buf[g], len);
                bit[g] = _mm512_add_epi64(bit[g], len);
                // The context field is the entry's top bits.
                ctx[g] = _mm512_slli_epi64::<{ MAX_CODE_LEN }>(_mm512_srli_epi64::<CTX_AT>(e));
            }
        }
    }
    let back = |v: [__m512i; G]| -> [u64; WIDE] {
        let mut a = [0u64; WIDE];
        for (g, v) in v.into_iter().enumerate() {
            // SAFETY: AVX-512F is enabled; the store writes 64 bytes of `a`.
            unsafe { _mm512_storeu_epi64(a[8 * g..].as_mut_ptr().cast(), v) };
        }
        a
    };
    let (bit, out, ctx) = (back(bit), back(out), back(ctx));
    for i in 0..WIDE {
        if ctx[i] as usize == BAD_CONTEXT * TABLE_LEN {
            return Err("a stream holds a bit pattern that is no code".into());
        }
        st[i].bit = bit[i];
        st[i].out = out[i] as usize;
        st[i].ctx = ctx[i] as usize;
    }
    Ok(())
}

/// The rows of a block that one call of [`put_rows`] writes: `range` (its start a multiple of
/// 8) of the block's `total`, into a `dst` that holds just those rows.
#[derive(Clone, Copy)]
struct Rows {
    start: usize,
    end: usize,
    total: usize,
}

impl Rows {
    /// The end of the whole 8s of rows from `start` (the SIMD loops' blocks).
    fn end8(self) -> usize {
        self.start + (self.end - self.start) / 8 * 8
    }
}

/// Tops left free after each stream's in `scratch` where columns of `rows` tops would share
/// sets of the L1 cache: one cache line. A column's tops lie a column length apart, which at
/// 512 tokens of 7 layers (3,584 rows, 7,168 bytes) puts neighbouring columns in only 4 of the
/// cache's 64 sets (2 at 1,024 tokens), so the 32 columns [`put_rows_avx512`] reads side by
/// side evict each other's lines before the next 8 rows use them. Streams hold a few columns
/// each (the writer's 8,192 elements), so a line more between streams spreads those 32 columns
/// over 32 sets. Columns of a multiple of 128 rows (256 bytes) are the ones that share sets
/// within 16 columns; the others keep their layout: a gap at 500 tokens (3,500 rows, whose
/// columns spread by themselves) measured 2% slower.
///
/// Measured (2026-12-06, stop 44; MiniLM bf16 records read with `layertap.open`, this machine
/// loaded by a CI run, the builds alternated turn by turn, two batches of 10 and 8 turns; a
/// turn's exp-huf GB per CPU-second over bp16-zstd's in the same turn, medians): 512 tokens
/// 0.897 and 0.905 against 0.852 and 0.832 without gaps (6.5% and 7.5% over the turn beside it),
/// 1,024 tokens 0.965 and 0.929 against 0.898 and 0.887 (6.6%, 5.8%), 500 tokens (no gap)
/// 0.864 and 0.854 against 0.851 and 0.866 (+0.8%, -1.3%). The turns:
/// benches/results/exphuf-stream-gap-2026-12-06.md.
fn stream_gap(rows: usize) -> usize {
    if rows.is_multiple_of(128) {
        32
    } else {
        0
    }
}

/// Where stream `k`'s tops start in `scratch` (of a block of `rows` rows cut into `streams`
/// streams), its columns one after the other; `k == streams` gives the tops' end.
fn stream_at(columns: usize, streams: usize, rows: usize, k: usize) -> usize {
    stream_columns(columns, streams, k).start * rows + k * stream_gap(rows)
}

/// A block's decoded tops: column `c`'s `rows` rows from `at[c]` of `scratch` on.
#[derive(Clone, Copy)]
struct Tops<'a> {
    scratch: &'a [u16],
    at: &'a [usize],
    rows: usize,
}

/// Writes rows `rows` of the elements into `dst` (those rows' bytes) in row order: each top of
/// `tops` (as [`lane`] puts it) with its raw bits from `plane`.
fn put_rows<const W: usize>(
    tops: Tops<'_>,
    plane: &[u8],
    rows: std::ops::Range<usize>,
    dst: &mut [u8],
) {
    let columns = tops.at.len();
    let rows = Rows {
        start: rows.start,
        end: rows.end,
        total: tops.rows,
    };
    assert!(rows.start.is_multiple_of(8) && rows.end <= rows.total);
    assert_eq!(dst.len(), (rows.end - rows.start) * columns * W);
    #[cfg(target_arch = "x86_64")]
    {
        let mut done = 0;
        if W == 2
            && columns >= 32
            && columns.is_multiple_of(8)
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vbmi")
        {
            // SAFETY: the CPU has AVX-512F, BW and VBMI (detected above; BW implies F).
            done = unsafe {
                if stream_gap(tops.rows) == 0 {
                    put_rows_avx512::<false>(tops, plane, rows, dst)
                } else {
                    put_rows_avx512::<true>(tops, plane, rows, dst)
                }
            };
        }
        if W == 2 && columns.is_multiple_of(8) && std::arch::is_x86_feature_detected!("ssse3") {
            // SAFETY: the CPU has SSSE3 (detected above).
            unsafe { put_rows_sse2::<W, true>(tops, done, plane, rows, dst) };
        } else {
            // SAFETY: SSE2 is part of x86_64 (the function's SSSE3 code runs only with
            // `SSSE3` true).
            unsafe { put_rows_sse2::<W, false>(tops, done, plane, rows, dst) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        for row in rows.start..rows.end {
            for c in 0..columns {
                put_one::<W>(tops, rows, plane, dst, row, c);
            }
        }
    }
}

/// The raw bits of element `i` from `plane`.
#[inline(always)]
fn raw_of<const W: usize>(plane: &[u8], i: usize) -> u64 {
    let r = raw_bits::<W>() as u64;
    let bit = i as u64 * r;
    (read_u64(plane, (bit >> 3) as usize) >> (bit & 7)) & ((1 << r) - 1)
}

/// Writes the element of `row` and column `c` (`dst` holds `rows`' bytes).
#[inline(always)]
fn put_one<const W: usize>(
    tops: Tops<'_>,
    rows: Rows,
    plane: &[u8],
    dst: &mut [u8],
    row: usize,
    c: usize,
) {
    let columns = tops.at.len();
    let i = row * columns + c;
    let t = tops.scratch[tops.at[c] + row] as u64;
    let v = if W == 2 { t } else { t << raw_bits::<W>() } | raw_of::<W>(plane, i);
    let o = i - rows.start * columns;
    dst[o * W..o * W + W].copy_from_slice(&v.to_le_bytes()[..W]);
}

/// [`put_rows`] of 2-byte elements in AVX-512, for the whole-8 rows and the columns left of the
/// last whole 32 (it returns that column count; [`put_rows_sse2`] does the rest): 8 rows x 32
/// columns at a time, four 8 x 8 blocks of tops transposed side by side (one per 128-bit lane of
/// each vector, the unpacks of [`transpose8x8`] working lane by lane), so that each vector ends
/// as 32 neighbouring elements of one row, ORed with their raw bits and stored at once. The raw
/// bits of 32 elements (28 bytes of the plane from a byte boundary: rows hold whole 8s) are
/// spread into 16-bit lanes by a byte permutation across the vector (VBMI), then a shift per
/// lane.
///
/// The caller checked the CPU has AVX-512F, BW and VBMI, and that `columns` is a multiple of 8.
/// `GAPS`: the block's streams lie apart ([`stream_gap`]), so each column's first top is read
/// from `tops.at`; without, it is the column times the rows, as it was before the gaps, so that
/// blocks without gaps pay no load more.
///
/// In a read through the reader this takes about a fifth of the samples, as many as
/// `fast_avx512` (0.94-1.0 of its, a record not seen before or the same one again); in the
/// core bench 0.85 of its (the 5% of that bench's profile is of a run that encodes as well):
/// much the same share of the decode either way (perf, stop 44). Tried (2026-12-06), no
/// gain: rows in tiles of 32 (each line of `scratch` used whole while in L1); each 256
/// columns put back as soon as their streams were decoded, their tops still in L2 (this
/// function's share of a read did not fall). Tried (2026-12-06, stop 44), slower:
/// non-temporal (streaming) stores of `dst`, which skip fetching its lines: the reader's
/// tensors start 56 bytes past a line (after the blob's header), so each whole line of a row
/// was joined from its two vectors (`vpermt2b`) and streamed, the row's two partial lines
/// stored masked at the line (a masked store at the vector's own place, spanning a line just
/// streamed, stalls: the decode fell to 1.0 GB per CPU-second). Through the reader
/// (`bench_codecs.py`'s loop, MiniLM bf16 records of 2.75 MB, 6 turns each): 1.61-1.76 GB per
/// CPU-second against 1.74-1.88 without (0.78-0.91 of bp16-zstd's in the same runs, against
/// 0.84-1.01), this function still 20% of a perf profile against 19%; decoding then summing
/// each tensor 0.92-1.17 against 0.96-1.35. The reader decodes into the memory of the record
/// dropped before (`RecordBytes::recycled`), most likely still in the L3 cache: ordinary
/// stores into two such buffers in turn ran at 33 GB/s and streaming ones at 25 (a C loop;
/// 12.8 against 25 only over 64 buffers). The hottest instructions here (perf annotate of a
/// read; no hardware counters in this VM) sit at the loads of `scratch`, not the stores;
/// prefetching each column's line of `scratch` 64 rows ahead was 3-5% slower too.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
unsafe fn put_rows_avx512<const GAPS: bool>(
    tops: Tops<'_>,
    plane: &[u8],
    part: Rows,
    dst: &mut [u8],
) -> usize {
    use std::arch::x86_64::*;
    let (scratch, columns, rows) = (tops.scratch, tops.at.len(), tops.rows);
    debug_assert!(columns.is_multiple_of(8));
    let cols32 = columns / 32 * 32;
    let first = part.start * columns;
    // Lane k (of 32) takes bytes 7k / 8 and the next of the 28, and is shifted right by 7k mod 8.
    let pick = _mm512_set_epi8(
        28, 27, 27, 26, 26, 25, 25, 24, 24, 23, 23, 22, 22, 21, 22, 21, //
        21, 20, 20, 19, 19, 18, 18, 17, 17, 16, 16, 15, 15, 14, 15, 14, //
        14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8, 7, 8, 7, //
        7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 1, 0,
    );
    let shift = _mm512_set_epi16(
        1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, //
        1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0,
    );
    let low7 = _mm512_set1_epi16(0x7F);
    let ahead = columns * 7;
    for r0 in (part.start..part.end8()).step_by(8) {
        for c0 in (0..cols32).step_by(32) {
            let col_at = &tops.at[c0..c0 + 32];
            // SAFETY: the CPU has AVX-512F/BW/VBMI (the caller's contract). Each 16-byte load
            // reads an 8-element slice of `scratch` (rows r0..r0 + 8 <= rows of column c0 + 8L
            // + j < columns), each masked load 28 bytes of a slice of `plane` of that length,
            // and each store 64 bytes of a 32-element (64-byte) slice of `dst` (which holds
            // the rows from `part.start` on), all bounds checked when taken; the prefetch only
            // hints.
            unsafe {
                // No closures here: they do not inherit the function's target features, and
                // one left out of line (seen after an unrelated change) cost 20% of a decode.
                let mut a = [_mm512_setzero_si512(); 8];
                for (j, v) in a.iter_mut().enumerate() {
                    let mut lanes = [_mm_setzero_si128(); 4];
                    for (l, lane) in lanes.iter_mut().enumerate() {
                        let at = if GAPS {
                            col_at[8 * l + j] + r0
                        } else {
                            (c0 + 8 * l + j) * rows + r0
                        };
                        *lane = _mm_loadu_si128(scratch[at..at + 8].as_ptr().cast());
                    }
                    let w = _mm512_castsi128_si512(lanes[0]);
                    let w = _mm512_inserti32x4::<1>(w, lanes[1]);
                    let w = _mm512_inserti32x4::<2>(w, lanes[2]);
                    *v = _mm512_inserti32x4::<3>(w, lanes[3]);
                }
                let t = [
                    _mm512_unpacklo_epi16(a[0], a[1]),
                    _mm512_unpackhi_epi16(a[0], a[1]),
                    _mm512_unpacklo_epi16(a[2], a[3]),
                    _mm512_unpackhi_epi16(a[2], a[3]),
                    _mm512_unpacklo_epi16(a[4], a[5]),
                    _mm512_unpackhi_epi16(a[4], a[5]),
                    _mm512_unpacklo_epi16(a[6], a[7]),
                    _mm512_unpackhi_epi16(a[6], a[7]),
                ];
                // t = [lo(0,1), hi(0,1), lo(2,3), hi(2,3), ...]: pair t[0],t[2] / t[1],t[3]...
                let u = [
                    _mm512_unpacklo_epi32(t[0], t[2]),
                    _mm512_unpackhi_epi32(t[0], t[2]),
                    _mm512_unpacklo_epi32(t[1], t[3]),
                    _mm512_unpackhi_epi32(t[1], t[3]),
                    _mm512_unpacklo_epi32(t[4], t[6]),
                    _mm512_unpackhi_epi32(t[4], t[6]),
                    _mm512_unpacklo_epi32(t[5], t[7]),
                    _mm512_unpackhi_epi32(t[5], t[7]),
                ];
                let rows_of = [
                    _mm512_unpacklo_epi64(u[0], u[4]),
                    _mm512_unpackhi_epi64(u[0], u[4]),
                    _mm512_unpacklo_epi64(u[1], u[5]),
                    _mm512_unpackhi_epi64(u[1], u[5]),
                    _mm512_unpacklo_epi64(u[2], u[6]),
                    _mm512_unpackhi_epi64(u[2], u[6]),
                    _mm512_unpacklo_epi64(u[3], u[7]),
                    _mm512_unpackhi_epi64(u[3], u[7]),
                ];
                for (i, v) in rows_of.into_iter().enumerate() {
                    let e = (r0 + i) * columns + c0;
                    let p = e * 7 / 8;
                    _mm_prefetch::<_MM_HINT_T0>(plane.as_ptr().wrapping_add(p + ahead).cast());
                    let bytes = &plane[p..p + 28];
                    let b = _mm512_maskz_loadu_epi8(0x0FFF_FFFF, bytes.as_ptr().cast());
                    let raw = _mm512_and_si512(
                        _mm512_srlv_epi16(_mm512_permutexvar_epi8(pick, b), shift),
                        low7,
                    );
                    let out = &mut dst[2 * (e - first)..2 * (e - first) + 64];
                    _mm512_storeu_si512(out.as_mut_ptr().cast(), _mm512_or_si512(v, raw));
                }
            }
        }
    }
    cols32
}

/// [`put_rows`] in SSE2, from column `from` (a multiple of 8; the columns left of it in the
/// whole-8 rows are done): 8 x 8 blocks of tops transposed in registers, each row of 8 ORed with
/// its raw bits (2-byte elements: 56 bits, one read of the plane; 4-byte: 8 reads of 23 bits),
/// 8 rows at a time over the whole width, so that the plane is read in order.
///
/// With `SSSE3` (the caller checked the CPU has it, and that rows are whole multiples of 8
/// elements, so that each 8 raw values start at a byte), the 7 bytes of 8 raw values are
/// spread into 8 lanes by a byte shuffle and a multiply, where the baseline shifts and masks
/// each value in a general register.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "ssse3")]
unsafe fn put_rows_sse2<const W: usize, const SSSE3: bool>(
    tops: Tops<'_>,
    from: usize,
    plane: &[u8],
    part: Rows,
    dst: &mut [u8],
) {
    use super::column::transpose8x8;
    use std::arch::x86_64::*;
    // Lane k takes the 2 bytes from byte 7k / 8 of the raw values; it is shifted left by
    // 7 - (7k mod 8) (multiplied by a power of 2), then right by 7, and masked to 7 bits.
    let pick = _mm_setr_epi8(0, 1, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7);
    let scale = _mm_setr_epi16(128, 1, 2, 4, 8, 16, 32, 64);
    let low7 = _mm_set1_epi16(0x7F);
    let (scratch, columns) = (tops.scratch, tops.at.len());
    let (rows8, cols8) = (part.end8(), columns / 8 * 8);
    let first = part.start * columns;
    // 8 raw values of 7 bits (56 bits of `w`) as 4 + 4 lanes of 16 bits.
    let spread = |w: u64| -> u64 {
        (w & 0x7F) | (w >> 7 & 0x7F) << 16 | (w >> 14 & 0x7F) << 32 | (w >> 21 & 0x7F) << 48
    };
    let r = raw_bits::<W>() as usize;
    let ahead = columns * r;
    for rb in (part.start..rows8).step_by(8) {
        for cb in (from..cols8).step_by(cols8.max(1)) {
            for r0 in (rb..(rb + 8).min(rows8)).step_by(8) {
                for c0 in (cb..cols8).step_by(8) {
                    let col = |j: usize| &scratch[tops.at[c0 + j] + r0..][..8];
                    // SAFETY: SSE2 is part of x86_64; every load reads the 16 bytes of an
                    // 8-element slice of `scratch` and every store writes those of an
                    // 8-element (16-byte) slice of `dst`, both bounds checked when taken.
                    unsafe {
                        let a: [__m128i; 8] =
                            std::array::from_fn(|j| _mm_loadu_si128(col(j).as_ptr().cast()));
                        let rows_of = transpose8x8(a);
                        for (i, v) in rows_of.into_iter().enumerate() {
                            let e = (r0 + i) * columns + c0;
                            let bit = (e * r) as u64;
                            let p = (bit >> 3) as usize;
                            // The plane is read a row-block at a time, 8 rows side by side,
                            // which the hardware's prefetchers miss: fetch the next block's.
                            _mm_prefetch::<_MM_HINT_T0>(
                                plane.as_ptr().wrapping_add(p + ahead).cast(),
                            );
                            if W == 4 {
                                let raw: [u32; 8] =
                                    std::array::from_fn(|k| raw_of::<4>(plane, e + k) as u32);
                                let zero = _mm_setzero_si128();
                                let lo = _mm_slli_epi32::<23>(_mm_unpacklo_epi16(v, zero));
                                let hi = _mm_slli_epi32::<23>(_mm_unpackhi_epi16(v, zero));
                                let lo = _mm_or_si128(lo, _mm_loadu_si128(raw.as_ptr().cast()));
                                let hi =
                                    _mm_or_si128(hi, _mm_loadu_si128(raw[4..].as_ptr().cast()));
                                let out = &mut dst[4 * (e - first)..4 * (e - first) + 32];
                                _mm_storeu_si128(out.as_mut_ptr().cast(), lo);
                                _mm_storeu_si128(out[16..].as_mut_ptr().cast(), hi);
                                continue;
                            }
                            let raw = match plane.get(p..p + 16) {
                                Some(b) if SSSE3 => {
                                    let b =
                                        _mm_shuffle_epi8(_mm_loadu_si128(b.as_ptr().cast()), pick);
                                    _mm_and_si128(
                                        _mm_srli_epi16::<7>(_mm_mullo_epi16(b, scale)),
                                        low7,
                                    )
                                }
                                _ => {
                                    let w = read_u64(plane, p) >> (bit & 7);
                                    _mm_set_epi64x(spread(w >> 28) as i64, spread(w) as i64)
                                }
                            };
                            let out = &mut dst[2 * (e - first)..2 * (e - first) + 16];
                            _mm_storeu_si128(out.as_mut_ptr().cast(), _mm_or_si128(v, raw));
                        }
                    }
                }
            }
        }
    }
    // The columns right of the last whole 8, and the rows below the last whole 8.
    for row in part.start..rows8 {
        for c in cols8..columns {
            put_one::<W>(tops, part, plane, dst, row, c);
        }
    }
    for row in rows8..part.end {
        for c in 0..columns {
            put_one::<W>(tops, part, plane, dst, row, c);
        }
    }
}

#[cfg(test)]
mod multi_tests {
    //! [`Tables::build_multi`] against [`Tables::multi_entry`], entry by entry.
    use super::*;
    use proptest::prelude::*;

    /// The tables of a block with code lengths `lengths` (one a context, all zero for a context
    /// without codes) and contexts `context_of_symbol`, as `decode` builds them.
    fn tables(
        lengths: &[[u8; SYMBOLS]],
        context_of_symbol: &[usize; SYMBOLS],
    ) -> (Tables, [bool; BAD_CONTEXT]) {
        let mut tables = Tables {
            single: vec![BAD_SINGLE; (BAD_CONTEXT + 1) * TABLE_LEN],
            multi: Vec::new(),
            ctx_code: [BAD_CONTEXT as u64; SYMBOLS + 1],
        };
        let mut has_codes = [false; BAD_CONTEXT];
        for (c, l) in lengths.iter().enumerate() {
            huffman::check_lengths(l).unwrap();
            has_codes[c] = l.iter().any(|&l| l > 0);
            fill_single(l, &mut tables.single[c * TABLE_LEN..][..TABLE_LEN]);
        }
        for t in 0..SYMBOLS {
            let c = context_of_symbol[symbol_of_top(t)];
            if has_codes[c] {
                tables.ctx_code[t] = c as u64;
            }
        }
        (tables, has_codes)
    }

    fn same_entries<const W: usize>(
        tables: &Tables,
        has_codes: &[bool; BAD_CONTEXT],
        threads: usize,
    ) -> Result<(), TestCaseError> {
        let multi = tables.build_multi::<W>(has_codes, threads);
        prop_assert_eq!(multi.len(), (BAD_CONTEXT + 1) * TABLE_LEN);
        for c in 0..=BAD_CONTEXT {
            for x in 0..TABLE_LEN {
                let want = if c < BAD_CONTEXT && has_codes[c] {
                    tables.multi_entry::<W>(c, x)
                } else {
                    bad_entry()
                };
                prop_assert_eq!(
                    multi[c * TABLE_LEN + x],
                    want,
                    "context {} bits {:011b}",
                    c,
                    x
                );
            }
        }
        Ok(())
    }

    /// Code lengths from `picks` (symbol, length 0 to 11) in order, each kept while the code
    /// stays a prefix code: complete or not, short codes and codes of 11 bits.
    fn lengths_of(picks: &[(usize, u8)]) -> [u8; SYMBOLS] {
        let mut lengths = [0u8; SYMBOLS];
        let mut kraft = 0u64;
        for &(s, l) in picks {
            let w = if l == 0 {
                0
            } else {
                1u64 << (MAX_CODE_LEN - l as u32)
            };
            if lengths[s] == 0 && kraft + w <= 1 << MAX_CODE_LEN {
                lengths[s] = l;
                kraft += w;
            }
        }
        lengths
    }

    /// Complete codes from skewed counts (the encoder's), with codes up to 11 bits.
    fn complete_of(counts: &[(usize, u32)]) -> [u8; SYMBOLS] {
        let mut c = [0u32; SYMBOLS];
        for &(s, n) in counts {
            c[s] = c[s].saturating_add(n);
        }
        huffman::code_lengths(&c)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        #[test]
        fn multi_tables_equal_the_entry_by_entry_build(
            contexts in proptest::collection::vec(
                prop_oneof![
                    Just(None),
                    proptest::collection::vec((0..SYMBOLS, 0u8..=11), 0..600).prop_map(Some),
                    // Mostly long codes: many of 11 bits, often a complete code.
                    proptest::collection::vec((0..SYMBOLS, 8u8..=11), 0..2000).prop_map(Some),
                ],
                1..=BAD_CONTEXT,
            ),
            skewed in proptest::collection::vec(proptest::collection::vec((0..SYMBOLS, 0u32..31), 1..200), 0..4),
            context_seed in any::<u64>(),
            threads in 1usize..5,
        ) {
            let mut lengths: Vec<[u8; SYMBOLS]> = contexts
                .iter()
                .map(|c| c.as_deref().map_or([0; SYMBOLS], lengths_of))
                .collect();
            for (i, s) in skewed.iter().enumerate() {
                let counts: Vec<_> = s.iter().map(|&(s, e)| (s, 1u32 << e)).collect();
                let at = i % lengths.len();
                lengths[at] = complete_of(&counts);
            }
            let mut seed = context_seed | 1;
            let mut context_of_symbol = [0usize; SYMBOLS];
            for c in &mut context_of_symbol {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                *c = (seed % lengths.len() as u64) as usize;
            }
            let (t, has_codes) = tables(&lengths, &context_of_symbol);
            same_entries::<2>(&t, &has_codes, threads)?;
            same_entries::<4>(&t, &has_codes, threads)?;
        }
    }

    /// The edge cases by name: a code leading into a context without codes (BAD_CONTEXT),
    /// codes of 11 bits, patterns that start no code, a lone 1-bit code.
    #[test]
    fn multi_tables_edge_cases() {
        let mut lengths = vec![[0u8; SYMBOLS]; 3];
        // Context 0: a 1-bit code, a 2-bit code and 11-bit codes, incomplete.
        lengths[0][0] = 1;
        lengths[0][1] = 2;
        lengths[0][2..100].fill(11);
        // Context 1: no codes. Context 2: one 1-bit code (pattern 1 starts no code).
        lengths[2][5] = 1;
        let mut context_of_symbol = [0usize; SYMBOLS];
        context_of_symbol[1] = 1; // into the context without codes
        context_of_symbol[5] = 2;
        context_of_symbol[50..100].fill(2);
        let (t, has_codes) = tables(&lengths, &context_of_symbol);
        for threads in 1..4 {
            same_entries::<2>(&t, &has_codes, threads).unwrap();
            same_entries::<4>(&t, &has_codes, threads).unwrap();
        }
    }
}
