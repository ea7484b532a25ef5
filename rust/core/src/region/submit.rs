//! How a region's records reach the writer: all in one call, and when the writer refuses the
//! batch for one record's sake (bad input, a key it already took), one by one, so that the bad
//! record costs only itself.

use crate::error::{Error, Result};
use crate::writer::{RecordInput, ShardWriter};

/// A way into the writer: the binding's waits for the in-flight budget with the GIL released,
/// a Rust caller's plain calls (`&ShardWriter`).
pub trait Submit {
    /// Queues `records`, all or none (`ShardWriter::submit_many`).
    fn submit_many(&mut self, records: Vec<RecordInput>) -> Result<Vec<u64>>;
    /// Queues one record (`ShardWriter::submit`).
    fn submit_one(&mut self, record: RecordInput) -> Result<u64>;
}

impl Submit for &ShardWriter {
    fn submit_many(&mut self, records: Vec<RecordInput>) -> Result<Vec<u64>> {
        ShardWriter::submit_many(self, records)
    }

    fn submit_one(&mut self, record: RecordInput) -> Result<u64> {
        ShardWriter::submit(self, record)
    }
}

/// Whether the writer refused a record for the record's own sake, and would take the others.
fn refuses_only_the_record(e: &Error) -> bool {
    matches!(e, Error::InvalidInput(_) | Error::DuplicateKey { .. })
}

/// Submits records `0..count` (`build(i)` makes record `i`, again for a retry): `(index,
/// message)` for each the writer refused; any other error of the writer is returned.
pub(crate) fn all_or_each(
    writer: &mut impl Submit,
    count: usize,
    build: impl Fn(usize) -> RecordInput,
) -> Result<Vec<(usize, String)>> {
    let mut failures = Vec::new();
    match writer.submit_many((0..count).map(&build).collect()) {
        Ok(_) => {}
        Err(e) if refuses_only_the_record(&e) => {
            for i in 0..count {
                match writer.submit_one(build(i)) {
                    Ok(_) => {}
                    Err(e) if refuses_only_the_record(&e) => failures.push((i, e.to_string())),
                    Err(e) => return Err(e),
                }
            }
        }
        Err(e) => return Err(e),
    }
    Ok(failures)
}
