//! What each writer option accepts, in the words of the error that refuses a value:
//! `"{option} must be {rule}, not {value}"`. Written once here; the core's checks
//! ([`WriterConfig::validate`](crate::writer::WriterConfig::validate), the option parsers) and
//! the Python binding's conversions (`layertap.WriterOptions`) all refuse through [`refused`], so
//! a value gets the same words whichever of them sees it first.

use crate::error::Error;
use crate::format::Codec;
use crate::fp8::Lossy;
use crate::names::MAX_WRITER_ID_LEN;
use crate::writer::WriterConfig;

/// What an option must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// `codec`: one of [`Codec::ALL`]'s names.
    Codec,
    /// `level` that is not an integer.
    Level,
    /// `level` outside zstd's range (with a codec that compresses).
    LevelRange,
    /// `level` that does not fit 32 bits.
    Level32,
    /// Sizes and counts (`shard_size`, `max_inflight_bytes`, `batch_bytes`, `key_memory`).
    Positive,
    /// `durability`.
    Durability,
    /// `threads`.
    Threads,
    /// `writer_id`.
    WriterId,
    /// `io`.
    Io,
    /// `direct` (its values as Python spells them: only the binding sees anything but a bool).
    Direct,
    /// `lossy`.
    Lossy,
    /// `metadata` that is not a mapping.
    Metadata,
}

impl Rule {
    /// The words after "must be".
    pub fn text(self) -> String {
        match self {
            Rule::Codec => format!("one of {}", listed(Codec::ALL.iter().map(|c| c.name()))),
            Rule::Level => "an integer".into(),
            Rule::LevelRange => {
                let range = crate::codec::level_range();
                format!("a zstd level from {} to {}", range.start(), range.end())
            }
            Rule::Level32 => "a 32-bit integer".into(),
            Rule::Positive => "a positive integer below 2**64".into(),
            Rule::Durability => "'none', 'close' or a positive number of bytes".into(),
            Rule::Threads => format!("None or an integer from 1 to {}", WriterConfig::MAX_THREADS),
            Rule::WriterId => format!(
                "None or 1 to {MAX_WRITER_ID_LEN} characters from [A-Za-z0-9._-], not starting \
                 with '.'"
            ),
            Rule::Io => format!("one of {}", listed(["auto", "uring", "pwrite"])),
            Rule::Direct => "True or False".into(),
            Rule::Lossy => format!("None or {}", listed(Lossy::ALL.iter().map(|l| l.name()))),
            Rule::Metadata => "a mapping of str to str".into(),
        }
    }
}

/// The error refusing a value of `option`; `shown` is the value as its caller writes it (the
/// binding: Python's `repr`; Rust callers: [`quoted`] for text, plain numbers).
pub fn refused(option: &'static str, rule: Rule, shown: &str) -> Error {
    Error::option(option, format!("must be {}, not {shown}", rule.text()))
}

/// `'text'` as Python's `repr` writes a str (single quotes unless the text holds one and no
/// double quote; backslashes, the quote and control characters escaped), so that a value a Rust
/// caller gives reads in an error as the same value given from Python does.
pub fn quoted(text: &str) -> String {
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(text.len() + 2);
    out.push(quote);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

fn listed<'a>(names: impl IntoIterator<Item = &'a str>) -> String {
    names.into_iter().map(quoted).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_read_as_python_writes_them() {
        let Error::InvalidOption { option, problem } =
            refused("codec", Rule::Codec, &quoted("lz4"))
        else {
            panic!("not an option error")
        };
        assert_eq!(option, "codec");
        assert_eq!(
            problem,
            "must be one of 'none', 'zstd', 'bp16-zstd', 'exp-huf', not 'lz4'"
        );
        assert_eq!(Rule::Lossy.text(), "None or 'fp8-e4m3'");
        assert_eq!(Rule::Threads.text(), "None or an integer from 1 to 256");
        assert_eq!(quoted("it's"), "\"it's\"");
        assert_eq!(quoted("a'\"b\\\n\x01"), "'a\\'\"b\\\\\\n\\x01'");
    }
}
