//! Lossy storage of hidden states as float8 e4m3 with one scale per token (`lossy =
//! "fp8-e4m3"`, docs/FP8.md): the writer's encoder stage that quantizes a record's
//! `hidden_states` before it is compressed.
//!
//! What a quantized record holds, exactly as the Python reference (`layertap.fp8.quantize`,
//! torch) makes it:
//! - `hidden_states`: `F8_E4M3` `[tokens, ...]`, each value `x` (as `f32`) divided by its
//!   token's scale in `f32`, clamped to +-448 and rounded to the nearest e4m3 value, ties to
//!   even (torch's `to(float8_e4m3fn)`);
//! - `hidden_states_scale`: `F32` `[tokens]`, the token's largest magnitude divided by 448 in
//!   `f32`, 1 for a token of zeros;
//! - metadata `lossy`, `fp8_max_rel_err`, `fp8_mean_rel_err`, `fp8_rms_rel_err` (printf's `%.6g`)
//!   and `fp8_source_dtype` (the record's `dtype` metadata, where it has one). The errors are
//!   informative: summed in `f64` here and in `f32` by torch, they may differ in the last digit.

use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::options::{quoted, refused, Rule};

/// The `lossy` option's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lossy {
    /// float8 e4m3 with a scale per token.
    Fp8E4m3,
}

impl Lossy {
    /// Every value, for error messages.
    pub const ALL: [Lossy; 1] = [Lossy::Fp8E4m3];

    /// The option's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Lossy::Fp8E4m3 => "fp8-e4m3",
        }
    }

    /// The value spelled `name`.
    pub fn from_name(name: &str) -> Result<Lossy> {
        Lossy::ALL
            .iter()
            .copied()
            .find(|l| l.name() == name)
            .ok_or_else(|| refused("lossy", Rule::Lossy, &quoted(name)))
    }
}

/// The tensor a lossy writer quantizes, and the one it adds beside it.
pub const QUANTIZED: &str = crate::record::HIDDEN_STATES;
/// Name of the scales tensor.
pub const SCALE_NAME: &str = "hidden_states_scale";
/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// The e4m3 (`float8_e4m3fn`) byte nearest to `x`, ties to even, for `|x| <= 448` (the caller
/// clamps); NaN maps to e4m3's NaN. Layout: sign, 4 exponent bits (bias 7), 3 mantissa bits;
/// below 2^-6 the values are subnormal, multiples of 2^-9.
pub fn e4m3_from_f32(x: f32) -> u8 {
    if x.is_nan() {
        return ((x.to_bits() >> 24) & 0x80) as u8 | 0x7f;
    }
    e4m3_finite(x)
}

/// `e4m3_from_f32` for a value known not to be NaN (no branch at all: the quantizing loop
/// calls it on every element).
#[inline(always)]
fn e4m3_finite(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    let a = x.abs();
    // Both roundings, then a select: the branch between them would be mispredicted on about
    // every other value of real activations.
    // Below 2^-6: k * 2^-9 with k = 0..=8 (k = 8 is the smallest normal, whose code is 8 too);
    // adding 2^23 rounds to an integer, ties to even, without `round_ties_even`'s library call.
    // The integer is then the low bits of the sum's mantissa.
    const ROUND: f32 = 8_388_608.0;
    let subnormal = (a * 512.0 + ROUND).to_bits() & 0xf;
    // Otherwise the f32 exponent and top 3 mantissa bits, rebiased (127 -> 7), plus one where
    // the 20 bits dropped round up (ties to even); a mantissa carry moves into the exponent.
    let bits = a.to_bits();
    let rest = bits & 0xf_ffff;
    let truncated = (bits >> 20).wrapping_sub(120 << 3);
    let up = u32::from(rest > 0x8_0000) | (u32::from(rest == 0x8_0000) & truncated & 1);
    let normal = truncated.wrapping_add(up);
    let code = if a < 1.0 / 64.0 { subnormal } else { normal };
    sign | code as u8
}

