//! Encode and decode throughput of codec `exp-huf` beside `bp16-zstd` level 1 (what
//! benches/bench_codecs.py compares it with), on records of real activations when
//! `LAYERTAP_BENCH_ACTIVATIONS` names a file of raw little-endian bf16 `[tokens, 7, 384]` (the
//! `bf16` tensor of benches/.cache/activations.safetensors, as bytes), else on normal(0, 1)
//! samples rounded to bf16. Records are 512 tokens, as in bench_codecs.py. Throughput is in raw
//! bytes per second; compare the two codecs within one run (the machine may be loaded).
//!
//! Run with `cargo bench -p layertap-core --bench exphuf`.
//!
//! Comparing two builds: each decode allocates its output, and whether those pages are faulted
//! in anew every time depends on glibc's dynamic mmap and trim thresholds, which a change of a
//! few kilobytes in another allocation can tip (seen: 310,000 page faults against 49,000, the
//! decode of both codecs at half speed, with no change to their code). Pin them for an A/B:
//! `MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=1073741824`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use layertap_core::blob::{build_header, TensorSpec};
use layertap_core::codec::{decode, Encoder};
use layertap_core::{Codec, Dtype};
use std::collections::BTreeMap;
use std::hint::black_box;

/// Tokens of the record: 512, or `LAYERTAP_BENCH_TOKENS` (small records take other paths).
fn tokens() -> usize {
    std::env::var("LAYERTAP_BENCH_TOKENS").map_or(512, |t| t.parse().expect("a token count"))
}
const LAYERS: usize = 7;
const HIDDEN: usize = 384;

/// bf16 bytes of one record: real activations if given, else normal(0, 1) samples.
fn hidden() -> (Vec<u8>, &'static str) {
    let n = tokens() * LAYERS * HIDDEN;
    if let Ok(path) = std::env::var("LAYERTAP_BENCH_ACTIVATIONS") {
        let mut b = std::fs::read(&path).expect("activations file");
        assert!(
            b.len() >= 2 * n,
            "{path} holds fewer than {} tokens",
            tokens()
        );
        b.truncate(2 * n);
        return (b, "activations");
    }
    let mut s = 7u64;
    let mut out = Vec::with_capacity(2 * n);
    while out.len() < 2 * n {
        let mut u = || {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            ((s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        let (u1, u2) = (u(), u());
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        let bits = (z as f32).to_bits();
        let rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
        out.extend_from_slice(&(rounded as u16).to_le_bytes());
    }
    (out, "normal")
}

fn exphuf(c: &mut Criterion) {
    let (hidden, what) = hidden();
    let specs = [TensorSpec {
        name: "hidden_states".into(),
        dtype: Dtype::BF16,
        shape: vec![tokens() as u64, LAYERS as u64, HIDDEN as u64],
    }];
    let header = build_header(&specs, &BTreeMap::new()).unwrap();
    let pieces: [&[u8]; 2] = [&header, &hidden];
    let two_byte = [false, true];
    let raw_len = (header.len() + hidden.len()) as u64;
    let codecs = [(Codec::Bp16Zstd, 1), (Codec::ExpHuf, 1)];
    if std::env::var_os("LAYERTAP_BENCH_QUICK").is_some() {
        return quick(&pieces, &two_byte, raw_len, &codecs);
    }

    let mut g = c.benchmark_group(format!("encode {what}"));
    g.throughput(Throughput::Bytes(raw_len));
    g.sample_size(30);
    for (codec, level) in codecs {
        let mut enc = Encoder::new(codec, level).unwrap();
        let mut out = Vec::new();
        enc.encode_into(&pieces, &two_byte, &mut out).unwrap();
        eprintln!("{codec}: ratio {:.4}", raw_len as f64 / out.len() as f64);
        g.bench_function(codec.to_string(), |b| {
            b.iter(|| {
                enc.encode_into(black_box(&pieces), &two_byte, &mut out)
                    .unwrap();
            });
        });
    }
    g.finish();

    let mut g = c.benchmark_group(format!("decode {what}"));
    g.throughput(Throughput::Bytes(raw_len));
    g.sample_size(30);
    for (codec, level) in codecs {
        let stored = Encoder::new(codec, level)
            .unwrap()
            .encode(&pieces, &two_byte)
            .unwrap();
        g.bench_function(codec.to_string(), |b| {
            b.iter(|| decode(codec, black_box(&stored), raw_len).unwrap());
        });
    }
    g.finish();
}

/// The codecs timed in turns, many rounds, each one's fastest round kept: on a loaded machine
/// the fastest of many is the least disturbed, and taking turns exposes both to the same load.
fn quick(pieces: &[&[u8]], two_byte: &[bool], raw_len: u64, codecs: &[(Codec, i32)]) {
    use std::time::{Duration, Instant};
    let mut encoders: Vec<_> = codecs
        .iter()
        .map(|&(c, l)| (Encoder::new(c, l).unwrap(), Vec::new()))
        .collect();
    let stored: Vec<_> = codecs
        .iter()
        .map(|&(c, l)| {
            Encoder::new(c, l)
                .unwrap()
                .encode(pieces, two_byte)
                .unwrap()
        })
        .collect();
    let mut best = vec![[Duration::MAX; 2]; codecs.len()];
    for _ in 0..200 {
        for (i, &(codec, _)) in codecs.iter().enumerate() {
            let (enc, out) = &mut encoders[i];
            let t = Instant::now();
            enc.encode_into(black_box(pieces), two_byte, out).unwrap();
            best[i][0] = best[i][0].min(t.elapsed());
            let t = Instant::now();
            black_box(decode(codec, black_box(&stored[i]), raw_len).unwrap());
            best[i][1] = best[i][1].min(t.elapsed());
        }
    }
    let gbps = |d: Duration| raw_len as f64 / d.as_secs_f64() / 1e9;
    for (i, &(codec, _)) in codecs.iter().enumerate() {
        println!(
            "{codec}: ratio {:.4}, encode {:.3} GB/s ({:.2}x bp16-zstd), decode {:.3} GB/s ({:.2}x)",
            raw_len as f64 / stored[i].len() as f64,
            gbps(best[i][0]),
            best[0][0].as_secs_f64() / best[i][0].as_secs_f64(),
            gbps(best[i][1]),
            best[0][1].as_secs_f64() / best[i][1].as_secs_f64(),
        );
    }
}

criterion_group!(benches, exphuf);
criterion_main!(benches);
