//! Making an open shard complete again (docs/FORMAT.md, "Recovery"): under the shard's exclusive
//! lock, scan its frames, cut the torn tail and append an index of the valid records.

use crate::error::{Error, Result};
use crate::format::{encode_recovered_footer, FILE_HEADER_FIXED_LEN, MAX_META_LEN};
use crate::reader::{is_torn_empty, lock_exclusive_now, Problem, ShardReader};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

/// What [`recover`] did to a shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoverReport {
    /// The shard.
    pub path: PathBuf,
    /// Whether the shard was complete already (then it was left untouched).
    pub was_complete: bool,
    /// Records indexed in the (now complete) shard.
    pub records: u64,
    /// Bytes cut from the end of the file: the torn tail, and an unusable footer.
    pub truncated_bytes: u64,
    /// Corrupt records and damaged regions, left in the file and not indexed. Their number is
    /// kept in the trailer (`lost_in_recovery`), for readers to report.
    pub problems: Vec<Problem>,
    /// Whether the file was a torn empty shard (shorter than its header, no records), which was
    /// removed.
    pub removed: bool,
}

/// Completes the shard at `path` if it is open: takes its exclusive lock without waiting
/// ([`Error::Locked`] if a writer holds it), scans it, truncates the file to the end of its last
/// valid record frame, appends an index of the valid records and a trailer, and `fsync`s it.
///
/// A complete shard is left as it is. Bytes before the end of the last valid frame are never
/// removed, so running it again after an interruption gives the same result. A torn empty shard
/// (shorter than its header: see [`is_torn_empty`]) holds no record and is removed.
pub fn recover(path: impl AsRef<Path>) -> Result<RecoverReport> {
    let path = path.as_ref().to_path_buf();
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|e| Error::io(&path, "open", e))?;
    lock_exclusive_now(&file, &path)?;
    // The reader gets its own descriptor of the same open file, so the lock (which belongs to
    // the open file) lasts until `file` is closed at the end of this function.
    let dup = file.try_clone().map_err(|e| Error::io(&path, "dup", e))?;
    if let Some(len) = torn_empty_len(&file, &path)? {
        remove_torn_empty(&file, &path)?;
        return Ok(RecoverReport {
            path,
            was_complete: false,
            records: 0,
            truncated_bytes: len,
            problems: Vec::new(),
            removed: true,
        });
    }
    let reader = ShardReader::from_file(path.clone(), dup)?;
    if reader.is_complete() {
        return Ok(RecoverReport {
            path,
            was_complete: true,
            records: reader.len() as u64,
            truncated_bytes: 0,
            problems: Vec::new(),
            removed: false,
        });
    }
    let data_end = reader.data_end();
    // A file cut inside the header's padding is shorter than `data_end`: set_len below pads it
    // with zeros, so that the index frame starts at a multiple of 8.
    let truncated_bytes = reader.file_len().saturating_sub(data_end);
    let entries = reader.entries().to_vec();
    let problems: Vec<Problem> = reader
        .problems()
        .iter()
        .filter(|p| {
            matches!(
                p,
                Problem::CorruptRecord { .. } | Problem::DamagedRegion { .. }
            )
        })
        .cloned()
        .collect();
    let lost = u32::try_from(problems.len()).unwrap_or(u32::MAX);
    // Unmap before cutting the file: nothing may touch the pages about to go.
    drop(reader);
    file.set_len(data_end)
        .map_err(|e| Error::io(&path, "ftruncate", e))?;
    file.write_all_at(&encode_recovered_footer(&entries, data_end, lost), data_end)
        .map_err(|e| Error::io(&path, "write", e))?;
    file.sync_all().map_err(|e| Error::io(&path, "fsync", e))?;
    Ok(RecoverReport {
        path,
        was_complete: false,
        records: entries.len() as u64,
        truncated_bytes,
        problems,
        removed: false,
    })
}

/// The length of the locked shard `file` if it is a torn empty shard.
fn torn_empty_len(file: &File, path: &Path) -> Result<Option<u64>> {
    let len = file
        .metadata()
        .map_err(|e| Error::io(path, "stat", e))?
        .len();
    let most = (FILE_HEADER_FIXED_LEN + 4 + MAX_META_LEN) as u64;
    if len >= most {
        return Ok(None);
    }
    let mut head = vec![0u8; len as usize];
    file.read_exact_at(&mut head, 0)
        .map_err(|e| Error::io(path, "read", e))?;
    Ok(is_torn_empty(&head).then_some(len))
}

/// Removes the torn empty shard `file` (locked by us) from its directory, if `path` still names
/// it, and makes the removal durable.
fn remove_torn_empty(file: &File, path: &Path) -> Result<()> {
    let ours = file.metadata().map_err(|e| Error::io(path, "stat", e))?;
    match std::fs::symlink_metadata(path) {
        Ok(now) if now.dev() == ours.dev() && now.ino() == ours.ino() => {}
        // Replaced or removed since we opened it: not ours to remove.
        _ => return Ok(()),
    }
    std::fs::remove_file(path).map_err(|e| Error::io(path, "remove", e))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, "fsync", e))
}