/// The value of a finite e4m3 byte, by arithmetic (no table: the loop over a record stays free
/// of loads that depend on the values).
#[inline(always)]
fn e4m3_finite_value(b: u8) -> f32 {
    let magnitude = u32::from(b & 0x7f);
    let normal = f32::from_bits((magnitude + (120 << 3)) << 20);
    let subnormal = magnitude as f32 / 512.0;
    let v = if magnitude < 8 { subnormal } else { normal };
    if b & 0x80 != 0 {
        -v
    } else {
        v
    }
}

/// The error statistics' sums over the values quantized so far, in f64, in 8 lanes (each lane
/// a fixed order, so the compiler may run them side by side).
#[derive(Default)]
struct ErrorSums {
    max_rel: f64,
    sum_rel: f64,
    nonzero: u64,
    err_sq: f64,
    x_sq: f64,
}

impl ErrorSums {
    fn add(&mut self, row: &[f32], codes: &[u8], scale: f32) {
        const LANES: usize = 8;
        // f32 within a token, as torch sums, in lanes; f64 across tokens.
        let (mut err_sq, mut x_sq, mut rel_sum) = ([0f32; LANES], [0f32; LANES], [0f32; LANES]);
        let (mut rel_max, mut count) = ([0f32; LANES], [0u32; LANES]);
        let done = row.len() - row.len() % LANES;
        for (vs, qs) in row[..done]
            .chunks_exact(LANES)
            .zip(codes[..done].chunks_exact(LANES))
        {
            for l in 0..LANES {
                let (v, q) = (vs[l], qs[l]);
                let err = (e4m3_finite_value(q) * scale - v).abs();
                err_sq[l] += err * err;
                x_sq[l] += v * v;
                // Over the non-zero values only: zeros add 0 and are not counted.
                let nonzero = v != 0.0;
                let rel = if nonzero { err / v.abs() } else { 0.0 };
                rel_max[l] = rel_max[l].max(rel);
                rel_sum[l] += rel;
                count[l] += u32::from(nonzero);
            }
        }
        for (&v, &q) in row[done..].iter().zip(&codes[done..]) {
            let err = (e4m3_finite_value(q) * scale - v).abs();
            err_sq[0] += err * err;
            x_sq[0] += v * v;
            let nonzero = v != 0.0;
            let rel = if nonzero { err / v.abs() } else { 0.0 };
            rel_max[0] = rel_max[0].max(rel);
            rel_sum[0] += rel;
            count[0] += u32::from(nonzero);
        }
        self.err_sq += err_sq.iter().map(|&v| f64::from(v)).sum::<f64>();
        self.x_sq += x_sq.iter().map(|&v| f64::from(v)).sum::<f64>();
        self.sum_rel += rel_sum.iter().map(|&v| f64::from(v)).sum::<f64>();
        self.nonzero += count.iter().map(|&c| u64::from(c)).sum::<u64>();
        self.max_rel = rel_max
            .iter()
            .fold(self.max_rel, |m, &r| m.max(f64::from(r)));
    }
}

/// The value of an e4m3 byte, from a table of all 256 (the error statistics look one up per
/// element).
pub fn e4m3_to_f32(b: u8) -> f32 {
    e4m3_table()[b as usize]
}

fn e4m3_table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|i| e4m3_value(i as u8)))
}

fn e4m3_value(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exponent = (b >> 3) & 0x0f;
    let mantissa = (b & 0x07) as f32;
    if exponent == 0x0f && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    if exponent == 0 {
        return sign * mantissa / 512.0;
    }
    sign * (1.0 + mantissa / 8.0) * 2f32.powi(exponent as i32 - 7)
}

