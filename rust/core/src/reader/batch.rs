//! A training batch's records read together: each record's stored bytes asked of the kernel
//! first (cold files are read while the first records decode), then the records decoded on a
//! few threads, each tensor of the chosen name straight into its row of the batch.

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

fn give_back(scratch: Scratch) {
    if let Some(mut kept) = SCRATCH.try_lock() {
        if kept.len() < KEEP_SCRATCH {
            kept.push(scratch);
        }
    }
}

/// Reads every record of `batch` (see [`ShardReader::read_placed`]) on up to `threads` threads
/// (the caller's among them), setting each one's `result`.
pub fn read_batch(batch: &mut [BatchRead<'_>], name: &str, verify: bool, threads: usize) {
    for r in batch.iter() {
        r.reader.will_need(r.index);
    }
    let threads = threads.clamp(1, batch.len().max(1));
    let work = Mutex::new(batch.iter_mut());
    let run = || {
        let mut scratch = take_scratch();
        loop {
            let Some(r) = work.lock().next() else { break };
            r.reader.populate(r.index);
            r.result = Some(
                r.reader
                    .read_placed(r.index, verify, name, r.dst, &mut scratch),
            );
        }
        give_back(scratch);
    };
    std::thread::scope(|s| {
        for _ in 1..threads {
            s.spawn(run);
        }
        run();
    });
}
