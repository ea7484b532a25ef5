//! A batch of payloads of both block modes parsed, then decoded from its arrays alone (lanes,
//! tables, context maps, merges, copies) as the device kernels decode them, against the
//! tensors encoded; damaged heads refused with the record, tensor and context named; any cut
//! and any byte refused or parsed, never a panic.

use super::*;
use crate::blob::{build_header, TensorSpec};
use crate::exphuf::block::{peek, top_of_symbol};
use crate::exphuf::{encode_as, Layout};

/// xorshift64* numbers.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// `n` activation-like elements of `w` bytes (a few exponents a channel, random mantissas), so
/// that the blocks are coded.
fn acts(n: usize, w: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed | 1);
    let mut out = Vec::with_capacity(n * w);
    for i in 0..n {
        let r = rng.next();
        let exponent = 120 + (i % 5) as u64 + (r >> 62);
        let sign = (r >> 40) & 1;
        if w == 2 {
            out.extend_from_slice(&((sign << 15 | exponent << 7 | (r & 127)) as u16).to_le_bytes());
        } else {
            let bits = sign << 31 | exponent << 23 | (r & 0x7F_FFFF);
            out.extend_from_slice(&(bits as u32).to_le_bytes());
        }
    }
    out
}

/// A record of `tensors` (name, dtype, shape, bytes) encoded with its blocks in `layout`; and
/// its raw blob.
fn record(
    key: &str,
    tensors: &[(&str, Dtype, Vec<u64>, Vec<u8>)],
    layout: Layout,
) -> (Vec<u8>, Vec<u8>) {
    let specs: Vec<TensorSpec> = tensors
        .iter()
        .map(|(name, dtype, shape, _)| TensorSpec {
            name: name.to_string(),
            dtype: *dtype,
            shape: shape.clone(),
        })
        .collect();
    let meta = BTreeMap::from([("key".to_string(), key.to_string())]);
    let mut raw = build_header(&specs, &meta).unwrap();
    for t in tensors {
        raw.extend_from_slice(&t.3);
    }
    let mut stored = Vec::new();
    encode_as(&[&raw], layout, &mut stored).unwrap();
    (raw, stored)
}

/// The payloads back to back in one buffer, each at a multiple of 8 after a gap (as the
/// decoder's staging lays them out, with room between): the buffer and each one's base.
fn staged(payloads: &[Vec<u8>]) -> (Vec<u8>, Vec<u64>) {
    let mut buf = vec![0xAB; 16];
    let mut bases = Vec::new();
    for p in payloads {
        bases.push(buf.len() as u64);
        buf.extend_from_slice(p);
        buf.resize(crate::format::align8(buf.len() as u64) as usize + 8, 0xAB);
    }
    (buf, bases)
}

fn parse(payloads: &[Vec<u8>]) -> (Vec<u8>, Result<BatchHeads, BatchProblem>) {
    let (buf, bases) = staged(payloads);
    let views: Vec<(&[u8], u64)> = payloads
        .iter()
        .zip(&bases)
        .map(|(p, &b)| (&buf[b as usize..b as usize + p.len()], b))
        .collect();
    let heads = parse_batch(&views);
    (buf, heads)
}

/// Per table, its decode table: entry `x` (the next 11 bits) is `symbol << 4 | length`, 0 where
/// no code starts.
fn decode_tables(heads: &BatchHeads) -> Vec<Vec<u32>> {
    heads
        .lengths
        .iter()
        .map(|l| {
            huffman::check_lengths(l).unwrap();
            let mut t = vec![0u32; 1 << huffman::MAX_CODE_LEN];
            huffman::fill_decode_table(l, |s, len| (s as u32) << 4 | len as u32, &mut t);
            t
        })
        .collect()
}

/// The next code at bit `*bit` of `buf` in table `table`: its top 9 bits; `*bit` moves past it.
fn code(buf: &[u8], bit: &mut u64, table: &[u32]) -> u64 {
    let entry = table[(peek(buf, *bit) & 2047) as usize];
    assert_ne!(entry & 15, 0, "no code at bit {bit}");
    *bit += (entry & 15) as u64;
    top_of_symbol((entry >> 4) as usize) as u64
}

