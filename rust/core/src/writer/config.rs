//! What a [`ShardWriter`](super::ShardWriter) is asked to do: codec, sizes, durability, threads,
//! I/O backend. Checked once, when the writer opens.

use crate::codec::{level_range, Codec};
use crate::error::{Error, Result};
use crate::names;
use crate::options::{quoted, refused, Rule};
use std::collections::BTreeMap;

/// When the writer `fsync`s what it wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Never; the page cache decides (fastest, loses recent records on power loss).
    None,
    /// `fsync` each shard when it is closed, and the directory when a shard is created.
    OnClose,
    /// Like `OnClose`, and also `fsync` the open shard after every this many bytes written.
    EveryBytes(u64),
}

/// Which system calls write the records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoMode {
    /// io_uring when the kernel allows it, else `pwritev`.
    Auto,
    /// io_uring or fail.
    Uring,
    /// `pwritev` only.
    Pwrite,
}

impl IoMode {
    /// Parses `"auto"`, `"uring"` (or `"io_uring"`) and `"pwrite"`.
    pub fn from_name(name: &str) -> Result<IoMode> {
        match name {
            "auto" => Ok(IoMode::Auto),
            "uring" | "io_uring" => Ok(IoMode::Uring),
            "pwrite" => Ok(IoMode::Pwrite),
            _ => Err(refused("io", Rule::Io, &quoted(name))),
        }
    }

    /// The mode from the environment variable [`IO_ENV_VAR`], which overrides the configured
    /// one (for tests and operations), if set.
    pub fn from_env() -> Result<Option<IoMode>> {
        match std::env::var(IO_ENV_VAR) {
            Ok(v) if v.is_empty() => Ok(None),
            Ok(v) => IoMode::from_name(&v).map(Some).map_err(|e| match e {
                Error::InvalidOption { problem, .. } => Error::option(IO_ENV_VAR, problem),
                other => other,
            }),
            Err(_) => Ok(None),
        }
    }
}

/// Environment variable that overrides [`WriterConfig::io`]: `pwrite`, `uring` or `auto`.
pub const IO_ENV_VAR: &str = "LAYERTAP_IO";

/// The I/O backend a writer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Linux io_uring, several writes in flight.
    IoUring,
    /// Plain `pwritev` from the I/O thread.
    Pwrite,
}

impl Backend {
    /// `"io_uring"` or `"pwrite"`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::IoUring => "io_uring",
            Backend::Pwrite => "pwrite",
        }
    }
}

/// Options of a [`ShardWriter`](super::ShardWriter). `WriterConfig::default()` gives the
/// documented defaults (docs/API.md); Python's `layertap.WriterOptions` is this struct.
#[derive(Debug, Clone, PartialEq)]
pub struct WriterConfig {
    /// How payloads are stored.
    pub codec: Codec,
    /// zstd level (ignored by `none`).
    pub level: i32,
    /// A shard is closed and the next one started when the next record would take it past this
    /// many bytes (a shard always holds at least one record).
    pub shard_size: u64,
    /// When to `fsync`.
    pub durability: Durability,
    /// Compression (and checksum) threads; `None`: `min(4, cpu count)`.
    pub threads: Option<usize>,
    /// Raw bytes submitted but not yet written; `submit` waits past this.
    pub max_inflight_bytes: u64,
    /// Consecutive ready records are coalesced into writes of about this many bytes.
    pub batch_bytes: u64,
    /// Shard names are `{writer_id}-{n:06}.lts`; `None`: a random id.
    pub writer_id: Option<String>,
    /// Which system calls write (overridden by the `LAYERTAP_IO` environment variable).
    pub io: IoMode,
    /// Write record data with `O_DIRECT`, bypassing the page cache, where the file system
    /// allows it (else buffered, and [`Stats::direct`](super::Stats::direct) says so). Each
    /// batch is copied into aligned buffers; the partial last block of a batch is written
    /// through the page cache when no more records are ready.
    pub direct: bool,
    /// Stored in every shard's header as `"user"`.
    pub shard_metadata: BTreeMap<String, String>,
    /// How many of the most recent keys the writer remembers to refuse a key given again;
    /// `None`: every key of its lifetime. A long-running writer (a server's) bounds its memory
    /// with it.
    pub key_memory: Option<u64>,
    /// Store records' `hidden_states` lossily (docs/FP8.md): quantized by the compression
    /// threads before they encode; `None` (the default): as given.
    pub lossy: Option<crate::fp8::Lossy>,
}

impl Default for WriterConfig {
    fn default() -> Self {
        WriterConfig {
            codec: Codec::Bp16Zstd,
            level: 1,
            shard_size: 1 << 30,
            durability: Durability::OnClose,
            threads: None,
            max_inflight_bytes: 1 << 30,
            batch_bytes: 8 << 20,
            writer_id: None,
            io: IoMode::Auto,
            direct: false,
            shard_metadata: BTreeMap::new(),
            key_memory: None,
            lossy: None,
        }
    }
}

impl WriterConfig {
    /// Compression threads a writer starts at most (`threads`); Python's
    /// `layertap._choices.MAX_THREADS`, which a test holds equal through `_native.MAX_THREADS`.
    pub const MAX_THREADS: usize = 256;

