//! Scanning the frames of a shard without using its index (docs/FORMAT.md, "Reading" step 3):
//! how open shards are read and how `recover` finds the records to index.

use super::problem::Problem;
use crate::format::{
    crc32c, crc32c_append, FrameHeader, FrameHeaderError, FrameKind, IndexEntry, FRAME_HEADER_LEN,
    FRAME_MAGIC,
};

/// What a scan found.
#[derive(Debug)]
pub(crate) struct Scan {
    /// The valid records, in file order.
    pub entries: Vec<IndexEntry>,
    /// Corrupt records and damaged regions before `data_end`.
    pub problems: Vec<Problem>,
    /// The end of the last valid record frame (`header_len` when there is none).
    pub data_end: u64,
    /// Where the scan stopped: the offset of an index frame, else the end of the file.
    pub stop: u64,
    /// Whether it stopped at an index frame.
    pub stopped_at_index: bool,
}

/// Scans the frames of the shard in `bytes` (the whole file, as far as it is known) from
/// `header_len` (a multiple of 8).
///
/// A record frame whose header and payload are valid is a record; one whose payload fails its
/// checksum is a corrupt record; where no valid header is found the scan resynchronises at the
/// following multiples of 8, and the bytes skipped form a damaged region. Problems found after
/// the last valid record are not reported separately: those bytes are the torn tail, which an
/// open shard still being written (or whose writer died) normally has. A valid frame header
/// whose frame runs past the end of the file is the frame being written: the rest of the file is
/// its unfinished payload and is not searched for frames.
pub(crate) fn scan(bytes: &[u8], header_len: u64) -> Scan {
    let len = bytes.len() as u64;
    let mut entries = Vec::new();
    let mut problems = Vec::new();
    // Problems after the last valid record: reported only once a valid record follows them.
    let mut pending = Vec::new();
    let mut damaged_from: Option<u64> = None;
    let mut data_end = header_len;
    let mut at = header_len;
    let mut stop = len;
    let mut stopped_at_index = false;
    while at < len {
        let here = &bytes[at as usize..];
        match FrameHeader::decode(here) {
            Ok(h) => {
                if let Some(start) = damaged_from.take() {
                    pending.push(Problem::DamagedRegion { start, end: at });
                }
                if h.kind == FrameKind::Index {
                    stop = at;
                    stopped_at_index = true;
                    break;
                }
                // decode() checked that the whole frame lies in `here`.
                let payload =
                    &here[h.header_len() as usize..(h.header_len() + h.stored_len) as usize];
                let next = at + h.frame_len();
                let crc = crc32c(payload);
                if crc == h.payload_crc {
                    problems.append(&mut pending);
                    entries.push(IndexEntry::for_frame(at, &h));
                    data_end = next;
                } else {
                    pending.push(Problem::CorruptRecord {
                        offset: at,
                        reason: format!(
                            "payload checksum mismatch (frame says {:#010x}, payload has {crc:#010x})",
                            h.payload_crc
                        ),
                        key: h.key,
                    });
                }
                at = next;
            }
            Err(FrameHeaderError::Truncated) if header_is_intact(here) => break,
            Err(_) => {
                damaged_from.get_or_insert(at);
                at += 8;
            }
        }
    }
    Scan {
        entries,
        problems,
        data_end,
        stop,
        stopped_at_index,
    }
}

/// Whether `bytes` start with a frame header (key included) whose magic and checksum are right,
/// whether or not its frame fits in `bytes`.
pub(super) fn header_is_intact(bytes: &[u8]) -> bool {
    if bytes.len() < FRAME_HEADER_LEN || bytes[..4] != FRAME_MAGIC {
        return false;
    }
    let key_len = u16::from_le_bytes([bytes[6], bytes[7]]) as usize;
    let Some(key) = bytes.get(FRAME_HEADER_LEN..FRAME_HEADER_LEN + key_len) else {
        return false;
    };
    let crc = u32::from_le_bytes([bytes[44], bytes[45], bytes[46], bytes[47]]);
    crc32c_append(crc32c(&bytes[..44]), key) == crc
}
