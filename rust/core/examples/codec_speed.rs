//! Ratio and single-thread encode/decode speed of each codec on real activations, without the
//! writer or Python around it (benches/bench_codecs.py measures the whole path).
//!
//!     cargo run --release -p layertap-core --example codec_speed -- benches/.cache/activations.safetensors
//!
//! The file is what benches/activations.py writes: `bf16`, `f16` and `f32` tensors of shape
//! `[tokens, layers, hidden]`; records are 512 tokens of hidden states, as in bench_codecs.py.

use layertap_core::blob::{build_header, TensorSpec};
use layertap_core::codec::{decode, Encoder};
use layertap_core::{Codec, Dtype};
use std::collections::BTreeMap;

const RECORD_TOKENS: usize = 512;

/// CPU seconds this thread has run: the machine is shared, so wall time would measure the
/// neighbours too.
fn cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec the call writes into.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &raw mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn main() {
    let path = std::env::args()
        .nth(1)
        .expect("usage: codec_speed ACTIVATIONS.safetensors");
    let bytes = std::fs::read(&path).expect("read activations");
    // The file is a safetensors file: the blob parser reads it.
    let file = layertap_core::blob::parse_header(&bytes).expect("a safetensors file");
    let passes: usize = std::env::var("PASSES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let records: usize = std::env::var("RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    println!("| dtype | codec | ratio | encode GB/CPU-s | decode GB/CPU-s |");
    println!("|---|---|---:|---:|---:|");
    for (name, dtype) in [
        ("bf16", Dtype::BF16),
        ("f16", Dtype::F16),
        ("f32", Dtype::F32),
    ] {
        let t = file
            .tensors
            .iter()
            .find(|t| t.spec.name == name)
            .expect("tensor");
        let shape = t.spec.shape.clone();
        let all = &bytes[t.range.clone()];
        let per_token = all.len() / shape[0] as usize;
        let recs: Vec<(Vec<u8>, &[u8])> = (0..records.min(shape[0] as usize / RECORD_TOKENS))
            .map(|r| {
                let spec = TensorSpec {
                    name: "hidden_states".into(),
                    dtype,
                    shape: vec![RECORD_TOKENS as u64, shape[1], shape[2]],
                };
                let meta = BTreeMap::from([("key".to_string(), format!("r{r}"))]);
                let data = &all[r * RECORD_TOKENS * per_token..(r + 1) * RECORD_TOKENS * per_token];
                (build_header(&[spec], &meta).unwrap(), data)
            })
            .collect();
        let raw: usize = recs.iter().map(|(h, d)| h.len() + d.len()).sum();
        let only = std::env::var("CODEC").ok();
        for (codec, level) in [(Codec::Zstd, 1), (Codec::Bp16Zstd, 1), (Codec::ExpHuf, 1)] {
            if only.as_deref().is_some_and(|c| c != codec.name()) {
                continue;
            }
            // Best of a few passes: the machine is shared, and the fastest pass is the one
            // least disturbed.
            let mut enc = Encoder::new(codec, level).unwrap();
            let mut stored = Vec::new();
            let (mut enc_s, mut dec_s) = (f64::MAX, f64::MAX);
            for _ in 0..passes {
                stored.clear();
                let t0 = cpu_seconds();
                for (h, d) in &recs {
                    stored.push(enc.encode(&[h, d], &[false, true]).unwrap());
                }
                enc_s = enc_s.min(cpu_seconds() - t0);
                let t0 = cpu_seconds();
                for ((h, d), s) in recs.iter().zip(&stored) {
                    let out = decode(codec, s, (h.len() + d.len()) as u64).unwrap();
                    assert_eq!(out.blob.len(), h.len() + d.len());
                    std::hint::black_box(out);
                }
                dec_s = dec_s.min(cpu_seconds() - t0);
            }
            let st: usize = stored.iter().map(Vec::len).sum();
            println!(
                "| {name} | {codec} | {:.4} | {:.2} | {:.2} |",
                raw as f64 / st as f64,
                raw as f64 / enc_s / 1e9,
                raw as f64 / dec_s / 1e9
            );
        }
    }
}