/// A quantized tensor: the e4m3 bytes, the scales (`f32`, little-endian) and the error
/// statistics' metadata entries. `V` holds the values: a `Vec<u8>`, or a buffer of the caller's
/// ([`quantize_into`]).
pub struct Quantized<V = Vec<u8>> {
    /// One byte per element, the input's shape.
    pub values: V,
    /// One little-endian `f32` per token.
    pub scales: Vec<u8>,
    /// `fp8_max_rel_err`, `fp8_mean_rel_err`, `fp8_rms_rel_err`, formatted (`%.6g`).
    pub errors: [(&'static str, String); 3],
}

/// Whether `dtype` is one this stage quantizes.
pub fn quantizable(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32)
}

/// Appends `data`'s values (of `dtype`, little-endian) to `out` as f32, exactly.
fn to_f32_into(dtype: Dtype, data: &[u8], out: &mut Vec<f32>) {
    match dtype {
        // A bfloat16 is the top half of an f32 (NaN payloads included, as torch converts).
        Dtype::BF16 => out.extend(
            data.chunks_exact(2)
                .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)),
        ),
        Dtype::F16 => out.extend(
            data.chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
        ),
        Dtype::F32 => out.extend(
            data.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        ),
        _ => unreachable!("checked by quantizable"),
    }
}

/// Quantizes `data`, a `[tokens, ...]` tensor of `dtype` (one of `quantizable`'s).
pub fn quantize(dtype: Dtype, data: &[u8], tokens: usize) -> Result<Quantized> {
    quantize_into(dtype, data, tokens, Vec::new())
}

/// Like [`quantize`], writing the values into `values` (cleared first), whose allocation is
/// reused: the writer's compression threads recycle record-sized buffers (`writer/out_pool.rs`).
pub fn quantize_into<V: AsMut<Vec<u8>>>(
    dtype: Dtype,
    data: &[u8],
    tokens: usize,
    mut values: V,
) -> Result<Quantized<V>> {
    if !quantizable(dtype) {
        return Err(Error::invalid(format!(
            "lossy='fp8-e4m3' quantizes BF16, F16 or F32 hidden_states, not {dtype:?}"
        )));
    }
    let size = dtype.size();
    let count = data.len() / size;
    let per_token = count.checked_div(tokens).unwrap_or(0);
    let mut x: Vec<f32> = Vec::with_capacity(per_token);
    let out = values.as_mut();
    out.clear();
    out.reserve_exact(count);
    let mut scales = Vec::with_capacity(4 * tokens);
    let mut stats = ErrorSums::default();
    let mut nan = false;
    // A token at a time, converted into one reused buffer (no f32 copy of the whole record).
    for bytes in data.chunks(per_token.max(1) * size).take(tokens) {
        x.clear();
        to_f32_into(dtype, bytes, &mut x);
        let row = &x[..];
        // torch's amax propagates NaN: a token with a NaN gets a NaN scale, so NaN values.
        let row_nan = row.iter().any(|v| v.is_nan());
        nan |= row_nan;
        let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = if row_nan {
            f32::NAN
        } else if amax > 0.0 {
            amax / E4M3_MAX
        } else {
            1.0
        };
        scales.extend_from_slice(&scale.to_le_bytes());
        let start = out.len();
        if row_nan {
            out.extend(row.iter().map(|&v| e4m3_from_f32(v / scale)));
            continue;
        }
        // Each value in f32, as torch computes it: x / scale, clamped, rounded.
        out.extend(
            row.iter()
                .map(|&v| e4m3_finite((v / scale).clamp(-E4M3_MAX, E4M3_MAX))),
        );
        stats.add(row, &out[start..], scale);
    }
    let ErrorSums {
        mut max_rel,
        mut sum_rel,
        nonzero,
        err_sq,
        x_sq,
    } = stats;
    if nan {
        (max_rel, sum_rel) = (f64::NAN, f64::NAN);
    }
    let mean_rel = if nonzero > 0 {
        sum_rel / nonzero as f64
    } else {
        0.0
    };
    let rms_rel = if x_sq > 0.0 {
        err_sq.sqrt() / x_sq.sqrt()
    } else {
        0.0
    };
    Ok(Quantized {
        values,
        scales,
        errors: [
            ("fp8_max_rel_err", format_g6(max_rel)),
            ("fp8_mean_rel_err", format_g6(mean_rel)),
            ("fp8_rms_rel_err", format_g6(rms_rel)),
        ],
    })
}

