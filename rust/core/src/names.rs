//! Validation of record keys and writer ids, and shard file names (docs/FORMAT.md, "Keys" and
//! "Datasets").

use crate::error::{Error, Result};

/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 1024;
/// Longest writer id accepted, in characters.
pub const MAX_WRITER_ID_LEN: usize = 64;
/// File name suffix of shards.
pub const SHARD_SUFFIX: &str = ".lts";

/// Checks a record key: 1 to 1024 bytes of UTF-8, no control characters, no `/` or `\`.
pub fn check_key(key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(Error::invalid("record key is empty"));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(Error::invalid(format!(
            "record key is {} bytes long; the limit is {MAX_KEY_LEN} (key starts {:?})",
            key.len(),
            key.chars().take(40).collect::<String>()
        )));
    }
    if let Some(c) = key
        .chars()
        .find(|&c| c == '/' || c == '\\' || c.is_ascii_control())
    {
        return Err(Error::invalid(format!(
            "record key {key:?} contains {c:?}; keys may not contain path separators or control characters"
        )));
    }
    Ok(())
}

/// Checks a writer id: 1 to 64 characters from `[A-Za-z0-9._-]`, not starting with `.`.
pub fn check_writer_id(id: &str) -> Result<()> {
    let ok_chars = id
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if id.is_empty() || id.len() > MAX_WRITER_ID_LEN || !ok_chars || id.starts_with('.') {
        return Err(Error::invalid(format!(
            "writer id {id:?} is not valid: use 1 to {MAX_WRITER_ID_LEN} characters from \
             [A-Za-z0-9._-], not starting with '.'"
        )));
    }
    Ok(())
}

/// The file name of shard `index` of writer `writer_id`.
pub fn shard_file_name(writer_id: &str, index: u64) -> String {
    format!("{writer_id}-{index:06}{SHARD_SUFFIX}")
}

/// If `file_name` is a shard of `writer_id`, its index.
pub fn parse_shard_index(file_name: &str, writer_id: &str) -> Option<u64> {
    let rest = file_name.strip_prefix(writer_id)?.strip_prefix('-')?;
    let digits = rest.strip_suffix(SHARD_SUFFIX)?;
    if digits.len() < 6 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        assert!(check_key("req-1").is_ok());
        assert!(check_key("ünïcode key with spaces").is_ok());
        assert!(check_key("").is_err());
        assert!(check_key("a/b").is_err());
        assert!(check_key("a\\b").is_err());
        assert!(check_key("a\nb").is_err());
        assert!(check_key(&"k".repeat(MAX_KEY_LEN)).is_ok());
        assert!(check_key(&"k".repeat(MAX_KEY_LEN + 1)).is_err());
    }

    #[test]
    fn writer_ids_and_names() {
        assert!(check_writer_id("rank0").is_ok());
        assert!(check_writer_id(".hidden").is_err());
        assert!(check_writer_id("a/b").is_err());
        assert!(check_writer_id("").is_err());
        assert_eq!(shard_file_name("rank0", 7), "rank0-000007.lts");
        assert_eq!(parse_shard_index("rank0-000007.lts", "rank0"), Some(7));
        assert_eq!(
            parse_shard_index("rank0-1234567.lts", "rank0"),
            Some(1234567)
        );
        assert_eq!(parse_shard_index("rank01-000007.lts", "rank0"), None);
        assert_eq!(parse_shard_index("rank0-000007.lts.tmp", "rank0"), None);
    }
}
