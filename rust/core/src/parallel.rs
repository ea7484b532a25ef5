//! Work split over a few threads for the length of one call: a record's checksum in pieces, a
//! block's streams, tables and rows (`exphuf::column_decode`), when a batch leaves threads spare.

/// Runs `job` on every item of `todo`, `per` items a thread: the caller's thread takes the first
/// part, and no thread is started where there is only one.
pub(crate) fn in_parts<T: Send>(todo: &mut [T], per: usize, job: impl Fn(&mut T) + Sync) {
    let job = &job;
    std::thread::scope(|s| {
        let mut parts = todo.chunks_mut(per.max(1));
        let first = parts.next();
        for part in parts {
            s.spawn(move || part.iter_mut().for_each(job));
        }
        if let Some(part) = first {
            part.iter_mut().for_each(job);
        }
    });
}
