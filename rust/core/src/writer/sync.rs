//! The sync thread (`layertap-sync`): the `fsync`s of the durability policy, off the I/O
//! thread.
//!
//! An `fsync` waits until the disk holds everything the page cache still has of a file: about a
//! second for a shard of 1 GiB. Done on the I/O thread, it stopped every write and every
//! completion meanwhile, and a caller that reuses its buffers only on completions (the vLLM
//! connector) stalled with it at each shard rotation. So the I/O thread completes a shard (index
//! and trailer written: its records are readable and already reported, and its lock released),
//! hands the file here and goes on with the next shard; this thread `fsync`s the shard and
//! closes it. The periodic
//! `fsync` of the open shard (durability every N bytes) and the directory `fsync` after a shard
//! is created come here too.
//!
//! Jobs run one at a time in the order they were sent, so a [`SyncJob::Barrier`] answered here
//! means every `fsync` sent before it is done: `flush` waits on one, and `close` joins this
//! thread, which ends once the I/O thread (the only sender) is gone and the queue is empty.
//! An `fsync` error fails the writer (kept in [`Shared`] for the next call) and tells the I/O
//! thread to stop; later jobs still run, so that what can be made durable is.

use super::shard::{self, ShardFile};
use super::state::Shared;
use crate::error::{Error, Result};
use crossbeam_channel::{Receiver, Sender};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Jobs that may wait while one runs; past that, [`Syncer::send`] blocks the I/O thread.
/// Without a bound the I/O thread could run any number of shards ahead of the disk: dirty pages
/// would pile up in the page cache (until the kernel throttles every writer at a moment nobody
/// chose), and a `flush` or `close` would then wait for all of them. A rotation sends two jobs
/// (the complete shard, the new directory entry), so this lets one complete shard wait while
/// the one before it is being synced; the I/O thread waits before it starts the shard after.
const QUEUED_JOBS: usize = 2;

/// Work for the sync thread.
pub(crate) enum SyncJob {
    /// `fdatasync` the open shard (durability every N bytes, and `flush`).
    Data(ShardFile),
    /// A complete shard (already unlocked): `fsync` it, close it and count it closed.
    Finish(ShardFile),
    /// `fsync` the directory a shard was just created in, so that its name survives a crash.
    Dir(PathBuf),
    /// Answer once every job sent before it is done.
    Barrier(Sender<()>),
}

/// The I/O thread's end of the sync queue.
pub(crate) struct Syncer {
    jobs: Sender<SyncJob>,
    failed: Arc<AtomicBool>,
}

/// The sync thread's end of the queue.
pub(crate) struct SyncQueue {
    jobs: Receiver<SyncJob>,
    failed: Arc<AtomicBool>,
}

/// A new, empty sync queue.
pub(crate) fn queue() -> (Syncer, SyncQueue) {
    let (tx, rx) = crossbeam_channel::bounded(QUEUED_JOBS);
    let failed = Arc::new(AtomicBool::new(false));
    (
        Syncer {
            jobs: tx,
            failed: failed.clone(),
        },
        SyncQueue { jobs: rx, failed },
    )
}

impl Syncer {
    /// Queues `job`; waits while [`QUEUED_JOBS`] jobs wait already.
    pub fn send(&self, job: SyncJob) -> Result<()> {
        self.jobs
            .send(job)
            .map_err(|_| Error::Closed(Some("the writer's sync thread stopped".into())))
    }

    /// Whether an `fsync` failed (its error is kept in [`Shared`]).
    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }
}

/// The body of the sync thread: runs jobs until every sender is gone.
pub(crate) fn run(queue: SyncQueue, shared: &Shared) {
    for job in &queue.jobs {
        let result = match job {
            SyncJob::Data(f) => f.sync_data(),
            SyncJob::Finish(f) => {
                // Jobs before this one held the other handles and are done: dropping `f`
                // closes the file, so a shard counted closed is durable and closed.
                let synced = f.sync_all();
                drop(f);
                if synced.is_ok() {
                    shared.shard_closed();
                }
                synced
            }
            SyncJob::Dir(dir) => shard::fsync_dir(&dir),
            SyncJob::Barrier(ack) => {
                let _ = ack.send(()); // the caller may have stopped waiting
                Ok(())
            }
        };
        if let Err(e) = result {
            // The error first, so that when the I/O thread sees the flag it is the one kept.
            shared.fail(e);
            queue.failed.store(true, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::os::fd::FromRawFd;

    /// A real `fsync` that fails: Linux refuses it on a pipe (EINVAL). No file system here
    /// fails `fsync` on a regular file on demand, so the writer as a whole is not tested with
    /// one; this checks that the error reaches the writer's state, typed and named.
    #[test]
    fn an_fsync_error_fails_the_writer() {
        let mut fds = [0; 2];
        // SAFETY: `fds` is valid for writes of two descriptors.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both descriptors were just opened and are owned by nobody else.
        let (read_end, write_end) =
            unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
        let shared = Arc::new(Shared::new(1 << 20));
        let (syncer, queue) = queue();
        let path = PathBuf::from("/shards/w-000000.lts");
        let (ack, acked) = crossbeam_channel::bounded(1);
        // Both fit the queue before the thread starts.
        syncer
            .send(SyncJob::Finish(ShardFile {
                path: path.clone(),
                file: Arc::new(write_end),
            }))
            .unwrap();
        syncer.send(SyncJob::Barrier(ack)).unwrap();
        let thread = {
            let shared = shared.clone();
            std::thread::spawn(move || run(queue, &shared))
        };
        acked
            .recv()
            .expect("the barrier is answered after the failed job");
        assert!(syncer.failed(), "the I/O thread is told to stop");
        drop(syncer);
        thread.join().unwrap(); // the thread ends with its last sender
        match shared.check() {
            Err(Error::Io {
                path: p,
                op,
                source,
            }) => {
                assert_eq!((p.as_path(), op), (path.as_path(), "fsync"));
                assert_eq!(source.raw_os_error(), Some(libc::EINVAL));
            }
            other => panic!("want the fsync error, got {other:?}"),
        }
        assert!(
            matches!(shared.check(), Err(Error::Closed(Some(_)))),
            "later calls: closed"
        );
        drop(read_end);
    }
}
