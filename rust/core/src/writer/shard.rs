//! One shard file being written: exclusive creation, the lock, the file header, the index kept
//! in memory, and the footer (index frame and trailer) written when the shard is complete.

use super::batch::Placed;
use super::create::create_shard_file;
use super::direct::DirectShard;
use crate::error::{Error, Result};
use crate::format::{self, FileHeader, IndexEntry};
use crate::names;
use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What every shard header of a writer holds besides its index.
pub(crate) struct ShardNaming {
    pub dir: PathBuf,
    pub writer_id: String,
    pub user_meta: BTreeMap<String, String>,
}

/// An open shard: created by this writer, locked, its file header written.
pub(crate) struct OpenShard {
    pub path: PathBuf,
    /// Direct I/O state, when the shard is written with `O_DIRECT`. Declared before `file` so
    /// that its descriptor closes first: closing `file` releases the lock.
    pub direct: Option<DirectShard>,
    /// Shared with the sync thread while it `fsync`s the shard; the file closes when the last
    /// handle is dropped. The lock is released by [`OpenShard::finish`] once the shard is
    /// complete, or with the file when the shard is left open (a failed writer).
    file: Arc<File>,
    /// Where the next frame goes (past every frame handed to the backend).
    pub alloc_end: u64,
    /// Every byte before this offset is in the file (writes retired in order, tail written).
    pub file_end: u64,
    /// End of the last frame fully in the file and reported done.
    pub written_end: u64,
    /// Records given a place in this shard.
    pub allocated: u64,
    /// Frames handed to writes (or staged) and not reported done yet, in file order.
    pub unreported: VecDeque<Placed>,
    /// Index entries of the records written, in file order.
    pub entries: Vec<IndexEntry>,
}

impl OpenShard {
    /// Creates shard `index` (never overwriting a file), locked, with its file header written:
    /// the file appears under its name only with its header in it ([`create_shard_file`]).
    /// With a durability policy the caller then `fsync`s the directory ([`fsync_dir`]), so that
    /// the new name survives a crash. With `direct_chunk` (the size of direct writes), record
    /// data goes through an `O_DIRECT` descriptor if the file system allows it (`direct` is
    /// `None` on the shard if it does not).
    pub fn create(
        naming: &ShardNaming,
        index: u64,
        direct_chunk: Option<u64>,
    ) -> Result<OpenShard> {
        let path = naming
            .dir
            .join(names::shard_file_name(&naming.writer_id, index));
        let header = FileHeader {
            shard_id: random_id(),
            meta_json: shard_meta(naming, index),
        }
        .encode();
        let file = create_shard_file(&path, &header)?;
        let direct = match direct_chunk {
            None => None,
            Some(chunk) => match DirectShard::open(&path, &file, &header, chunk) {
                Ok(d) => d,
                Err(e) => {
                    // The shard holds no record yet: remove it rather than leave it behind.
                    let _ = std::fs::remove_file(&path);
                    return Err(Error::io(&path, "open with O_DIRECT", e));
                }
            },
        };
        let end = header.len() as u64;
        Ok(OpenShard {
            path,
            file: Arc::new(file),
            alloc_end: end,
            file_end: end,
            written_end: end,
            allocated: 0,
            unreported: VecDeque::new(),
            entries: Vec::new(),
            direct,
        })
    }

    /// The buffered descriptor's file, for writes outside the backend (the direct tail).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Whether records of this shard wait to be copied into bounce buffers (direct I/O).
    pub fn is_staging(&self) -> bool {
        self.direct.as_ref().is_some_and(DirectShard::is_staging)
    }

    /// Whether record data goes through `O_DIRECT` (false when the file system refused it).
    pub fn is_direct(&self) -> bool {
        self.direct.as_ref().is_some_and(|d| !d.refused)
    }

    /// The descriptor, for the I/O backend.
    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Whether a frame of `frame_len` bytes must go to the next shard instead: this one holds
    /// a record already and the frame would take it past `shard_size`.
    pub fn is_full_for(&self, frame_len: u64, shard_size: u64) -> bool {
        self.allocated > 0 && self.alloc_end.saturating_add(frame_len) > shard_size
    }

    /// Starts writing `[start, end)` back to the disk without waiting for it (Linux
    /// `sync_file_range`), so that the disk works while the next records are copied into the
    /// page cache and the `fsync` that makes the shard durable finds little left to write.
    /// Best effort: a failure shows at that `fsync`.
    pub fn start_writeback(&self, start: u64, end: u64) {
        #[cfg(target_os = "linux")]
        if end > start {
            // SAFETY: a system call on a descriptor we own; no memory is involved.
            unsafe {
                libc::sync_file_range(
                    self.file.as_raw_fd(),
                    start as libc::off64_t,
                    (end - start) as libc::off64_t,
                    libc::SYNC_FILE_RANGE_WRITE,
                )
            };
        }
        #[cfg(not(target_os = "linux"))]
        let _ = (start, end);
    }

    /// A second handle on the file, for an `fsync` of what is written so far on the sync
    /// thread while the I/O thread goes on writing.
    pub fn sync_handle(&self) -> ShardFile {
        ShardFile {
            path: self.path.clone(),
            file: self.file.clone(),
        }
    }

