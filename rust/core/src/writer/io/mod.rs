//! I/O backends: they execute [`WriteOp`]s, possibly several at once, and hand them back when
//! finished, so that the memory the kernel reads stays owned until the kernel is done with it.

mod pwrite;
#[cfg(target_os = "linux")]
mod uring;

use super::batch::WriteOp;
use super::config::{Backend, IoMode};
use std::io;

/// A write that is done, well or not.
pub(crate) struct Finished {
    pub id: u64,
    pub op: WriteOp,
    pub result: io::Result<()>,
}

/// Something that writes [`WriteOp`]s.
pub(crate) trait Engine: Send {
    /// Which backend this is.
    fn backend(&self) -> Backend;
    /// How many ops may be in flight at once.
    fn capacity(&self) -> usize;
    /// Ops submitted and not yet returned by [`Engine::reap`].
    fn in_flight(&self) -> usize;
    /// Starts writing `op`; its outcome comes back from [`Engine::reap`] under `id`.
    fn submit(&mut self, id: u64, op: WriteOp);
    /// The ops finished since the last call; with `wait`, blocks until at least one is (if any
    /// is in flight). `Err` means the backend itself broke: the ops still in it are kept until
    /// it is dropped (which waits for the kernel, or leaks them rather than free memory the
    /// kernel may still read).
    fn reap(&mut self, wait: bool) -> io::Result<Vec<Finished>>;
}

/// The engine for `mode`: io_uring when asked for or available, else pwrite.
pub(crate) fn open_engine(mode: IoMode) -> io::Result<Box<dyn Engine>> {
    match mode {
        IoMode::Pwrite => Ok(Box::new(pwrite::PwriteEngine::new()?)),
        #[cfg(target_os = "linux")]
        IoMode::Uring => Ok(Box::new(uring::UringEngine::new()?)),
        #[cfg(target_os = "linux")]
        IoMode::Auto => match uring::UringEngine::new() {
            Ok(e) => Ok(Box::new(e)),
            // Refused (ENOSYS, EPERM, seccomp, io_uring_disabled, missing opcodes): fall back.
            Err(_) => Ok(Box::new(pwrite::PwriteEngine::new()?)),
        },
        #[cfg(not(target_os = "linux"))]
        IoMode::Uring => Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "io_uring needs Linux",
        )),
        #[cfg(not(target_os = "linux"))]
        IoMode::Auto => Ok(Box::new(pwrite::PwriteEngine::new()?)),
    }
}
