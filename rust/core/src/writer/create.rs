//! Creating a shard file so that it never shows under its name without its header
//! (docs/FORMAT.md, "Writing"): a writer killed between creating a file and writing its header
//! would otherwise leave a headerless `.lts` that readers cannot tell from a foreign file.
//!
//! The header is written into a file without a name (Linux `O_TMPFILE`), locked, and the file is
//! then linked under its shard name with `linkat`, which fails if the name exists, as
//! `O_CREAT|O_EXCL` does. Where `O_TMPFILE` or linking it is refused (file systems without
//! it, no `/proc`), the header goes into a file under a temporary name that is not a shard name
//! (`.NAME.PID.tmp`), which is hard-linked to the shard name and then unlinked. Where hard links
//! are refused too, the shard is created under its name as before.

use crate::error::{Error, Result};
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Creates the shard `path` holding `header` (the file header), with this open file holding
/// its exclusive lock: the name appears, atomically, with the header in the file and the lock
/// held. Fails with `EEXIST` (as [`Error::Io`]) if `path` exists.
pub(crate) fn create_shard_file(path: &Path, header: &[u8]) -> Result<File> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    #[cfg(target_os = "linux")]
    if let Some(file) = unnamed(dir, path, header)? {
        return Ok(file);
    }
    if let Some(file) = under_temporary_name(dir, path, header)? {
        return Ok(file);
    }
    directly(path, header)
}

/// `O_TMPFILE` and `linkat`. `Ok(None)` when the kernel or file system refuses either, so the
/// caller falls back; any other failure is an error.
#[cfg(target_os = "linux")]
fn unnamed(dir: &Path, path: &Path, header: &[u8]) -> Result<Option<File>> {
    let file = match OpenOptions::new()
        .write(true)
        .mode(0o644)
        .custom_flags(libc::O_TMPFILE | libc::O_CLOEXEC)
        .open(dir)
    {
        Ok(f) => f,
        // EOPNOTSUPP: the file system has no O_TMPFILE; EISDIR/EINVAL: the kernel predates it.
        Err(e) if refused(&e) => return Ok(None),
        Err(e) => return Err(Error::io(path, "create", e)),
    };
    lock(&file, path)?;
    file.write_all_at(header, 0)
        .map_err(|e| Error::io(path, "write", e))?;
    let dst = c_path(path)?;
    let proc_path =
        CString::new(format!("/proc/self/fd/{}", file.as_raw_fd())).expect("no NUL in a number");
    // SAFETY: both paths are NUL-terminated strings that outlive the call; linkat reads them
    // and touches no other memory.
    let linked = unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            proc_path.as_ptr(),
            libc::AT_FDCWD,
            dst.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    };
    if linked == 0 {
        return Ok(Some(file));
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EEXIST) => Err(exists(path, err)),
        // No /proc, or linking refused (EXDEV on some overlays, EPERM): the unnamed file goes
        // away when `file` is dropped.
        Some(libc::ENOENT | libc::EXDEV | libc::EPERM | libc::EOPNOTSUPP | libc::EACCES) => {
            Ok(None)
        }
        _ => Err(Error::io(path, "link", err)),
    }
}

/// A temporary name, then `link(2)` to the shard name. `Ok(None)` when hard links are refused.
fn under_temporary_name(dir: &Path, path: &Path, header: &[u8]) -> Result<Option<File>> {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let temp: PathBuf = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    // A temporary file of a process that died with this pid: it was never linked, so it is not
    // a shard of anyone; replace it.
    let _ = std::fs::remove_file(&temp);
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(libc::O_CLOEXEC)
        .open(&temp)
        .map_err(|e| Error::io(&temp, "create", e))?;
    let ready = lock(&file, path)
        .and_then(|()| {
            file.write_all_at(header, 0)
                .map_err(|e| Error::io(path, "write", e))
        })
        .and_then(|()| match std::fs::hard_link(&temp, path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => Err(exists(path, e)),
            Err(e) if refused(&e) || e.raw_os_error() == Some(libc::EPERM) => Ok(false),
            Err(e) => Err(Error::io(path, "link", e)),
        });
    let _ = std::fs::remove_file(&temp);
    Ok(ready?.then_some(file))
}

/// The shard created under its name, then locked and its header written: a writer killed in
/// between leaves a headerless file, which `recover` removes.
fn directly(path: &Path, header: &[u8]) -> Result<File> {
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.kind() {
            ErrorKind::AlreadyExists => exists(path, e),
            _ => Error::io(path, "create", e),
        })?;
    let written = lock(&file, path).and_then(|()| {
        file.write_all_at(header, 0)
            .map_err(|e| Error::io(path, "write", e))
    });
    if let Err(e) = written {
        // The file holds no record: remove it rather than leave a headerless shard.
        let _ = std::fs::remove_file(path);
        return Err(e);
    }
    Ok(file)
}

/// Whether an error means "this way of creating files is not available here".
fn refused(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL | libc::ENOSYS)
    )
}

/// `EEXIST` from creating or linking: the errno is kept (Python sees `FileExistsError`).
fn exists(path: &Path, e: std::io::Error) -> Error {
    Error::io(path, "create", e)
}

fn c_path(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| Error::invalid(format!("{}: path holds a NUL byte", path.display())))
}

/// Takes the exclusive lock, waiting (the file is new: only readers probing the lock of a
/// named file hold it, each for an instant).
fn lock(file: &File, path: &Path) -> Result<()> {
    loop {
        // SAFETY: flock on a descriptor we own; no memory is involved.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINTR) {
            return Err(Error::io(path, "flock", err));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_way_makes_a_locked_file_with_its_header() {
        let dir = tempfile::tempdir().unwrap();
        let header = b"header bytes";
        #[cfg(target_os = "linux")]
        let unnamed = |p: &Path| unnamed(dir.path(), p, header).map(|f| f.expect("O_TMPFILE"));
        let temporary =
            |p: &Path| under_temporary_name(dir.path(), p, header).map(|f| f.expect("link"));
        let direct = |p: &Path| directly(p, header);
        type Way<'a> = (&'a str, &'a dyn Fn(&Path) -> Result<File>);
        let ways: Vec<Way<'_>> = vec![
            #[cfg(target_os = "linux")]
            ("unnamed", &unnamed),
            ("temporary", &temporary),
            ("direct", &direct),
        ];
        for (name, make) in ways {
            let path = dir.path().join(format!("{name}-000000.lts"));
            let file = make(&path).unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), header, "{name}");
            assert!(crate::reader::is_being_written(&path).unwrap(), "{name}");
            drop(file);
            assert!(!crate::reader::is_being_written(&path).unwrap(), "{name}");
            let again = make(&path).unwrap_err();
            assert_eq!(again.raw_os_error(), Some(libc::EEXIST), "{name}: {again}");
            assert_eq!(std::fs::read(&path).unwrap(), header, "{name}: untouched");
        }
        // Only the shards are left: no temporary names.
        let mut names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        let want: Vec<&str> = if cfg!(target_os = "linux") {
            vec![
                "direct-000000.lts",
                "temporary-000000.lts",
                "unnamed-000000.lts",
            ]
        } else {
            vec!["direct-000000.lts", "temporary-000000.lts"]
        };
        assert_eq!(names, want);
    }
}