    /// Writes the index frame and trailer after the last frame, then releases the lock. Every
    /// frame must be written (none in flight). Returns the complete shard still open, to be
    /// `fsync`ed per the durability policy; dropping it closes the file.
    ///
    /// The lock tells readers and `recover` that a live writer may still change the shard. No
    /// byte of a complete shard changes again, so it is released here rather than when the file
    /// closes after the `fsync`, which can take a second for a large shard on the sync thread:
    /// meanwhile readers saw a complete shard as being written and `recover` refused it.
    pub fn finish(self) -> Result<ShardFile> {
        debug_assert_eq!(self.alloc_end, self.written_end);
        debug_assert!(self.unreported.is_empty());
        let footer = format::encode_footer(&self.entries, self.written_end);
        if let Err(e) = self.file.write_all_at(&footer, self.written_end) {
            self.truncate_to_written();
            return Err(Error::io(&self.path, "write", e));
        }
        // The O_DIRECT descriptor closes here, before the file (see `direct`).
        let OpenShard {
            path, direct, file, ..
        } = self;
        drop(direct);
        unlock(&file);
        Ok(ShardFile { path, file })
    }

    /// After a failed write: cuts the file back to the end of the last frame fully written, so
    /// only whole frames remain (what recovery expects), and closes it. Best effort: the error
    /// that got us here is what the caller reports.
    pub fn truncate_to_written(&self) {
        let _ = self.file.set_len(self.written_end);
    }
}

/// Releases the shard's lock, keeping the file open. Best effort: `LOCK_UN` of a lock this
/// descriptor holds does not fail, and if it did the lock would still go with the file.
fn unlock(file: &File) {
    // SAFETY: flock on a descriptor `file` keeps open for the call; no memory is involved.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
}

/// A shard's path and a handle on its file: what the sync thread needs to `fsync` it.
pub(crate) struct ShardFile {
    pub path: PathBuf,
    pub file: Arc<File>,
}

impl ShardFile {
    /// `fdatasync`s what was written so far.
    pub fn sync_data(&self) -> Result<()> {
        self.file
            .sync_data()
            .map_err(|e| Error::io(&self.path, "fsync", e))
    }

    /// `fsync`s the file, data and metadata (its length, for the footer).
    pub fn sync_all(&self) -> Result<()> {
        self.file
            .sync_all()
            .map_err(|e| Error::io(&self.path, "fsync", e))
    }
}

/// The shard metadata JSON (docs/FORMAT.md, "File header").
fn shard_meta(naming: &ShardNaming, index: u64) -> String {
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let meta = serde_json::json!({
        "writer_id": naming.writer_id,
        "shard_index": index,
        "created_unix_ms": created,
        "writer": concat!("layertap-rust ", env!("CARGO_PKG_VERSION")),
        "user": naming.user_meta,
    });
    meta.to_string()
}

fn random_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    if getrandom::fill(&mut id).is_err() {
        // No entropy source: time and pid still make a collision very unlikely.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        id[..12].copy_from_slice(&nanos.to_le_bytes()[..12]);
        id[12..].copy_from_slice(&std::process::id().to_le_bytes());
    }
    id
}

/// `fsync`s a directory, so that the names created in it are durable.
pub(crate) fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, "fsync", e))
}

/// The index of the next shard of `writer_id` in `dir`: one past the highest it has there.
pub(crate) fn next_shard_index(dir: &Path, writer_id: &str) -> Result<u64> {
    let mut next = 0;
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, "read directory", e))? {
        let entry = entry.map_err(|e| Error::io(dir, "read directory", e))?;
        if let Some(n) = entry
            .file_name()
            .to_str()
            .and_then(|n| names::parse_shard_index(n, writer_id))
        {
            next = next.max(n + 1);
        }
    }
    Ok(next)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reader::{is_being_written, ShardReader};
    use crate::recover::recover;

    /// A complete shard is unlocked as soon as its trailer is written, while the handle the sync
    /// thread `fsync`s through is still open: readers see it complete and not being written, and
    /// `recover` leaves it as it is instead of refusing it (issue 11 item 8).
    #[test]
    fn a_finished_shard_is_unlocked_before_its_fsync() {
        let dir = tempfile::tempdir().unwrap();
        let naming = ShardNaming {
            dir: dir.path().to_path_buf(),
            writer_id: "w".into(),
            user_meta: BTreeMap::new(),
        };
        let shard = OpenShard::create(&naming, 0, None).unwrap();
        let path = shard.path.clone();
        assert!(is_being_written(&path).unwrap(), "an open shard is locked");
        let complete = shard.finish().unwrap(); // what the sync thread gets to fsync
        assert!(
            !is_being_written(&path).unwrap(),
            "a complete shard is unlocked before its fsync"
        );
        assert!(ShardReader::open(&path).unwrap().is_complete());
        let report = recover(&path).unwrap();
        assert!(report.was_complete && report.truncated_bytes == 0);
        complete.sync_all().unwrap();
    }
}