fn bits(buf: &[u8], bit: u64, n: u32) -> u64 {
    peek(buf, bit) & ((1 << n) - 1)
}

/// The outputs of 2- and 4-byte elements and of copies, decoded from `buf` by the arrays of
/// `heads` alone, as the kernels decode them.
fn decode(buf: &[u8], heads: &BatchHeads) -> ([Vec<u64>; 2], Vec<u8>) {
    let tables = decode_tables(heads);
    let mut outs = [
        vec![u64::MAX; heads.elements[0] as usize],
        vec![u64::MAX; heads.elements[1] as usize],
    ];
    for (wi, lanes) in heads.element_lanes.iter().enumerate() {
        let raw_bits = if wi == 0 { 7 } else { 23 };
        for &[bit, end, start, count, stride, b, _] in lanes {
            let block = &heads.blocks[b as usize];
            let (mut bit, start, stride) = (bit as u64, start as usize, stride as usize);
            for j in 0..count as usize {
                let ctx = if stride > 0 && j >= stride {
                    block.context_of_top[(outs[wi][start + j - stride] >> raw_bits) as usize]
                } else {
                    0
                };
                let top = code(buf, &mut bit, &tables[block.first_table + ctx as usize]);
                outs[wi][start + j] = top << raw_bits | bits(buf, bit, raw_bits);
                bit += raw_bits as u64;
            }
            assert_eq!(bit.div_ceil(8), end as u64 / 8, "a stream's end");
        }
    }
    let mut tops = vec![u64::MAX; heads.tops as usize];
    for &[bit, end, start, count, b, _, longest] in &heads.column_lanes {
        let block = &heads.blocks[b as usize];
        assert!(count <= longest);
        let (mut bit, mut ctx) = (bit as u64, 0);
        for j in 0..count as usize {
            let top = code(buf, &mut bit, &tables[block.first_table + ctx]);
            tops[start as usize + j] = top;
            ctx = block.context_of_top[top as usize] as usize;
        }
        assert_eq!(bit.div_ceil(8), end as u64 / 8, "a stream's end");
    }
    for (wi, merges) in heads.merges.iter().enumerate() {
        let raw_bits = if wi == 0 { 7 } else { 23 };
        for &[plane, tops0, out0, n, columns, rows] in merges {
            for i in 0..n {
                let (row, col) = (i / columns, i % columns);
                let top = tops[(tops0 + col * rows + row) as usize];
                let raw = bits(buf, plane as u64 + (i * raw_bits) as u64, raw_bits as u32);
                outs[wi][(out0 + i) as usize] = top << raw_bits | raw;
            }
        }
    }
    let mut plain = vec![0u8; heads.plain_bytes as usize];
    for &[from, len, to] in &heads.plain {
        let (from, len, to) = (from as usize, len as usize, to as usize);
        plain[to..to + len].copy_from_slice(&buf[from..from + len]);
    }
    (outs, plain)
}

/// The bytes of each tensor of each record as the decoded outputs hold them.
fn tensors_of(
    heads: &BatchHeads,
    outs: &[Vec<u64>; 2],
    plain: &[u8],
) -> Vec<Vec<(String, Vec<u8>)>> {
    (0..heads.metadata.len())
        .map(|r| {
            heads.tensors[heads.record_tensors[r]..heads.record_tensors[r + 1]]
                .iter()
                .map(|t| {
                    let n = t.shape.iter().product::<u64>() as usize;
                    let start = t.start as usize;
                    let bytes = match t.width {
                        0 => plain[start..start + n * t.dtype.size()].to_vec(),
                        2 => outs[0][start..start + n]
                            .iter()
                            .flat_map(|&x| (x as u16).to_le_bytes())
                            .collect(),
                        _ => outs[1][start..start + n]
                            .iter()
                            .flat_map(|&x| (x as u32).to_le_bytes())
                            .collect(),
                    };
                    (t.name.clone(), bytes)
                })
                .collect()
        })
        .collect()
}

fn ids(n: u64) -> Vec<u8> {
    (0..n)
        .flat_map(|i| (i as i64 * 7 - 3).to_le_bytes())
        .collect()
}

