//! Torn empty shards (docs/FORMAT.md, "File header"): a file shorter than its header, whose
//! bytes are a prefix of one. It is what a writer killed before finishing its first write leaves
//! behind where it created the file under its name before writing the header (this repository's
//! writers did until they learnt to link a file complete with its header): it holds no record, so `recover` removes it, and readers report it as a shard to
//! recover rather than as a foreign file.

use crate::format::{FILE_HEADER_FIXED_LEN, FILE_MAGIC, MAX_META_LEN, VERSION};

/// What readers say about a torn empty shard.
pub const TORN_EMPTY_REASON: &str =
    "the file ends inside its header: a torn empty shard (its writer died before writing the header; `layertap recover` removes it)";

/// Whether `bytes`, a whole file, are a torn empty shard: shorter than the header they begin
/// (before the end of its checksum), and every byte present is what a header holds there: the
/// magic, version 1, no flags, a metadata length a reader accepts. An empty file is one.
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
    meta_len <= MAX_META_LEN && bytes.len() < FILE_HEADER_FIXED_LEN + meta_len + 4
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::FileHeader;

    #[test]
    fn prefixes_of_a_header_are_torn_and_nothing_else_is() {
        let header = FileHeader {
            shard_id: [3; 16],
            meta_json: r#"{"writer_id":"w"}"#.into(),
        }
        .encode();
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
}