/// `x` as printf's `%.6g` (Python's `format(x, ".6g")`): 6 significant digits, fixed notation
/// for exponents -4..5, else `d.ddddde±XX`, trailing zeros removed.
pub fn format_g6(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0" } else { "0" }.into();
    }
    // The exponent after rounding to 6 significant digits decides the notation.
    let sci = format!("{x:.5e}");
    let (mantissa, exp) = sci.split_once('e').expect("exponent notation");
    let exp: i32 = exp.parse().expect("an integer exponent");
    if (-4..6).contains(&exp) {
        let decimals = (5 - exp).max(0) as usize;
        let fixed = format!("{x:.decimals$}");
        return trim_zeros(&fixed).to_string();
    }
    let mantissa = trim_zeros(mantissa);
    let sign = if exp < 0 { '-' } else { '+' };
    format!("{mantissa}e{sign}{:02}", exp.abs())
}

fn trim_zeros(s: &str) -> &str {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_bytes_are_torchs() {
        // torch.tensor(VALUES, dtype=torch.float32).to(torch.float8_e4m3fn), 2.11 and 2.13.
        let cases: [(f32, u8); 30] = [
            (0.0, 0x00),
            (-0.0, 0x80),
            (1.0, 0x38),
            (-1.0, 0xb8),
            (448.0, 0x7e),
            (-448.0, 0xfe),
            (447.0, 0x7e),
            (440.0, 0x7e),
            (432.0, 0x7e),
            (0.5, 0x30),
            (0.1, 0x1d),
            (-0.3, 0xaa),
            (1.0 / 64.0, 0x08),
            (1.0 / 128.0, 0x04),
            (1.0 / 512.0, 0x01),
            (1.0 / 1024.0, 0x00),
            (1.5 / 512.0, 0x02),
            (2.5 / 512.0, 0x02),
            (3.0 / 1024.0, 0x02),
            (1.0625, 0x38),
            (1.125, 0x39),
            (1.1875, 0x3a),
            (0.000_976_562_5, 0x00),
            (0.015_625 * 1.0625, 0x08),
            (100.0, 0x6c),
            (3.25, 0x45),
            (-7.77, 0xd0),
            (240.0, 0x77),
            (232.0, 0x76),
            (248.0, 0x78),
        ];
        for (x, want) in cases {
            assert_eq!(e4m3_from_f32(x), want, "{x}");
        }
    }

    #[test]
    fn every_e4m3_value_maps_back_to_itself() {
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            if v.is_nan() {
                assert_eq!(b & 0x7f, 0x7f);
                continue;
            }
            let back = e4m3_from_f32(v);
            // +0 and -0 keep their sign; every other value is its own code.
            assert_eq!(back, b, "{b:#x} = {v}");
        }
    }

    /// The e4m3 byte nearest to `v` by search over every finite value (ties to the even code;
    /// zero keeps the sign of `v`): the reference the arithmetic rounding is checked against.
    fn nearest_by_search(v: f32) -> u8 {
        let sign = if v.is_sign_negative() { 0x80 } else { 0 };
        let mut best = (f32::INFINITY, 0u8);
        for code in 0..0x7fu8 {
            let distance = (v.abs() - e4m3_to_f32(code)).abs();
            if distance < best.0 || (distance == best.0 && code % 2 == 0) {
                best = (distance, code);
            }
        }
        sign | best.1
    }

    #[test]
    fn the_branch_free_paths_agree_with_the_plain_ones() {
        for b in 0..=255u8 {
            if b & 0x7f != 0x7f {
                assert_eq!(
                    e4m3_finite_value(b).to_bits(),
                    e4m3_to_f32(b).to_bits(),
                    "{b:#x}"
                );
            }
        }
        let mut x = 1u32;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let v =
                (f32::from_bits(x & 0x3fff_ffff | (x & 0x8000_0000)) % 448.0).clamp(-448.0, 448.0);
            assert_eq!(e4m3_finite(v), nearest_by_search(v), "{v}");
        }
        // every tie (the midpoint between two neighbours) goes to the even code
        for code in 0..0x7eu8 {
            let mid = (e4m3_to_f32(code) + e4m3_to_f32(code + 1)) / 2.0;
            assert_eq!(e4m3_finite(mid), nearest_by_search(mid), "{mid}");
            assert_eq!(e4m3_finite(mid) % 2, 0, "{mid}");
        }
    }

    #[test]
    fn scales_are_per_token_and_a_zero_token_gets_one() {
        let rows: Vec<f32> = vec![1.0, -2.0, 0.5, 0.0, 0.0, 0.0, 448.0, 4.0, -896.0];
        let data: Vec<u8> = rows.iter().flat_map(|v| v.to_le_bytes()).collect();
        let q = quantize(Dtype::F32, &data, 3).unwrap();
        let scales: Vec<f32> = q
            .scales
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(scales, vec![2.0 / 448.0, 1.0, 2.0]);
        assert_eq!(q.values[1], e4m3_from_f32(-448.0));
        assert_eq!(&q.values[3..6], &[0, 0, 0]);
        assert_eq!(q.values[8], e4m3_from_f32(-448.0));
    }

    #[test]
    #[ignore = "a measurement: cargo test --release -p layertap-core --lib fp8 -- --ignored --nocapture"]
    fn speed() {
        let tokens = 4096;
        let width = 7 * 384;
        let data: Vec<u8> = (0..tokens * width)
            .flat_map(|i| {
                half::bf16::from_f32(((i as f32) * 0.37).sin() * (1.0 + (i % 97) as f32))
                    .to_le_bytes()
            })
            .collect();
        let t = std::time::Instant::now();
        let mut x = Vec::new();
        to_f32_into(Dtype::BF16, &data, &mut x);
        eprintln!("to_f32 {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
        let t = std::time::Instant::now();
        let codes: Vec<u8> = x
            .iter()
            .map(|&v| e4m3_finite((v / 3.0).clamp(-448.0, 448.0)))
            .collect();
        eprintln!("codes {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
        let t = std::time::Instant::now();
        let mut st = ErrorSums::default();
        for (r, c) in x.chunks(width).zip(codes.chunks(width)) {
            st.add(r, c, 3.0);
        }
        eprintln!(
            "stats {:.1} ms {}",
            t.elapsed().as_secs_f64() * 1e3,
            st.nonzero
        );
        let t0 = std::time::Instant::now();
        let q = quantize(Dtype::BF16, &data, tokens).unwrap();
        let dt = t0.elapsed().as_secs_f64();
        eprintln!(
            "quantize: {:.2} GB/s of bf16 input ({} values)",
            data.len() as f64 / dt / 1e9,
            q.values.len()
        );
    }

    #[test]
    fn g6_is_printfs() {
        for (x, want) in [
            (0.0, "0"),
            (1.0, "1"),
            (0.0625, "0.0625"),
            (0.123_456_789, "0.123457"),
            (123_456.7, "123457"),
            (1_234_567.0, "1.23457e+06"),
            (0.000_012_345_678, "1.23457e-05"),
            (0.000_123_456, "0.000123456"),
            (0.999_999_9, "1"),
            (99_999.95, "99999.9"),
            (999_999.5, "1e+06"),
            (0.05, "0.05"),
            (0.000_01, "1e-05"),
            (0.0001, "0.0001"),
        ] {
            assert_eq!(format_g6(x), want, "{x}");
        }
    }
}