/// A record's tensors: name, dtype, shape, bytes.
type Tensors = Vec<(&'static str, Dtype, Vec<u64>, Vec<u8>)>;

/// Records of both modes, several dtypes and a raw block: their tensors and payloads.
fn mixed() -> Vec<(Tensors, Vec<u8>)> {
    let cases = [
        (
            vec![
                ("h", Dtype::BF16, vec![24, 3, 64], acts(24 * 3 * 64, 2, 1)),
                ("ids", Dtype::I64, vec![24], ids(24)),
            ],
            Layout::ByColumn,
        ),
        (
            vec![
                ("h", Dtype::BF16, vec![20, 2, 50], acts(2000, 2, 2)),
                ("ids", Dtype::I64, vec![20], ids(20)),
            ],
            Layout::ByElement,
        ),
        (
            vec![
                ("f", Dtype::F32, vec![30, 40], acts(1200, 4, 3)),
                ("b", Dtype::BF16, vec![7, 9], acts(63, 2, 4)),
            ],
            Layout::ByColumn,
        ),
        (
            vec![
                ("f", Dtype::F32, vec![16, 3, 20], acts(960, 4, 5)),
                ("e", Dtype::BF16, vec![0, 4], vec![]),
            ],
            Layout::ByElement,
        ),
        // random bits: a raw block (mode 0), copied
        (
            vec![(
                "noise",
                Dtype::BF16,
                vec![100],
                (0..200).map(|i| (i * 37 % 251) as u8).collect(),
            )],
            Layout::ByColumn,
        ),
    ];
    cases
        .into_iter()
        .enumerate()
        .map(|(r, (tensors, layout))| {
            let (_, stored) = record(&format!("r{r}"), &tensors, layout);
            (tensors, stored)
        })
        .collect()
}

#[test]
fn a_batch_of_both_modes_decodes_from_its_arrays_alone() {
    let records = mixed();
    let payloads: Vec<Vec<u8>> = records.iter().map(|r| r.1.clone()).collect();
    let (buf, heads) = parse(&payloads);
    let heads = heads.unwrap();
    // Every mode is there: mode-1 and mode-2 blocks of both widths, and copies.
    assert!(!heads.element_lanes[0].is_empty() && !heads.element_lanes[1].is_empty());
    assert_eq!(
        heads.merges.iter().map(Vec::len).collect::<Vec<_>>(),
        [1, 1]
    );
    assert_eq!(heads.column_blocks.len(), 2);
    let (outs, plain) = decode(&buf, &heads);
    assert!(
        outs.iter().all(|o| o.iter().all(|&x| x != u64::MAX)),
        "an element no lane wrote"
    );
    let got = tensors_of(&heads, &outs, &plain);
    for (r, (tensors, _)) in records.iter().enumerate() {
        assert_eq!(
            heads.metadata[r],
            BTreeMap::from([("key".into(), format!("r{r}"))])
        );
        let want: Vec<(String, Vec<u8>)> = tensors
            .iter()
            .map(|t| (t.0.to_string(), t.3.clone()))
            .collect();
        assert_eq!(got[r], want, "record {r}");
        for (t, place) in tensors
            .iter()
            .zip(&heads.tensors[heads.record_tensors[r]..])
        {
            assert_eq!((place.dtype, &place.shape), (t.1, &t.2));
        }
    }
    // The raw block and the token ids are copies, each at a multiple of 8.
    assert_eq!(heads.plain.len(), 5); // and the empty tensor's, and the small one's raw block
    assert!(heads.plain.iter().all(|c| c[2] % 8 == 0));
    // Mode 2's rows: its block's tables and contexts, lanes in stream order.
    for &[b, first, contexts] in &heads.column_blocks {
        let block = &heads.blocks[b as usize];
        assert_eq!(
            (block.first_table, block.contexts),
            (first as usize, contexts as usize)
        );
    }
}

#[test]
fn an_empty_batch_and_records_without_blocks() {
    assert_eq!(parse_batch(&[]).unwrap().record_tensors, [0]);
    let (_, stored) = record(
        "k",
        &[("ids", Dtype::I64, vec![5], ids(5))],
        Layout::ByColumn,
    );
    let (_, heads) = parse(&[stored.clone(), stored]);
    let heads = heads.unwrap();
    assert_eq!(heads.record_tensors, [0, 1, 2]);
    assert!(heads.lengths.is_empty() && heads.blocks.is_empty());
    assert_eq!(heads.plain_bytes, 80);
}

/// A record of token ids (2,048 of them: so that a cut in the block's head still leaves more
/// than half the raw length) and one bf16 tensor `h` [24, 3, 64] coded in `layout`, and where
/// its block starts.
fn one_block(layout: Layout) -> (Vec<u8>, usize) {
    let tensors = [
        ("ids", Dtype::I64, vec![2048], ids(2048)),
        ("h", Dtype::BF16, vec![24, 3, 64], acts(24 * 3 * 64, 2, 9)),
    ];
    let (_, stored) = record("k", &tensors, layout);
    let at = 8 + u64::from_le_bytes(stored[..8].try_into().unwrap()) as usize + 8 * 2048;
    assert_eq!(stored[at], if layout == Layout::ByColumn { 2 } else { 1 });
    (stored, at)
}

/// Where the stream lengths of the block at `at` are (after its tables).
fn stream_lengths_at(stored: &[u8], at: usize) -> usize {
    let mut p = at
        + 1
        + if stored[at] == 2 {
            column::FIXED_LEN
        } else {
            block::FIXED_LEN
        };
    for _ in 0..stored[at + 1] {
        parse_lengths(stored, &mut p).unwrap();
    }
    p
}

/// The problem of record 1 of a batch whose record 0 is sound and record 1 is `damaged`.
fn problem(damaged: Vec<u8>) -> String {
    let (sound, _) = one_block(Layout::ByElement);
    let err = parse(&[sound, damaged]).1.unwrap_err();
    assert_eq!(err.record, 1);
    err.to_string()
}

#[test]
fn damaged_heads_are_refused_naming_record_tensor_and_context() {
    let frame = "record 1 of the batch is not a valid exp-huf payload: tensor \"h\": ";
    for layout in [Layout::ByElement, Layout::ByColumn] {
        let (stored, at) = one_block(layout);
        let lens = stream_lengths_at(&stored, at);
        let mut bad = stored.clone();
        bad[at] = 7;
        assert_eq!(problem(bad), format!("{frame}block mode 7 is unknown"));
        for contexts in [0, 17] {
            let mut bad = stored.clone();
            bad[at + 1] = contexts;
            assert_eq!(
                problem(bad),
                format!("{frame}block has {contexts} contexts (1 to 16 allowed)")
            );
        }
        // context 1's lengths all 1: over-subscribed
        let mut bad = stored.clone();
        let mut p = at
            + 1
            + if layout == Layout::ByColumn {
                column::FIXED_LEN
            } else {
                block::FIXED_LEN
            };
        parse_lengths(&stored, &mut p).unwrap();
        let count = u16::from_le_bytes([stored[p + 2], stored[p + 3]]) as usize;
        assert!(count >= 3, "context 1 has {count} symbols");
        bad[p + 4..p + 4 + count / 2].fill(0x11);
        assert_eq!(
            problem(bad),
            format!("{frame}context 1: code lengths are over-subscribed (not a prefix code)")
        );
        // its padding nibble, where its count is odd; a length of 12
        let mut bad = stored.clone();
        bad[p + 4] = 0x0C | (bad[p + 4] & 0xF0);
        assert_eq!(
            problem(bad),
            format!("{frame}context 1: code length 12 is over 11")
        );
        // the first stream one byte longer: the last one runs past the payload
        let mut bad = stored.clone();
        let len0 = u64::from_le_bytes(stored[lens..lens + 8].try_into().unwrap());
        bad[lens..lens + 8].copy_from_slice(&(len0 + 1).to_le_bytes());
        assert_eq!(
            problem(bad),
            format!("{frame}a stream runs past the payload")
        );
        // a stream of 2^64 - 1 bytes
        let mut bad = stored.clone();
        bad[lens..lens + 8].fill(0xFF);
        assert_eq!(
            problem(bad),
            format!("{frame}a stream runs past the payload")
        );
        // a byte after the block
        let mut longer = stored.clone();
        longer.push(0);
        assert_eq!(
            problem(longer),
            "record 1 of the batch is not a valid exp-huf payload: 1 bytes after the last tensor's block"
        );
        // cut inside the tables, the stream lengths, the streams
        let tables = at
            + 1
            + if layout == Layout::ByColumn {
                column::FIXED_LEN
            } else {
                block::FIXED_LEN
            };
        assert_eq!(
            problem(stored[..tables + 2].to_vec()),
            format!("{frame}context 0: block is cut off")
        );
        assert_eq!(
            problem(stored[..tables - 1].to_vec()),
            format!("{frame}block is cut off")
        );
        assert_eq!(
            problem(stored[..lens + 4].to_vec()),
            format!("{frame}block is cut off")
        );
    }
    // mode 1: streams the format lacks; mode 2: columns and streams that do not fit the tensor
    let (mut bad, at) = one_block(Layout::ByElement);
    bad[at + 2] = 3;
    assert_eq!(
        problem(bad),
        format!("{frame}block has 3 streams (1, 2, 4 or 8 allowed)")
    );
    let (stored, at) = one_block(Layout::ByColumn);
    let mut bad = stored.clone();
    bad[at + 5..at + 9].copy_from_slice(&100u32.to_le_bytes());
    assert_eq!(
        problem(bad),
        format!("{frame}block of 4608 elements in rows of 100 columns")
    );
    let mut bad = stored.clone();
    bad[at + 9..at + 13].copy_from_slice(&65u32.to_le_bytes());
    assert_eq!(
        problem(bad),
        format!("{frame}block has 65 streams for 64 columns (1 to 64 allowed)")
    );
    let lens = stream_lengths_at(&stored, at);
    let streams = u32::from_le_bytes(stored[at + 9..at + 13].try_into().unwrap()) as usize;
    let plane_end = lens + 8 * streams + (4608 * 7usize).div_ceil(8);
    assert_eq!(
        problem(stored[..plane_end - 1].to_vec()),
        format!("{frame}the raw plane runs past the payload")
    );
}

#[test]
fn damaged_payload_headers_are_refused() {
    let (stored, _) = one_block(Layout::ByColumn);
    let frame = "record 1 of the batch is not a valid exp-huf payload: ";
    assert_eq!(
        problem(stored[..5].to_vec()),
        format!("{frame}payload shorter than a safetensors header")
    );
    let mut bad = stored.clone();
    bad[..8].copy_from_slice(&(stored.len() as u64).to_le_bytes());
    assert_eq!(
        problem(bad),
        format!(
            "{frame}safetensors header length {} does not fit the payload",
            stored.len()
        )
    );
    let mut bad = stored;
    bad[8] = b'[';
    assert!(problem(bad).starts_with(&format!("{frame}safetensors header: ")));
    // a tensor larger than twice the payload
    let specs = [TensorSpec {
        name: "z".into(),
        dtype: Dtype::I64,
        shape: vec![4096],
    }];
    let mut big = build_header(&specs, &BTreeMap::new()).unwrap();
    let raw_len = big.len() + 8 * 4096;
    big.extend_from_slice(&[0; 10]);
    assert_eq!(
        problem(big.clone()),
        format!(
            "{frame}raw length {raw_len} is more than {} stored bytes can decode to",
            big.len()
        )
    );
}

#[test]
fn every_cut_and_every_damaged_byte_is_refused_or_parsed_never_a_panic() {
    for layout in [Layout::ByElement, Layout::ByColumn] {
        let (stored, at) = one_block(layout);
        for cut in 0..stored.len() {
            assert!(parse(&[stored[..cut].to_vec()]).1.is_err(), "cut at {cut}");
        }
        // Every byte of the header and the block's head, and some of the streams, changed.
        let mut rng = Rng(77);
        let lens = stream_lengths_at(&stored, at);
        for p in (0..lens + 64).chain((lens + 64..stored.len()).step_by(97)) {
            for _ in 0..3 {
                let mut bad = stored.clone();
                bad[p] ^= 1 + (rng.next() % 255) as u8;
                let _ = parse(&[bad]);
            }
        }
    }
    let mut rng = Rng(5);
    for n in [0, 8, 9, 100, 1000] {
        let mut bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
        if n >= 8 {
            bytes[..8].copy_from_slice(&((n as u64 - 8) / 2).to_le_bytes());
        }
        assert!(parse(&[bytes]).1.is_err());
    }
}
