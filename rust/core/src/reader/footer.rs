//! Finding and checking the footer (index frame and trailer) of a complete shard
//! (docs/FORMAT.md, "Reading" step 2).

use crate::codec::Codec;
use crate::format::{
    align8, crc32c, decode_index, FrameHeader, FrameKind, IndexEntry, Trailer, FRAME_HEADER_LEN,
    TRAILER_LEN,
};

/// What the end of a file says about its shard.
#[derive(Debug)]
pub(crate) enum Footer {
    /// No valid trailer: an open shard.
    Absent,
    /// A valid trailer and index: a complete shard with these records.
    Valid {
        /// Where the index frame starts (the end of the record data).
        index_offset: u64,
        /// The records, in file order.
        entries: Vec<IndexEntry>,
        /// What the trailer says `recover` left out of the index.
        lost_in_recovery: u32,
    },
    /// A valid trailer whose index is unusable.
    Bad {
        /// Where the trailer says the index frame starts.
        index_offset: u64,
        /// What is wrong.
        reason: String,
    },
}

/// Reads the footer of the shard held in `bytes` (the whole file), whose records start at
/// `header_len`.
pub(crate) fn read_footer(bytes: &[u8], header_len: u64) -> Footer {
    let len = bytes.len() as u64;
    if len < header_len + TRAILER_LEN as u64 {
        return Footer::Absent;
    }
    let Some(trailer) = Trailer::decode(&bytes[bytes.len() - TRAILER_LEN..]) else {
        return Footer::Absent;
    };
    match check_index(bytes, header_len, trailer) {
        Ok(entries) => Footer::Valid {
            index_offset: trailer.index_offset,
            entries,
            lost_in_recovery: trailer.lost_in_recovery,
        },
        Err(reason) => Footer::Bad {
            index_offset: trailer.index_offset,
            reason,
        },
    }
}

/// Checks the index frame a valid trailer points to, and that its entries describe frames that
/// lie, in order and without overlapping, between the file header and the index.
fn check_index(bytes: &[u8], header_len: u64, trailer: Trailer) -> Result<Vec<IndexEntry>, String> {
    let footer_end = bytes.len() as u64 - TRAILER_LEN as u64;
    let at = trailer.index_offset;
    if !at.is_multiple_of(8) || at < header_len || at >= footer_end {
        return Err(format!(
            "the trailer points to offset {at}, where no index frame can be"
        ));
    }
    let frame = &bytes[at as usize..footer_end as usize];
    let h = FrameHeader::decode(frame).map_err(|e| format!("index frame: {}", String::from(e)))?;
    if h.kind != FrameKind::Index {
        return Err("the trailer points to a record frame".into());
    }
    if h.codec != Codec::None || !h.key.is_empty() || h.raw_len != h.stored_len || h.num_tokens != 0
    {
        return Err("index frame header has fields an index frame cannot have".into());
    }
    if at + h.frame_len() != footer_end {
        return Err("the index frame does not end where the trailer starts".into());
    }
    let payload = &frame[h.header_len() as usize..(h.header_len() + h.stored_len) as usize];
    if crc32c(payload) != h.payload_crc {
        return Err("index payload checksum mismatch".into());
    }
    let entries = decode_index(payload)?;
    if entries.len() as u64 != trailer.record_count {
        return Err(format!(
            "the trailer counts {} records, the index lists {}",
            trailer.record_count,
            entries.len()
        ));
    }
    check_entry_layout(&entries, header_len, at)?;
    Ok(entries)
}

/// The end of the frame an entry describes, if it does not overflow.
pub(crate) fn entry_frame_end(e: &IndexEntry) -> Option<u64> {
    let header = align8((FRAME_HEADER_LEN + e.key.len()) as u64);
    let payload = e.stored_len.checked_add(7)? & !7;
    e.frame_offset.checked_add(header)?.checked_add(payload)
}

/// Checks that the frames of `entries` lie in `[header_len, data_end)`, 8-aligned, in increasing
/// order and without overlapping, so that readers can slice the file by them without checks.
fn check_entry_layout(
    entries: &[IndexEntry],
    header_len: u64,
    data_end: u64,
) -> Result<(), String> {
    let mut free_from = header_len;
    for (i, e) in entries.iter().enumerate() {
        if e.frame_offset % 8 != 0 || e.frame_offset < free_from {
            return Err(format!(
                "index entry {i} ({:?}) puts its frame at offset {}, which is not after the previous one",
                e.key, e.frame_offset
            ));
        }
        match entry_frame_end(e) {
            Some(end) if end <= data_end => free_from = end,
            _ => {
                return Err(format!(
                    "index entry {i} ({:?}) describes a frame running past the index at {data_end}",
                    e.key
                ))
            }
        }
    }
    Ok(())
}
