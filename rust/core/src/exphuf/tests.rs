//! Round trips of `exp-huf` at every shape that matters (empty, tiny, odd lengths, every stream
//! count, strides past the end), proptest round trips, and the decoder against damaged and
//! arbitrary bytes: errors, never panics.

use super::*;
use crate::blob::{build_header, TensorSpec};
use proptest::prelude::*;
use std::collections::BTreeMap;

/// A blob of the given tensors (name, dtype, shape, bytes) as pieces: header, then each tensor.
fn blob(tensors: &[(Dtype, Vec<u64>, Vec<u8>)]) -> (Vec<u8>, Vec<Vec<u8>>) {
    let specs: Vec<TensorSpec> = tensors
        .iter()
        .enumerate()
        .map(|(i, (dtype, shape, _))| TensorSpec {
            name: format!("t{i}"),
            dtype: *dtype,
            shape: shape.clone(),
        })
        .collect();
    let meta = BTreeMap::from([("key".to_string(), "k".to_string())]);
    let header = build_header(&specs, &meta).unwrap();
    (header, tensors.iter().map(|t| t.2.clone()).collect())
}

fn round_trip(header: &[u8], data: &[Vec<u8>]) -> Vec<u8> {
    let mut pieces: Vec<&[u8]> = vec![header];
    pieces.extend(data.iter().map(|d| d.as_slice()));
    let raw: Vec<u8> = pieces.concat();
    let mut stored = Vec::new();
    encode(&pieces, &mut stored).unwrap();
    assert_eq!(decode(&stored, raw.len() as u64).unwrap(), raw);
    // The same blob in one piece, and split at odd places, encodes to the same bytes.
    let mut again = Vec::new();
    encode(&[&raw], &mut again).unwrap();
    assert_eq!(again, stored);
    let cut = raw.len() / 3 + 1;
    encode(&[&raw[..cut], &raw[cut..cut], &raw[cut..]], &mut again).unwrap();
    assert_eq!(again, stored);
    stored
}

/// xorshift64* bytes.
fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            (s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
        })
        .collect()
}

/// A proptest's block of `rows` x `cols` elements of `width` bytes: random bits, or
/// activation-like values.
fn sample(rows: usize, cols: usize, width: usize, random_bits: bool, seed: u64) -> Vec<u8> {
    if random_bits {
        noise(rows * cols * width, seed)
    } else {
        activations(rows, cols, width, seed)
    }
}

/// Activation-like bf16 (or f32) elements: a few exponents around 1.0, random signs and
/// mantissas, channel `c` of each row scaled by `1 << (c % 5)` (outlier channels).
fn activations(rows: usize, cols: usize, width: usize, seed: u64) -> Vec<u8> {
    let bits = noise(rows * cols * 4, seed);
    let mut out = Vec::with_capacity(rows * cols * width);
    for i in 0..rows * cols {
        let r = u32::from_le_bytes(bits[4 * i..4 * i + 4].try_into().unwrap());
        let exp = 124 + (r % 5) + ((i % cols) % 5) as u32;
        let f = (r >> 31) << 31 | exp << 23 | (r & 0x7F_FFFF);
        if width == 2 {
            out.extend_from_slice(&((f >> 16) as u16).to_le_bytes());
        } else {
            out.extend_from_slice(&f.to_le_bytes());
        }
    }
    out
}

#[test]
fn activations_compress_and_round_trip() {
    for (dtype, width) in [(Dtype::BF16, 2), (Dtype::F16, 2), (Dtype::F32, 4)] {
        let data = activations(64, 96, width, 7);
        let ids = noise(64 * 8, 3);
        let (h, d) = blob(&[(dtype, vec![64, 1, 96], data), (Dtype::I64, vec![64], ids)]);
        let stored = round_trip(&h, &d);
        let raw = h.len() + d.iter().map(Vec::len).sum::<usize>();
        assert!(stored.len() < raw, "{dtype}: {} >= {raw}", stored.len());
    }
}

