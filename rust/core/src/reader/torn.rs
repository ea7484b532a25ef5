//! Torn empty shards (docs/FORMAT.md, "File header"): a file shorter than its header, whose
//! bytes are a prefix of one. It is what a writer killed before finishing its first write leaves
//! behind where it created the file under its name before writing the header (this repository's
//! writers did until they learnt to link a file complete with its header): it holds no record, so `recover` removes it, and readers report it as a shard to
//! recover rather than as a foreign file.

use super::scan::header_is_intact;
use crate::format::{FILE_HEADER_FIXED_LEN, FILE_MAGIC, MAX_META_LEN, VERSION};

/// What readers say about a torn empty shard.
pub const TORN_EMPTY_REASON: &str =
    "the file ends inside its header: a torn empty shard (its writer died before writing the header; `layertap recover` removes it)";

/// Whether `bytes`, a whole file, are a torn empty shard: shorter than the header they begin
/// (before the end of its checksum), every byte present is what a header holds there (the
/// magic, version 1, no flags, a metadata length a reader accepts), and no frame header
/// follows. An empty file is one.
pub fn is_torn_empty(bytes: &[u8]) -> bool {
    // magic | version (u16) | flags (u16), as a writer writes them.
    let mut fixed = [0u8; 12];
    fixed[..8].copy_from_slice(&FILE_MAGIC);
    fixed[8..10].copy_from_slice(&VERSION.to_le_bytes());
    let n = bytes.len().min(fixed.len());
    if bytes[..n] != fixed[..n] {
        return false;
    }
    if bytes.len() < 16 {
        return true; // the metadata length is not all there: the header ends later
    }
    let meta_len = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes")) as usize;
    meta_len <= MAX_META_LEN
        && bytes.len() < FILE_HEADER_FIXED_LEN + meta_len + 4
        && !holds_a_frame(bytes)
}

/// Whether a frame header (its magic and checksum right) starts at a multiple of 8 after the
/// header's fixed part. A writer that died in its header wrote no frame; a shard whose
/// `meta_len` was damaged later (one flipped bit can make a complete shard of under 1 MiB look
/// shorter than its header) still holds its frames, and `recover` must not remove it.
fn holds_a_frame(bytes: &[u8]) -> bool {
    (FILE_HEADER_FIXED_LEN..bytes.len())
        .step_by(8)
        .any(|at| header_is_intact(&bytes[at..]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{crc32c, Codec, FileHeader, FrameHeader, FrameKind};

    /// A file header with 17 bytes of metadata.
    fn header() -> Vec<u8> {
        FileHeader {
            shard_id: [3; 16],
            meta_json: r#"{"writer_id":"w"}"#.into(),
        }
        .encode()
    }

    #[test]
    fn prefixes_of_a_header_are_torn_and_nothing_else_is() {
        let header = header();
        let crc_end = FILE_HEADER_FIXED_LEN + 17 + 4;
        for cut in 0..crc_end {
            assert!(is_torn_empty(&header[..cut]), "cut at {cut}");
        }
        for cut in crc_end..=header.len() {
            assert!(!is_torn_empty(&header[..cut]), "cut at {cut}");
        }
        assert!(!is_torn_empty(b"garbage"));
        let mut flags = header[..20].to_vec();
        flags[10] = 1;
        assert!(!is_torn_empty(&flags));
        let mut version = header[..9].to_vec();
        version[8] = 2;
        assert!(!is_torn_empty(&version));
        let mut huge = header[..20].to_vec();
        huge[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(!is_torn_empty(&huge));
    }

    #[test]
    fn a_shard_whose_meta_len_grew_is_not_torn_empty() {
        // A header and one frame, then meta_len raised past the file's length: the frame says
        // it is a shard with data, not a header that was never finished.
        let header = header();
        let frame = FrameHeader {
            kind: FrameKind::Record,
            codec: Codec::None,
            key: "k".into(),
            stored_len: 8,
            raw_len: 8,
            num_tokens: 0,
            payload_crc: crc32c(&[0; 8]),
        }
        .encode();
        let mut file = [header.as_slice(), frame.as_slice(), &[0; 8]].concat();
        file[12..16].copy_from_slice(&(1u32 << 20).to_le_bytes());
        assert!(!is_torn_empty(&file));
        // The same bytes without the frame's checksum right are what a torn header may hold.
        let at = header.len() + 44;
        file[at] ^= 1;
        assert!(is_torn_empty(&file));
    }
}
