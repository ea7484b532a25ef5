//! A training batch's records read together: each record's stored bytes asked of the kernel
//! first (cold files are read while the first records decode), then the records decoded on a
//! few threads, each tensor of the chosen name straight into its row of the batch; or, for a
//! decoder on a GPU, each record's stored payload copied out as it is.

use super::place::{Placed, Scratch};
use super::ShardReader;
use crate::error::Result;
use parking_lot::Mutex;

/// One record of a batch: where it is, the row its tensor goes to, and what came of it.
#[derive(Debug)]
pub struct BatchRead<'a> {
    /// The shard holding the record.
    pub reader: &'a ShardReader,
    /// Its position in the shard.
    pub index: usize,
    /// The memory its tensor is decoded into (see [`ShardReader::read_placed`]).
    pub dst: &'a mut [u8],
    /// Set by [`read_batch`].
    pub result: Option<Result<Placed>>,
}

/// Scratch buffers of threads that finished a batch, for the next one (a decoded blob's pages
/// stay faulted in). A process forked while another thread held the lock finds it taken and
/// makes its own.
static SCRATCH: Mutex<Vec<Scratch>> = Mutex::new(Vec::new());

/// At most this many scratch buffers are kept between batches.
const KEEP_SCRATCH: usize = 8;

fn take_scratch() -> Scratch {
    SCRATCH
        .try_lock()
        .and_then(|mut s| s.pop())
        .unwrap_or_default()
}

fn give_back(mut scratch: Scratch) {
    // A batch's spread is its own: a read that takes this buffer next decodes on its thread.
    scratch.threads = 0;
    if let Some(mut kept) = SCRATCH.try_lock() {
        if kept.len() < KEEP_SCRATCH {
            kept.push(scratch);
        }
    }
}

/// Runs `f` with a scratch buffer of the pool (kept for the next caller afterwards).
pub(crate) fn with_scratch<T>(f: impl FnOnce(&mut Scratch) -> T) -> T {
    let mut scratch = take_scratch();
    let out = f(&mut scratch);
    give_back(scratch);
    out
}

/// Reads every record of `batch` (see [`ShardReader::read_placed`]) on up to `threads` threads
/// (the caller's among them), setting each one's `result`. With fewer records than threads,
/// each record's large `exp-huf` blocks spread over the threads left (a trainer's batch of a
/// few long records on a many-core host).
pub fn read_batch(batch: &mut [BatchRead<'_>], name: &str, verify: bool, threads: usize) {
    for r in batch.iter() {
        r.reader.will_need(r.index);
    }
    let per_record = (threads / batch.len().max(1)).max(1);
    on_threads(batch, threads, take_scratch, give_back, |scratch, r| {
        scratch.threads = per_record;
        r.reader.populate(r.index);
        r.result = Some(r.reader.read_placed(r.index, verify, name, r.dst, scratch));
    });
}

/// One record of a batch whose stored payload is copied out as the shard holds it.
#[derive(Debug)]
pub struct StoredRead<'a> {
    /// The shard holding the record.
    pub reader: &'a ShardReader,
    /// Its position in the shard.
    pub index: usize,
    /// Where its stored payload goes: exactly its `stored_len` bytes.
    pub dst: &'a mut [u8],
    /// Set by [`read_stored_batch`].
    pub result: Option<Result<()>>,
}

/// Copies the stored payload of every record of `batch` (see [`ShardReader::read_stored`]) on
/// up to `threads` threads (the caller's among them), setting each one's `result`: a decoder
/// that runs elsewhere (on a GPU) gets a batch's bytes, checksums checked, at the speed of
/// several cores' copies.
pub fn read_stored_batch(batch: &mut [StoredRead<'_>], verify: bool, threads: usize) {
    for r in batch.iter() {
        r.reader.will_need(r.index);
    }
    on_threads(
        batch,
        threads,
        || (),
        drop,
        |(), r| {
            r.result = Some(r.reader.read_stored(r.index, verify, r.dst));
        },
    );
}

/// Runs `each` on every item of `items` on up to `threads` threads (the caller's among them),
/// each thread taking the next item when it finishes one, with a state of its own that `start`
/// makes and `end` takes back.
fn on_threads<T: Send, S>(
    items: &mut [T],
    threads: usize,
    start: impl Fn() -> S + Sync,
    end: impl Fn(S) + Sync,
    each: impl Fn(&mut S, &mut T) + Sync,
) {
    let threads = threads.clamp(1, items.len().max(1));
    let work = Mutex::new(items.iter_mut());
    let run = || {
        let mut state = start();
        loop {
            let Some(item) = work.lock().next() else {
                break;
            };
            each(&mut state, item);
        }
        end(state);
    };
    std::thread::scope(|s| {
        for _ in 1..threads {
            s.spawn(run);
        }
        run();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scratch_buffer_goes_back_without_its_batch_spread() {
        let mut scratch = Scratch::default();
        scratch.threads = 4;
        give_back(scratch);
        // The pool is the process's: other tests' buffers may be in it too, none with a spread.
        let kept = SCRATCH.lock();
        assert!(!kept.is_empty());
        assert!(kept.iter().all(|s| s.threads == 0));
    }
}