#[test]
fn every_length_round_trips() {
    // Tiny tensors are stored raw; from 64 elements on they are coded; lengths around the
    // stream count and the stride.
    for n in (1..80).chain([127, 128, 129, 1000, 4099]) {
        for cols in [1u64, 3, 4, 7, 64] {
            let rows = (n as u64).div_ceil(cols);
            let n = (rows * cols) as usize;
            let (h, d) = blob(&[(
                Dtype::BF16,
                vec![rows, cols],
                activations(n, 1, 2, n as u64),
            )]);
            round_trip(&h, &d);
        }
    }
}

#[test]
fn constant_and_random_tensors_round_trip() {
    let zeros = vec![0u8; 2 * 5000];
    let random = noise(2 * 5000, 11);
    let (h, d) = blob(&[
        (Dtype::BF16, vec![50, 100], zeros),
        (Dtype::F16, vec![50, 100], random.clone()),
        (Dtype::F32, vec![2500], random),
        (Dtype::U8, vec![3], vec![1, 2, 3]),
    ]);
    let stored = round_trip(&h, &d);
    // All-zero: one symbol, 1 bit + 7 raw bits per element, about half; random bytes do not
    // compress and are stored raw (1 byte more each).
    let zeros_at_most = 5000 + 800;
    assert!(
        stored.len() <= h.len() + zeros_at_most + 2 * 10_001 + 3,
        "{}",
        stored.len()
    );
}

#[test]
fn other_dtypes_are_stored_as_they_are() {
    let ints = noise(800, 5);
    let (h, d) = blob(&[(Dtype::I16, vec![400], ints.clone())]);
    let stored = round_trip(&h, &d);
    assert_eq!(&stored[h.len()..], &ints[..]);
}

#[test]
fn every_stream_count_decodes() {
    // The encoder writes 4 streams; rewrite a block with 1, 2 and 8 streams by hand is not
    // possible without re-encoding, so encode with each count through the block module.
    for streams in [1usize, 2, 4, 8] {
        let data = activations(40, 33, 2, streams as u64);
        let mut out = Vec::new();
        block_encode::encode_with_streams::<2>(
            &data,
            &block_encode::Plan {
                stride: 33,
                exp_shift: 0,
            },
            streams,
            &mut out,
        );
        let mut back = vec![0u8; data.len()];
        let mut at = 0;
        block_decode::decode::<2>(&out, &mut at, &mut back, 1).unwrap();
        assert_eq!(at, out.len());
        assert_eq!(back, data, "{streams} streams");
    }
}

/// What [`write_coded_head`] writes, given the tables, stride, mode and stream lengths of a block
/// this crate's encoder made, is that block up to its streams, byte for byte (the torch encoder
/// relies on it); bad tables and stream counts are refused.
#[test]
fn coded_heads_of_another_encoder_equal_this_one() {
    for (dtype, width, exp_shift) in [(Dtype::BF16, 2, 0), (Dtype::F16, 2, 3), (Dtype::F32, 4, 0)] {
        let data = activations(48, 40, width, 9);
        let mut block = Vec::new();
        let plan = block_encode::Plan {
            stride: 40,
            exp_shift,
        };
        if width == 2 {
            block_encode::encode::<2>(&data, &plan, Layout::ByElement, &mut block);
        } else {
            block_encode::encode::<4>(&data, &plan, Layout::ByElement, &mut block);
        }
        assert_eq!(block[0], block::MODE_CODED, "{dtype:?}");
        let head = block::Head::parse(&block[1..1 + block::FIXED_LEN]).unwrap();
        let mut at = 1 + block::FIXED_LEN;
        let mut lengths = Vec::new();
        for _ in 0..head.contexts {
            lengths.extend_from_slice(&block::parse_lengths(&block, &mut at).unwrap());
        }
        let stream_lens: Vec<u64> = block[at..at + 8 * head.streams]
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let streams_at = at + 8 * head.streams;
        // The most common exponent: the one positive top value whose bucket is 0, context 0.
        let top_of_mode = (0..256)
            .find(|&t| head.context_of_symbol[block::symbol_of_top(t)] == 0)
            .unwrap();
        let mode = (top_of_mode >> exp_shift) as u8;
        let mut out = vec![7u8]; // appends
        write_coded_head(dtype, head.stride, mode, &lengths, &stream_lens, &mut out).unwrap();
        assert_eq!(&out[1..], &block[..streams_at], "{dtype:?}");

        let mut bad = lengths.clone();
        bad[..4].copy_from_slice(&[1, 1, 1, 0]);
        let e = write_coded_head(dtype, 40, mode, &bad, &stream_lens, &mut out).unwrap_err();
        assert!(
            e.contains("context 0") && e.contains("over-subscribed"),
            "{e}"
        );
        let e =
            write_coded_head(dtype, 40, mode, &lengths, &stream_lens[..3], &mut out).unwrap_err();
        assert!(e.contains("3 streams"), "{e}");
        let e =
            write_coded_head(dtype, 40, mode, &lengths[1..], &stream_lens, &mut out).unwrap_err();
        assert!(e.contains("code lengths"), "{e}");
        assert!(write_coded_head(Dtype::I32, 40, mode, &lengths, &stream_lens, &mut out).is_err());
    }
}

