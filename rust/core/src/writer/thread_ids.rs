//! The OS ids of a writer's compression threads, so that its caller can change their
//! scheduling (the vLLM worker lowers their priority, `layertap.vllm.threads`) without touching
//! the threads of another writer in the same process: a process may hold several writers, and
//! finding the threads by their name (`layertap-zstd-N`) would change each of them once per
//! writer opened.

use parking_lot::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The ids the compression threads gave as they started.
#[derive(Default)]
pub(crate) struct ThreadIds {
    ids: Mutex<Vec<i64>>,
    added: Condvar,
}

impl ThreadIds {
    /// Records the calling thread's OS id (Linux; elsewhere nothing, as there is no per-thread
    /// priority to change).
    pub(crate) fn register_current(&self) {
        if let Some(id) = current_thread_id() {
            self.ids.lock().push(id);
            self.added.notify_all();
        }
    }

    /// The ids registered so far, after waiting up to `wait` until `expected` threads have
    /// registered (a thread takes a moment to start after the writer opens).
    pub(crate) fn wait_for(&self, expected: usize, wait: Duration) -> Vec<i64> {
        let deadline = Instant::now() + wait;
        let mut ids = self.ids.lock();
        while ids.len() < expected && cfg!(target_os = "linux") {
            if self.added.wait_until(&mut ids, deadline).timed_out() {
                break;
            }
        }
        ids.clone()
    }
}

#[cfg(target_os = "linux")]
fn current_thread_id() -> Option<i64> {
    // SAFETY: gettid(2) takes no arguments, cannot fail and touches no memory of ours.
    Some(i64::from(unsafe { libc::gettid() }))
}

#[cfg(not(target_os = "linux"))]
fn current_thread_id() -> Option<i64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn each_thread_gives_its_own_id() {
        let ids = Arc::new(ThreadIds::default());
        let threads: Vec<_> = (0..3)
            .map(|_| {
                let ids = ids.clone();
                std::thread::spawn(move || ids.register_current())
            })
            .collect();
        let got = ids.wait_for(3, Duration::from_secs(30));
        for t in threads {
            t.join().unwrap();
        }
        if cfg!(target_os = "linux") {
            let mut unique = got.clone();
            unique.sort_unstable();
            unique.dedup();
            assert_eq!(unique.len(), 3, "{got:?}");
            assert!(!got.contains(&current_thread_id().unwrap()));
        } else {
            assert!(got.is_empty());
        }
    }

    #[test]
    fn waiting_ends_at_the_deadline() {
        let ids = ThreadIds::default();
        let started = Instant::now();
        assert!(ids.wait_for(1, Duration::from_millis(50)).is_empty());
        assert!(started.elapsed() < Duration::from_secs(20));
    }
}
