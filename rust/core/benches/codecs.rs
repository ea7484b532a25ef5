//! Encode and decode throughput of each codec on a realistic record: bf16 hidden states
//! `[512 tokens, 4 layers, 1024]` (4 MiB) drawn from normal(0, 1) and rounded to bf16, plus
//! i64 token ids. Throughput is in raw (decoded) bytes per second; then `bp16-zstd`'s byte
//! planes split and joined alone.
//!
//! Run with `cargo bench -p layertap-core --bench codecs`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use layertap_core::blob::{build_header, TensorSpec};
use layertap_core::codec::{decode, join_planes, split_planes, Encoder};
use layertap_core::format::{crc32c, crc32c_append};
use layertap_core::{Codec, Dtype};
use std::collections::BTreeMap;
use std::hint::black_box;

const TOKENS: u64 = 512;
const LAYERS: u64 = 4;
const HIDDEN: u64 = 1024;

/// xorshift64* uniform in (0, 1).
fn uniform(state: &mut u64) -> f64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    ((state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// bf16 bytes of `n` normal(0, 1) samples (Box-Muller), rounded to nearest even.
fn normal_bf16(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut out = Vec::with_capacity(2 * n);
    while out.len() < 2 * n {
        let (u1, u2) = (uniform(&mut s), uniform(&mut s));
        let r = (-2.0 * u1.ln()).sqrt();
        for z in [
            r * (std::f64::consts::TAU * u2).cos(),
            r * (std::f64::consts::TAU * u2).sin(),
        ] {
            let bits = (z as f32).to_bits();
            let rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
            out.extend_from_slice(&(rounded as u16).to_le_bytes());
        }
    }
    out.truncate(2 * n);
    out
}

struct Sample {
    header: Vec<u8>,
    hidden: Vec<u8>,
    ids: Vec<u8>,
}

impl Sample {
    fn new() -> Sample {
        let specs = vec![
            TensorSpec {
                name: "hidden_states".into(),
                dtype: Dtype::BF16,
                shape: vec![TOKENS, LAYERS, HIDDEN],
            },
            TensorSpec {
                name: "token_ids".into(),
                dtype: Dtype::I64,
                shape: vec![TOKENS],
            },
        ];
        let meta = BTreeMap::from([("key".to_string(), "bench-0".to_string())]);
        let header = build_header(&specs, &meta).unwrap();
        let hidden = normal_bf16((TOKENS * LAYERS * HIDDEN) as usize, 7);
        let ids: Vec<u8> = (0..TOKENS as i64)
            .flat_map(|t| (t * 37 % 32000).to_le_bytes())
            .collect();
        Sample {
            header,
            hidden,
            ids,
        }
    }

    fn pieces(&self) -> [&[u8]; 3] {
        [&self.header, &self.hidden, &self.ids]
    }

    fn raw_len(&self) -> u64 {
        self.pieces().iter().map(|p| p.len() as u64).sum()
    }
}

fn codecs(c: &mut Criterion) {
    let sample = Sample::new();
    let raw_len = sample.raw_len();
    let two_byte = [false, true, false];

    let mut g = c.benchmark_group("encode");
    g.throughput(Throughput::Bytes(raw_len));
    g.sample_size(20);
    g.bench_function("none (crc32c only)", |b| {
        b.iter(|| {
            let mut crc = crc32c(&sample.header);
            crc = crc32c_append(crc, &sample.hidden);
            black_box(crc32c_append(crc, &sample.ids))
        });
    });
    for codec in [Codec::Zstd, Codec::Bp16Zstd] {
        for level in [1, 3] {
            let mut enc = Encoder::new(codec, level).unwrap();
            let mut out = Vec::new();
            enc.encode_into(&sample.pieces(), &two_byte, &mut out)
                .unwrap();
            eprintln!(
                "{codec} level {level}: ratio {:.3}",
                raw_len as f64 / out.len() as f64
            );
            g.bench_function(format!("{codec} level {level}"), |b| {
                b.iter(|| {
                    enc.encode_into(black_box(&sample.pieces()), &two_byte, &mut out)
                        .unwrap();
                });
            });
        }
    }
    g.finish();

    let mut g = c.benchmark_group("decode");
    g.throughput(Throughput::Bytes(raw_len));
    g.sample_size(20);
    for codec in Codec::ALL {
        for level in [1, 3] {
            if codec == Codec::None && level == 3 {
                continue;
            }
            let stored = Encoder::new(codec, level)
                .unwrap()
                .encode(&sample.pieces(), &two_byte)
                .unwrap();
            let name = if codec == Codec::None {
                "none".to_string()
            } else {
                format!("{codec} level {level}")
            };
            g.bench_function(name, |b| {
                b.iter(|| decode(codec, black_box(&stored), raw_len).unwrap());
            });
        }
    }
    g.finish();

    // bp16-zstd's byte planes alone (its writer splits them, its readers join them).
    let mut g = c.benchmark_group("byte planes");
    g.throughput(Throughput::Bytes(sample.hidden.len() as u64));
    let mut planes = vec![0u8; sample.hidden.len()];
    let mut back = vec![0u8; sample.hidden.len()];
    g.bench_function("split", |b| {
        b.iter(|| split_planes(black_box(&sample.hidden), &mut planes));
    });
    g.bench_function("join", |b| {
        b.iter(|| join_planes(black_box(&planes), &mut back));
    });
    g.finish();
}

criterion_group!(benches, codecs);
criterion_main!(benches);
