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
            .ok_or_else(|| {
                Error::invalid(format!(
                    "lossy must be one of {:?} or None, not {name:?}",
                    ["fp8-e4m3"]
                ))
            })
    }
}

/// The tensor a lossy writer quantizes, and the one it adds beside it.
pub const QUANTIZED: &str = "hidden_states";
/// Name of the scales tensor.
pub const SCALE_NAME: &str = "hidden_states_scale";
/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// The e4m3 (`float8_e4m3fn`) byte nearest to `x`, ties to even, for `|x| <= 448` (the caller
/// clamps); NaN maps to e4m3's NaN. Layout: sign, 4 exponent bits (bias 7), 3 mantissa bits;
/// below 2^-6 the values are subnormal, multiples of 2^-9.
pub fn e4m3_from_f32(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7f;
    }
    if a < 1.0 / 64.0 {
        // k * 2^-9 with k = 0..8; k = 8 is the smallest normal, whose code is 8 too.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let bits = a.to_bits();
    let mut exponent = ((bits >> 23) as i32 - 127 + 7) as u32; // 1..=15 for 2^-6 <= a <= 448
    let frac = bits & 0x7f_ffff;
    let mut mantissa = frac >> 20;
    let rest = frac & 0xf_ffff;
    if rest > 0x8_0000 || (rest == 0x8_0000 && mantissa & 1 == 1) {
        mantissa += 1;
        if mantissa == 8 {
            mantissa = 0;
            exponent += 1;
        }
    }
    sign | ((exponent << 3) as u8) | mantissa as u8
}

/// The value of an e4m3 byte, from a table of all 256 (the error statistics look one up per
/// element).
pub fn e4m3_to_f32(b: u8) -> f32 {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|i| e4m3_value(i as u8)))[b as usize]
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
/// statistics' metadata entries.
pub struct Quantized {
    /// One byte per element, the input's shape.
    pub values: Vec<u8>,
    /// One little-endian `f32` per token.
    pub scales: Vec<u8>,
    /// `fp8_max_rel_err`, `fp8_mean_rel_err`, `fp8_rms_rel_err`, formatted (`%.6g`).
    pub errors: [(&'static str, String); 3],
}

/// Whether `dtype` is one this stage quantizes.
pub fn quantizable(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32)
}

fn to_f32(dtype: Dtype, data: &[u8]) -> Vec<f32> {
    match dtype {
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        _ => unreachable!("checked by quantizable"),
    }
}

/// Quantizes `data`, a `[tokens, ...]` tensor of `dtype` (one of `quantizable`'s).
pub fn quantize(dtype: Dtype, data: &[u8], tokens: usize) -> Result<Quantized> {
    if !quantizable(dtype) {
        return Err(Error::invalid(format!(
            "lossy='fp8-e4m3' quantizes BF16, F16 or F32 hidden_states, not {dtype:?}"
        )));
    }
    let x = to_f32(dtype, data);
    let per_token = x.len().checked_div(tokens).unwrap_or(0);
    let mut values = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(4 * tokens);
    let (mut max_rel, mut sum_rel, mut nonzero) = (0f64, 0f64, 0u64);
    let (mut err_sq, mut x_sq) = (0f64, 0f64);
    for row in x.chunks(per_token.max(1)).take(tokens) {
        // torch's amax propagates NaN.
        let amax = row.iter().fold(0f32, |m, v| {
            if v.is_nan() || m.is_nan() {
                f32::NAN
            } else {
                m.max(v.abs())
            }
        });
        let scale = if amax > 0.0 {
            amax / E4M3_MAX
        } else if amax.is_nan() {
            f32::NAN
        } else {
            1.0
        };
        scales.extend_from_slice(&scale.to_le_bytes());
        for &v in row {
            let q = e4m3_from_f32((v / scale).clamp(-E4M3_MAX, E4M3_MAX));
            values.push(q);
            let err = (e4m3_to_f32(q) * scale - v).abs();
            err_sq += f64::from(err) * f64::from(err);
            x_sq += f64::from(v) * f64::from(v);
            if v != 0.0 {
                let rel = f64::from(err / v.abs());
                max_rel = if rel.is_nan() || max_rel.is_nan() {
                    f64::NAN
                } else {
                    max_rel.max(rel)
                };
                sum_rel += rel;
                nonzero += 1;
            }
        }
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
