//! The one error type of the core crate.
//!
//! Every variant names what went wrong and where (a path, an offset, a key), so that the Python
//! bindings can map it to a typed exception carrying the same details.

use std::path::PathBuf;

/// A record key in a message: a JSON string (control characters escaped, other characters as
/// they are), as the Python readers quote keys (`layertap.errors.quote_key`), so that a message
/// reads the same whichever reader wrote it. Rust's `{:?}` escapes differently (`\u{1}`).
pub fn quote_key(key: &str) -> String {
    serde_json::to_string(key).expect("a str always serializes")
}

/// Everything that can go wrong in layertap's core.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The caller gave a value the API does not accept (bad key, dtype, shape, option).
    #[error("invalid input: {0}")]
    InvalidInput(String),

    /// An option (of the writer, or the environment variable that overrides one) is not
    /// acceptable: Python's `OptionError`, with the same `option` and `problem`.
    #[error("invalid input: {option} {problem}")]
    InvalidOption {
        /// The option's name, as the writers' options spell it (`"threads"`, `"io"`...).
        option: &'static str,
        /// What is wrong with its value: `"must be ..., not ..."`.
        problem: String,
    },

    /// A key was submitted twice to the same writer.
    #[error(
        "duplicate key {}: this writer already wrote a record with this key",
        quote_key(key)
    )]
    DuplicateKey {
        /// The repeated key.
        key: String,
    },

    /// A file is not a layertap shard, or is of an unsupported version.
    #[error("{path}: not a layertap shard: {reason}")]
    NotAShard {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// A record failed its checksum or could not be decoded.
    #[error("{path}: corrupt record at offset {offset}{}: {reason}", key.as_ref().map(|k| format!(" (key {})", quote_key(k))).unwrap_or_default())]
    CorruptRecord {
        /// The shard holding it.
        path: PathBuf,
        /// The offset of its frame.
        offset: u64,
        /// Its key, when the frame header could be read.
        key: Option<String>,
        /// What is wrong.
        reason: String,
    },

    /// The shard's index (footer) is damaged although its trailer looks right.
    #[error("{path}: corrupt index: {reason}")]
    CorruptIndex {
        /// The shard.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// No record with this key or position.
    #[error("no record {0}")]
    NotFound(String),

    /// A system call failed on a file.
    #[error("{path}: {op} failed: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What was being done (`"open"`, `"write"`, `"fsync"`...).
        op: &'static str,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// The file system holding the dataset has no room left (`ENOSPC`; `EDQUOT`, a quota, too).
    /// Records reported written before it are intact and the shard is cut back to them (and
    /// completed where its index still fits): Python's `DiskFullError`, a `WriterIOError`.
    #[error(
        "{dir}: disk full, {} free ({op} of {} failed: {source}); the records written before it are intact",
        free_text(*free_bytes),
        file_name(path)
    )]
    DiskFull {
        /// The directory on the full file system (the dataset directory).
        dir: PathBuf,
        /// The file being written (or the directory, when that was what failed).
        path: PathBuf,
        /// What was being done (`"write"`, `"create"`...).
        op: &'static str,
        /// The bytes an unprivileged writer could still use there, as `statvfs` said right
        /// after the failure (`None` if it could not tell).
        free_bytes: Option<u64>,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// Another process holds the shard's lock (its writer is alive).
    #[error("{path}: locked by another process (a live writer?); refusing to modify it")]
    Locked {
        /// The shard.
        path: PathBuf,
    },

    /// The writer was closed, or failed earlier and can take no more work.
    #[error("writer is closed{}", .0.as_ref().map(|r| format!(": {r}")).unwrap_or_default())]
    Closed(Option<String>),

    /// A codec failed (compression library error).
    #[error("codec {codec}: {reason}")]
    Codec {
        /// The codec's name.
        codec: &'static str,
        /// The library's message.
        reason: String,
    },
}

impl Error {
    /// Shorthand for an [`Error::Io`] from an `io::Error`; an [`Error::DiskFull`] when the
    /// error says the file system is full, with the free space of the directory holding `path`.
    pub fn io(path: impl Into<PathBuf>, op: &'static str, source: std::io::Error) -> Self {
        let path = path.into();
        if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) {
            let dir = if path.is_dir() {
                path.clone()
            } else {
                match path.parent() {
                    Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                    _ => PathBuf::from("."),
                }
            };
            let free_bytes = free_bytes(&dir);
            return Error::DiskFull {
                dir,
                path,
                op,
                free_bytes,
                source,
            };
        }
        Error::Io { path, op, source }
    }

    /// Shorthand for [`Error::NotAShard`].
    pub fn not_a_shard(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::NotAShard {
            path: path.into(),
            reason: reason.into(),
        }
    }

    /// Shorthand for [`Error::InvalidInput`].
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidInput(msg.into())
    }

    /// Shorthand for [`Error::InvalidOption`].
    pub fn option(option: &'static str, problem: impl Into<String>) -> Self {
        Error::InvalidOption {
            option,
            problem: problem.into(),
        }
    }

    /// The `errno` of an I/O error, if this is one.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            Error::Io { source, .. } | Error::DiskFull { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// The bytes an unprivileged process can still write on the file system holding `dir`
/// (`statvfs`: available blocks times the fragment size), or `None` if it cannot tell.
#[allow(trivial_numeric_casts)] // u64 already on 64-bit Linux, not on every target
pub fn free_bytes(dir: &std::path::Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `statvfs` is a plain C struct of integers, for which all zeroes is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `statvfs` reads the NUL-terminated path, which `c` keeps alive for the call, and
    // writes only into `st`, ours.
    if unsafe { libc::statvfs(c.as_ptr(), &raw mut st) } != 0 {
        return None;
    }
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Bytes as Python's `layertap._text.human_bytes` writes them (`"352.0 KiB"`).
fn free_text(bytes: Option<u64>) -> String {
    let Some(n) = bytes else {
        return "an unknown amount".into();
    };
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64;
    for unit in ["KiB", "MiB", "GiB", "TiB"] {
        value /= 1024.0;
        if value < 1024.0 {
            return format!("{value:.1} {unit}");
        }
    }
    format!("{:.1} PiB", value / 1024.0)
}

fn file_name(path: &std::path::Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_quoted_as_json_in_messages() {
        assert_eq!(quote_key("a\u{1}b\"é\n"), r#""a\u0001b\"é\n""#);
        let e = Error::CorruptRecord {
            path: "s.lts".into(),
            offset: 32,
            key: Some("k\u{7}".into()),
            reason: "payload checksum mismatch".into(),
        };
        assert_eq!(
            e.to_string(),
            r#"s.lts: corrupt record at offset 32 (key "k\u0007"): payload checksum mismatch"#
        );
    }
}