#[test]
fn damaged_payloads_are_errors() {
    let data = activations(32, 64, 2, 1);
    let (h, d) = blob(&[(Dtype::BF16, vec![32, 64], data)]);
    let raw_len = (h.len() + d[0].len()) as u64;
    let stored = round_trip(&h, &d);
    assert!(decode(&stored, raw_len + 2).is_err());
    assert!(decode(&stored, raw_len - 2).is_err());
    assert!(decode(&stored[..stored.len() - 1], raw_len).is_err());
    let mut longer = stored.clone();
    longer.push(0);
    assert!(decode(&longer, raw_len)
        .unwrap_err()
        .contains("after the last"));
    // Every single-byte change of the block either fails or decodes to a blob of raw_len
    // bytes (a flipped mantissa bit is still a valid stream); none panics.
    for at in h.len()..stored.len() {
        let mut bad = stored.clone();
        bad[at] ^= 0x5A;
        if let Ok(out) = decode(&bad, raw_len) {
            assert_eq!(out.len() as u64, raw_len);
        }
    }
}

#[test]
fn decode_refuses_before_allocating_too_much() {
    let e = decode(&[0u8; 16], 1 << 40).unwrap_err();
    assert!(e.contains("more than"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn any_tensors_round_trip(
        tensors in prop::collection::vec(
            (0usize..4, 1u64..40, 1u64..40, any::<u64>(), any::<bool>()),
            1..4,
        )
    ) {
        let specs: Vec<(Dtype, Vec<u64>, Vec<u8>)> = tensors
            .iter()
            .map(|&(d, rows, cols, seed, like)| {
                let dtype = [Dtype::BF16, Dtype::F16, Dtype::F32, Dtype::I64][d];
                let n = (rows * cols) as usize;
                let w = dtype.size();
                let bytes = if like && w <= 4 {
                    activations(n, 1, w, seed)
                } else {
                    noise(n * w, seed)
                };
                (dtype, vec![rows, cols], bytes)
            })
            .collect();
        let (h, d) = blob(&specs);
        round_trip(&h, &d);
    }

    /// Arbitrary bytes after a valid header: the decoder returns an error or a blob of the
    /// length asked for, and never panics (the fuzz harness of the decoder, run as a test).
    #[test]
    fn arbitrary_blocks_never_panic(
        body in prop::collection::vec(any::<u8>(), 0..3000),
        mode in 0u8..3,
        streams in prop::sample::select(vec![0u8, 1, 2, 4, 8, 9]),
        nctx in 0u8..18,
    ) {
        let (h, _) = blob(&[(Dtype::BF16, vec![20, 30], vec![])]);
        let mut stored = h.clone();
        stored.extend_from_slice(&[mode, nctx, streams, 0]);
        stored.extend_from_slice(&body);
        let raw_len = (h.len() + 1200) as u64;
        if let Ok(out) = decode(&stored, raw_len) {
            prop_assert_eq!(out.len() as u64, raw_len);
        }
    }
}

/// Decodes the block `stored` of `n` `W`-byte elements with the decoder and with the reference
/// it replaced (one 8-byte load per element): the same elements, the same end, or the same
/// error.
fn same_as_reference<const W: usize>(stored: &[u8], n: usize) -> Result<(), TestCaseError> {
    let (mut got, mut want) = (vec![0u8; n * W], vec![0u8; n * W]);
    let (mut at_got, mut at_want) = (0, 0);
    let r_got = block_decode::decode::<W>(stored, &mut at_got, &mut got, 1);
    let r_want = block_decode_reference::decode::<W>(stored, &mut at_want, &mut want);
    prop_assert_eq!(&r_got, &r_want);
    if r_want.is_ok() {
        prop_assert_eq!(at_got, at_want);
        prop_assert!(got == want, "elements differ");
    }
    Ok(())
}

/// Blocks of `W`-byte elements (activation-like or any bits) coded into `streams` streams.
fn coded_block<const W: usize>(
    data: &[u8],
    stride: usize,
    exp_shift: u32,
    streams: usize,
) -> Vec<u8> {
    let mut out = Vec::new();
    let plan = block_encode::Plan { stride, exp_shift };
    block_encode::encode_with_streams::<W>(data, &plan, streams, &mut out);
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// The side-by-side decoder with register bit buffers decodes every width and stream count
    /// as its reference does, and refuses damaged blocks (a flipped byte anywhere, a block cut
    /// short, a byte too many) with the same error.
    #[test]
    fn decoder_equals_its_reference(
        rows in 1usize..120,
        cols in 1usize..70,
        streams in prop::sample::select(vec![1usize, 2, 4, 8]),
        wide in any::<bool>(),
        random_bits in any::<bool>(),
        stride_at in 0usize..3,
        seed in any::<u64>(),
        damage in 0usize..4,
        at in any::<prop::sample::Index>(),
        flip in 1u8..=255,
    ) {
        let n = rows * cols;
        let width = if wide { 4 } else { 2 };
        let data = sample(rows, cols, width, random_bits, seed);
        let stride = [0, cols, 3 * cols + 1][stride_at];
        let mut block = if wide {
            coded_block::<4>(&data, stride, 0, streams)
        } else {
            coded_block::<2>(&data, stride, 3 * (seed % 2) as u32, streams)
        };
        match damage {
            1 => {
                let i = at.index(block.len());
                block[i] ^= flip;
            }
            2 => {
                let len = at.index(block.len());
                block.truncate(len);
            }
            3 => block.push(flip),
            _ => {}
        }
        if wide {
            same_as_reference::<4>(&block, n)?;
        } else {
            same_as_reference::<2>(&block, n)?;
        }
    }
}

/// Decodes the column block `stored` of `n` `W`-byte elements with the decoder (on up to
/// `threads` threads) and with its plain reference: the same elements and the same end, or both
/// an error (not always the same one: the decoder meets the streams' faults side by side, the
/// reference one stream after the other).
fn column_same_as_reference<const W: usize>(
    stored: &[u8],
    n: usize,
    threads: usize,
) -> Result<(), TestCaseError> {
    let (mut got, mut want) = (vec![0u8; n * W], vec![0u8; n * W]);
    let (mut at_got, mut at_want) = (1, 1);
    let r_got = column_decode::decode::<W>(stored, &mut at_got, &mut got, threads);
    let r_want = column_decode_reference::decode::<W>(stored, &mut at_want, &mut want);
    prop_assert_eq!(r_got.is_ok(), r_want.is_ok(), "{:?} vs {:?}", r_got, r_want);
    if r_want.is_ok() {
        prop_assert_eq!(at_got, at_want);
        prop_assert!(got == want, "elements differ");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// The column decoder (four streams side by side, up to three codes a lookup, SSE2 rows;
    /// streams and rows split over 1 to 4 threads, in tests from one stream and 8 rows a
    /// thread) decodes every width, column count and stream count as its plain reference does, the
    /// data comes back, and damaged blocks (a flipped byte anywhere, a block cut short, a byte
    /// too many) are refused with the same error.
    #[test]
    fn column_decoder_equals_its_reference(
        rows in 1usize..90,
        cols in 1usize..70,
        streams_at in any::<prop::sample::Index>(),
        wide in any::<bool>(),
        random_bits in any::<bool>(),
        seed in any::<u64>(),
        damage in 0usize..4,
        at in any::<prop::sample::Index>(),
        flip in 1u8..=255,
        threads in 1usize..5,
    ) {
        let n = rows * cols;
        let width = if wide { 4 } else { 2 };
        let data = sample(rows, cols, width, random_bits, seed);
        // Few streams and as many as there are columns both matter.
        let streams = [1 + streams_at.index(cols), 4.min(cols), cols][seed as usize % 3];
        let mut block = Vec::new();
        if wide {
            column_encode::encode::<4>(&data, cols, streams, contexts::<4>(&data, 0), &mut block);
        } else {
            column_encode::encode::<2>(&data, cols, streams, contexts::<2>(&data, 3 * (seed % 2) as u32), &mut block);
        }
        if damage == 0 {
            let mut back = vec![0u8; n * width];
            let mut at = 1;
            if wide {
                column_decode::decode::<4>(&block, &mut at, &mut back, threads).unwrap();
            } else {
                column_decode::decode::<2>(&block, &mut at, &mut back, threads).unwrap();
            }
            prop_assert!(back == data, "the data does not come back");
            prop_assert_eq!(at, block.len());
        }
        match damage {
            1 => {
                let i = at.index(block.len());
                block[i] ^= flip;
            }
            2 => {
                let len = at.index(block.len());
                block.truncate(len);
            }
            3 => block.push(flip),
            _ => {}
        }
        if wide {
            column_same_as_reference::<4>(&block, n, threads)?;
        } else {
            column_same_as_reference::<2>(&block, n, threads)?;
        }
    }
}

/// The contexts the writer picks for `data`.
fn contexts<const W: usize>(data: &[u8], exp_shift: u32) -> column_encode::Contexts {
    column_encode::Contexts {
        mode: block_encode::common_exponent::<W>(data, exp_shift),
        exp_shift,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// The column encoder writes what its plain reference writes, byte for byte: for any shape
    /// (few rows, one row, rows and columns that are and are not multiples of 8, the SIMD
    /// tiles' edges), stream count, element width, context map and data.
    #[test]
    fn column_encoder_equals_its_reference(
        rows in 1usize..70,
        cols in 1usize..70,
        streams_at in any::<prop::sample::Index>(),
        wide in any::<bool>(),
        random_bits in any::<bool>(),
        exp_shift in 0u32..4,
        mode in any::<Option<u8>>(),
        seed in any::<u64>(),
    ) {
        let width = if wide { 4 } else { 2 };
        let data = sample(rows, cols, width, random_bits, seed);
        let streams = 1 + streams_at.index(cols);
        if wide {
            encoder_same_as_reference::<4>(&data, cols, streams, mode, exp_shift)?;
        } else {
            encoder_same_as_reference::<2>(&data, cols, streams, mode, exp_shift)?;
        }
    }
}

/// The column encoder's block of `data` equals its reference's, with the contexts of `mode`
/// (None: the writer's pick).
fn encoder_same_as_reference<const W: usize>(
    data: &[u8],
    cols: usize,
    streams: usize,
    mode: Option<u8>,
    exp_shift: u32,
) -> Result<(), TestCaseError> {
    let ctx = match mode {
        Some(mode) => column_encode::Contexts { mode, exp_shift },
        None => contexts::<W>(data, exp_shift),
    };
    let (mut got, mut want) = (Vec::new(), Vec::new());
    column_encode::encode::<W>(data, cols, streams, ctx, &mut got);
    column_encode_reference::encode::<W>(data, cols, streams, ctx, &mut want);
    prop_assert_eq!(got, want);
    Ok(())
}

/// `check_block` (what the writer runs on blocks another encoder made) takes the column blocks
/// this encoder writes, and refuses one cut short, one a byte too long, one for another size.
#[test]
fn check_block_takes_column_blocks() {
    for (dtype, w) in [(Dtype::BF16, 2), (Dtype::F32, 4)] {
        let (rows, cols) = (300, 70);
        let data = activations(rows, cols, w, 9);
        let mut block = Vec::new();
        if w == 2 {
            column_encode::encode::<2>(&data, cols, 3, contexts::<2>(&data, 0), &mut block);
        } else {
            column_encode::encode::<4>(&data, cols, 3, contexts::<4>(&data, 0), &mut block);
        }
        assert_eq!(block[0], column::MODE_COLUMNS);
        let n = rows * cols;
        check_block(&block, dtype, n).unwrap();
        assert!(check_block(&block[..block.len() - 1], dtype, n).is_err());
        let mut long = block.clone();
        long.push(0);
        assert!(check_block(&long, dtype, n).is_err());
        assert!(check_block(&block, dtype, n - cols).is_err());
    }
}

/// A block larger than a thread keeps a scratch buffer for decodes with a buffer of its own,
/// and a small one after it with the kept buffer again.
#[test]
fn a_block_past_the_kept_scratch_round_trips() {
    let (rows, cols) = (2100, 2048);
    let (h, d) = blob(&[(
        Dtype::BF16,
        vec![rows, cols],
        activations(rows as usize, cols as usize, 2, 3),
    )]);
    round_trip(&h, &d);
    let (h, d) = blob(&[(Dtype::BF16, vec![40, 64], activations(40, 64, 2, 4))]);
    round_trip(&h, &d);
}

/// Blocks whose column length is a multiple of 128 rows, where the decoder leaves a cache line
/// between streams' tops: the shapes the reader meets (512 and 1,024 tokens of 7 layers of 384,
/// the writer's stream count; 4,096 columns of 512 rows), on the wide loops (AVX-512 streams and
/// rows where the CPU has them), and small ones of every width, of column counts the SIMD rows
/// do not cover whole and of few and many streams; 500 tokens (no gap) beside them. Over 1 and
/// 2 threads the decoder decodes them as its plain reference does, and the data comes back.
#[test]
fn blocks_with_gaps_between_streams_equal_the_reference() {
    let reader = [(512 * 7, 384), (1024 * 7, 384), (500 * 7, 384), (512, 4096)];
    let small = [(128, 44), (256, 37), (128, 8), (384, 64)];
    for (rows, cols) in reader.into_iter().chain(small) {
        let n = rows * cols;
        let data = activations(rows, cols, 4, rows as u64 ^ cols as u64);
        let bf16: Vec<u8> = data.chunks_exact(4).flat_map(|e| [e[2], e[3]]).collect();
        let few = column_encode::streams_for(n, cols);
        for streams in [few, cols.min(2 * few).max(few), 3.min(cols)] {
            for width in [2, 4] {
                let data = if width == 2 { &bf16 } else { &data };
                let mut block = Vec::new();
                if width == 2 {
                    column_encode::encode::<2>(
                        data,
                        cols,
                        streams,
                        contexts::<2>(data, 0),
                        &mut block,
                    );
                } else {
                    column_encode::encode::<4>(
                        data,
                        cols,
                        streams,
                        contexts::<4>(data, 0),
                        &mut block,
                    );
                }
                for threads in [1, 2] {
                    let mut back = vec![0u8; n * width];
                    let mut at = 1;
                    if width == 2 {
                        column_decode::decode::<2>(&block, &mut at, &mut back, threads).unwrap();
                        column_same_as_reference::<2>(&block, n, threads).unwrap();
                    } else {
                        column_decode::decode::<4>(&block, &mut at, &mut back, threads).unwrap();
                        column_same_as_reference::<4>(&block, n, threads).unwrap();
                    }
                    assert!(&back == data, "{rows} x {cols}, {streams} streams, {width}-byte: the data does not come back");
                }
                if rows * cols > 1 << 20 {
                    break; // the reader's shapes: bf16 at the writer's stream counts is enough
                }
            }
        }
    }
}
