//! Element types of tensors in a record, named as safetensors names them.

use crate::error::{Error, Result};

/// A tensor element type. The names are safetensors' dtype strings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// Boolean, one byte.
    BOOL,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 16-bit integer.
    U16,
    /// Signed 16-bit integer.
    I16,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// Unsigned 32-bit integer.
    U32,
    /// Signed 32-bit integer.
    I32,
    /// IEEE single precision.
    F32,
    /// Unsigned 64-bit integer.
    U64,
    /// Signed 64-bit integer.
    I64,
    /// IEEE double precision.
    F64,
    /// 8-bit float, 4 exponent bits, 3 mantissa bits, no infinities (`float8_e4m3fn`).
    #[allow(non_camel_case_types)]
    F8_E4M3,
}

impl Dtype {
    /// Every dtype, for tests and error messages.
    pub const ALL: [Dtype; 14] = [
        Dtype::BOOL,
        Dtype::U8,
        Dtype::I8,
        Dtype::U16,
        Dtype::I16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::U32,
        Dtype::I32,
        Dtype::F32,
        Dtype::U64,
        Dtype::I64,
        Dtype::F64,
        Dtype::F8_E4M3,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::BOOL | Dtype::U8 | Dtype::I8 | Dtype::F8_E4M3 => 1,
            Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
            Dtype::U64 | Dtype::I64 | Dtype::F64 => 8,
        }
    }

    /// The safetensors name (`"BF16"`, `"I64"`...).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::BOOL => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::U16 => "U16",
            Dtype::I16 => "I16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::U32 => "U32",
            Dtype::I32 => "I32",
            Dtype::F32 => "F32",
            Dtype::U64 => "U64",
            Dtype::I64 => "I64",
            Dtype::F64 => "F64",
            Dtype::F8_E4M3 => "F8_E4M3",
        }
    }

    /// Parses a safetensors dtype name.
    pub fn from_name(name: &str) -> Result<Dtype> {
        Dtype::ALL
            .into_iter()
            .find(|d| d.name() == name)
            .ok_or_else(|| {
                let known: Vec<&str> = Dtype::ALL.iter().map(|d| d.name()).collect();
                Error::invalid(format!(
                    "unknown dtype {name:?}; known: {}",
                    known.join(", ")
                ))
            })
    }

    /// Whether the byte-plane transform of codec `bp16-zstd` applies to tensors of this dtype.
    pub fn is_two_byte(self) -> bool {
        self.size() == 2
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in Dtype::ALL {
            assert_eq!(Dtype::from_name(d.name()).unwrap(), d);
        }
    }

    #[test]
    fn unknown_name_is_named_in_error() {
        let e = Dtype::from_name("Q4").unwrap_err().to_string();
        assert!(e.contains("\"Q4\""), "{e}");
    }
}