    /// Checks every option's value (its type is Rust's; the Python binding checks the types it
    /// converts through [`crate::options`] too, so both refuse with the same words).
    pub fn validate(&self) -> Result<()> {
        if self.codec != Codec::None && !level_range().contains(&self.level) {
            return Err(refused("level", Rule::LevelRange, &self.level.to_string()));
        }
        let positive = [
            ("shard_size", Some(self.shard_size)),
            ("max_inflight_bytes", Some(self.max_inflight_bytes)),
            ("batch_bytes", Some(self.batch_bytes)),
            ("key_memory", self.key_memory),
        ];
        for (name, v) in positive {
            if v == Some(0) {
                return Err(refused(name, Rule::Positive, "0"));
            }
        }
        if self.durability == Durability::EveryBytes(0) {
            return Err(refused("durability", Rule::Durability, "0"));
        }
        if let Some(t) = self.threads {
            if t == 0 || t > Self::MAX_THREADS {
                return Err(refused("threads", Rule::Threads, &t.to_string()));
            }
        }
        if let Some(id) = &self.writer_id {
            if names::check_writer_id(id).is_err() {
                return Err(refused("writer_id", Rule::WriterId, &quoted(id)));
            }
        }
        // Measured as written, escapes included: `"` and `\` take 2 bytes there and other
        // control characters 6, so a raw estimate let through metadata whose header readers
        // refuse (every record reported written, no shard readable).
        let meta_len = shard_metadata_json_len(&self.shard_metadata);
        if meta_len > MAX_SHARD_METADATA_JSON {
            return Err(Error::option(
                "metadata",
                format!(
                    "is too large: {meta_len} bytes as JSON (escapes included), more than \
                     {MAX_SHARD_METADATA_JSON}; store large values in records instead"
                ),
            ));
        }
        Ok(())
    }

    /// The number of compression threads to start.
    pub fn thread_count(&self) -> usize {
        self.threads.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
                .min(4)
        })
    }
}

/// Bytes the shard metadata may take as JSON: half of what readers accept of a shard header's
/// JSON (`format::MAX_META_LEN`), the other half left to the writer's own entries (a writer id
/// of at most 64 characters, numbers, the version: under 300 bytes).
pub const MAX_SHARD_METADATA_JSON: usize = crate::format::MAX_META_LEN / 2;

/// Bytes of `metadata` in the shard header as `shard.rs` writes it: serde_json's compact text,
/// counted without building it.
fn shard_metadata_json_len(metadata: &BTreeMap<String, String>) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 += bytes.len();
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    serde_json::to_writer(&mut count, metadata).expect("a map of strings serializes");
    count.0
}

/// A fresh, valid writer id: `<hostname>-<pid>-<6 hex digits>`, the host name reduced to the
/// characters writer ids allow.
pub fn random_writer_id() -> String {
    let mut host = hostname()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect::<String>();
    host = host.trim_start_matches('.').chars().take(40).collect();
    if host.is_empty() {
        host = "host".into();
    }
    let mut rnd = [0u8; 3];
    if getrandom::fill(&mut rnd).is_err() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        rnd.copy_from_slice(&nanos.to_le_bytes()[..3]);
    }
    format!(
        "{host}-{}-{:02x}{:02x}{:02x}",
        std::process::id(),
        rnd[0],
        rnd[1],
        rnd[2]
    )
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` outlives the call and its length is passed; gethostname writes at most that.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_ids_are_valid_and_distinct() {
        let a = random_writer_id();
        let b = random_writer_id();
        names::check_writer_id(&a).unwrap();
        assert_ne!(a, b);
        assert!(a.contains(&format!("-{}-", std::process::id())), "{a}");
    }

    #[test]
    fn bad_options_are_named() {
        let bad = |c: WriterConfig, word: &str| {
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(word), "{e} should name {word}");
        };
        bad(
            WriterConfig {
                level: 99,
                ..Default::default()
            },
            "level",
        );
        bad(
            WriterConfig {
                shard_size: 0,
                ..Default::default()
            },
            "shard_size",
        );
        bad(
            WriterConfig {
                batch_bytes: 0,
                ..Default::default()
            },
            "batch_bytes",
        );
        bad(
            WriterConfig {
                max_inflight_bytes: 0,
                ..Default::default()
            },
            "max_inflight_bytes",
        );
        bad(
            WriterConfig {
                durability: Durability::EveryBytes(0),
                ..Default::default()
            },
            "durability",
        );
        bad(
            WriterConfig {
                threads: Some(0),
                ..Default::default()
            },
            "threads",
        );
        bad(
            WriterConfig {
                writer_id: Some("a/b".into()),
                ..Default::default()
            },
            "writer_id",
        );
        WriterConfig {
            codec: Codec::None,
            level: 99,
            ..Default::default()
        }
        .validate()
        .unwrap();
        assert_eq!(IoMode::from_name("io_uring").unwrap(), IoMode::Uring);
        assert!(IoMode::from_name("mmap").is_err());
    }
}
