//! The shard lock (docs/FORMAT.md, "Shard layout"): a writer holds an exclusive `flock(2)` on a
//! shard for as long as it writes it. Readers only probe it; `recover` takes it without waiting.

use crate::error::{Error, Result};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;

/// Calls `flock(fd, op)`, retrying when interrupted. `Ok(false)` when the lock is held
/// elsewhere (`EWOULDBLOCK`, with `LOCK_NB` in `op`).
fn flock(file: &File, op: libc::c_int) -> std::io::Result<bool> {
    loop {
        // SAFETY: flock only reads the descriptor number; `file` keeps the descriptor open.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(true);
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EWOULDBLOCK) => return Ok(false),
            _ => return Err(err),
        }
    }
}

/// Whether another process (or another open file of this one) holds the shard's lock, i.e. a
/// writer is writing it now.
///
/// Probes with a shared lock taken without waiting on a file opened for the purpose and released
/// at once; a writer taking its exclusive lock at that very moment could see it busy, so writers
/// should take theirs before anyone can know the shard (right after creating it).
pub fn is_being_written(path: impl AsRef<Path>) -> Result<bool> {
    let path = path.as_ref();
    let file = File::open(path).map_err(|e| Error::io(path, "open", e))?;
    let free =
        flock(&file, libc::LOCK_SH | libc::LOCK_NB).map_err(|e| Error::io(path, "flock", e))?;
    if free {
        flock(&file, libc::LOCK_UN).map_err(|e| Error::io(path, "flock", e))?;
    }
    Ok(!free)
}

/// Takes the exclusive lock of an open shard without waiting: [`Error::Locked`] when someone
/// holds it. The lock lasts until every descriptor of this open file is closed.
pub(crate) fn lock_exclusive_now(file: &File, path: &Path) -> Result<()> {
    match flock(file, libc::LOCK_EX | libc::LOCK_NB) {
        Ok(true) => Ok(()),
        Ok(false) => Err(Error::Locked {
            path: path.to_path_buf(),
        }),
        Err(e) => Err(Error::io(path, "flock", e)),
    }
}
