//! What a reader or `recover` finds wrong in a shard without failing: corrupt records, damaged
//! regions, a torn tail, an unusable index (docs/FORMAT.md, "Reading" step 3).

use std::fmt;

/// Something wrong found in a shard while opening or recovering it. None of these stop the shard
/// from being read: the records around them are still returned, and the damaged bytes never are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// A record frame whose header is valid but whose payload does not match its checksum. It is
    /// skipped (not an entry of the shard) and stays in the file.
    CorruptRecord {
        /// Offset of the frame.
        offset: u64,
        /// The key in its frame header.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// Bytes `[start, end)` between valid frames in which no valid frame header was found.
    DamagedRegion {
        /// First damaged byte (a multiple of 8).
        start: u64,
        /// Where the next valid frame starts.
        end: u64,
    },
    /// Bytes after the end of the last valid record frame, up to the end of the file (or up to
    /// an index frame): what a writer that died, or is still writing, left unfinished.
    TornTail {
        /// Where the torn tail starts (the end of the last valid frame).
        offset: u64,
        /// Its length in bytes.
        len: u64,
    },
    /// The shard's footer is unusable: the trailer is valid but the index it points to is not,
    /// or an index frame is not followed by a valid trailer. The shard was scanned instead.
    BadIndex {
        /// Offset of the index frame, when known.
        offset: Option<u64>,
        /// What is wrong.
        reason: String,
    },
}

impl Problem {
    /// The kind as the Python API names it: `"corrupt_record"`, `"damaged_region"`,
    /// `"torn_tail"` or `"bad_index"`.
    pub fn kind(&self) -> &'static str {
        match self {
            Problem::CorruptRecord { .. } => "corrupt_record",
            Problem::DamagedRegion { .. } => "damaged_region",
            Problem::TornTail { .. } => "torn_tail",
            Problem::BadIndex { .. } => "bad_index",
        }
    }

    /// Where in the file the problem starts, when known.
    pub fn offset(&self) -> Option<u64> {
        match self {
            Problem::CorruptRecord { offset, .. } | Problem::TornTail { offset, .. } => {
                Some(*offset)
            }
            Problem::DamagedRegion { start, .. } => Some(*start),
            Problem::BadIndex { offset, .. } => *offset,
        }
    }

    /// The key of the record concerned, for corrupt records.
    pub fn key(&self) -> Option<&str> {
        match self {
            Problem::CorruptRecord { key, .. } => Some(key),
            _ => None,
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::CorruptRecord { offset, key, reason } => {
                write!(f, "corrupt record {key:?} at offset {offset}: {reason}")
            }
            Problem::DamagedRegion { start, end } => write!(
                f,
                "damaged region of {} bytes at [{start}, {end}): no valid frame header in it",
                end - start
            ),
            Problem::TornTail { offset, len } => write!(
                f,
                "torn tail of {len} bytes at offset {offset}: an unfinished frame after the last valid one"
            ),
            Problem::BadIndex { offset: Some(at), reason } => {
                write!(f, "index at offset {at} is unusable ({reason}); the shard was scanned instead")
            }
            Problem::BadIndex { offset: None, reason } => {
                write!(f, "index is unusable ({reason}); the shard was scanned instead")
            }
        }
    }
}
