//! The shard reader (docs/FORMAT.md, "Reading"): memory-maps a shard, takes its records from the
//! index of a complete shard or by scanning an open one, and reads records with every check the
//! format asks for.
//!
//! Shards are append-only, and open shards may still be growing: a reader sees the file as it was
//! when opened (its length then) and never looks past it. Bytes a writer has not finished are
//! reported as a torn tail, never returned.

mod batch;
mod footer;
mod lock;
mod payload;
mod place;
mod problem;
mod record;
mod scan;
mod torn;

pub use batch::{read_batch, read_stored_batch, BatchRead, StoredRead};
pub use lock::is_being_written;
pub(crate) use lock::lock_exclusive_now;
pub use payload::{decode_payload, read_payload, PayloadInfo};
pub use place::{decode_into, decode_placed, Placed, Scratch};
pub use problem::Problem;
pub use record::{Record, RecordBytes, MAP_MIN_BYTES};
pub use torn::{is_torn_empty, TORN_EMPTY_REASON};

use crate::blob::{self, BlobHeader};
use crate::codec::{self, Codec};
use crate::error::{Error, Result};
use crate::format::{FileHeader, FrameHeader, IndexEntry};
use footer::Footer;
use std::borrow::Cow;
use std::fs::File;
use std::path::{Path, PathBuf};

/// A memory-mapped shard, open for reading.
pub struct ShardReader {
    path: PathBuf,
    file: File,
    /// The whole file as long as it was when opened (read-only, shared).
    map: memmap2::Mmap,
    header: FileHeader,
    header_len: u64,
    complete: bool,
    entries: Vec<IndexEntry>,
    problems: Vec<Problem>,
    data_end: u64,
    torn_tail_bytes: u64,
    index_unusable: bool,
    lost_in_recovery: u32,
}

impl std::fmt::Debug for ShardReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardReader")
            .field("path", &self.path)
            .field("complete", &self.complete)
            .field("records", &self.entries.len())
            .field("problems", &self.problems)
            .finish_non_exhaustive()
    }
}

impl ShardReader {
    /// Opens a shard: checks its file header, then uses its index if the shard is complete, or
    /// scans its frames if it is open (or its index is unusable, which is reported as a
    /// [`Problem::BadIndex`]). A file that is not a shard is [`Error::NotAShard`].
    pub fn open(path: impl AsRef<Path>) -> Result<ShardReader> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| Error::io(&path, "open", e))?;
        ShardReader::from_file(path, file)
    }

    /// Opens the shard `file`, which was opened from `path`.
    pub(crate) fn from_file(path: PathBuf, file: File) -> Result<ShardReader> {
        let meta = file.metadata().map_err(|e| Error::io(&path, "stat", e))?;
        if !meta.is_file() {
            return Err(Error::not_a_shard(&path, "not a regular file"));
        }
        let len = usize::try_from(meta.len())
            .map_err(|_| Error::not_a_shard(&path, "file too large to map"))?;
        if len == 0 {
            return Err(Error::not_a_shard(&path, TORN_EMPTY_REASON));
        }
        // SAFETY: the mapping is owned by the reader and outlives every slice of it we hand out
        // (they borrow the reader). It is read-only; shards are append-only, so layertap never
        // rewrites the bytes below the length mapped here. Bytes a writer is still writing (the
        // torn tail) are only compared against checksums, never trusted, and another program
        // changing the file could at worst make checks fail. Truncating a mapped file below the
        // mapped length makes accesses past the new end fault (SIGBUS); `recover` only cuts bytes
        // after the last valid frame, which readers touch only while opening.
        let map = unsafe { memmap2::MmapOptions::new().len(len).map(&file) }
            .map_err(|e| Error::io(&path, "mmap", e))?;
        let (header, header_len) = FileHeader::decode(&map).map_err(|reason| {
            let reason = if is_torn_empty(&map) {
                TORN_EMPTY_REASON.to_string()
            } else {
                reason
            };
            Error::not_a_shard(&path, reason)
        })?;
        match crate::json_text::parse(header.meta_json.as_bytes()) {
            Ok(serde_json::Value::Object(_)) => {}
            Ok(_) => {
                return Err(Error::not_a_shard(
                    &path,
                    "the shard metadata is not a JSON object",
                ))
            }
            Err(e) => {
                return Err(Error::not_a_shard(
                    &path,
                    format!("the shard metadata is not JSON within FORMAT.md's limits: {e}"),
                ))
            }
        }
        let mut reader = ShardReader {
            path,
            file,
            map,
            header,
            header_len,
            complete: false,
            entries: Vec::new(),
            problems: Vec::new(),
            data_end: header_len,
            torn_tail_bytes: 0,
            index_unusable: false,
            lost_in_recovery: 0,
        };
        reader.find_records();
        Ok(reader)
    }

    /// Takes the records from the index of a complete shard, else from a scan of its frames
    /// (docs/FORMAT.md, "Reading" steps 2 and 3), noting what is wrong on the way.
    fn find_records(&mut self) {
        let footer_at = match footer::read_footer(&self.map, self.header_len) {
            Footer::Valid {
                index_offset,
                entries,
                lost_in_recovery,
            } => {
                self.complete = true;
                self.entries = entries;
                self.data_end = index_offset;
                self.lost_in_recovery = lost_in_recovery;
                return;
            }
            Footer::Bad {
                index_offset,
                reason,
            } => {
                self.index_unusable = true;
                self.problems.push(Problem::BadIndex {
                    offset: Some(index_offset),
                    reason,
                });
                Some(index_offset)
            }
            Footer::Absent => None,
        };
        let scanned = scan::scan(&self.map, self.header_len);
        self.problems.extend(scanned.problems);
        // Behind a valid trailer, the footer (however damaged) is not a torn tail.
        let tail_end = match footer_at {
            Some(at) if at >= scanned.data_end && at <= scanned.stop => at,
            _ => scanned.stop,
        };
        // A file cut inside the header's padding ends before `header_len`, where data_end is.
        self.torn_tail_bytes = tail_end.saturating_sub(scanned.data_end);
        if self.torn_tail_bytes > 0 {
            self.problems.push(Problem::TornTail {
                offset: scanned.data_end,
                len: self.torn_tail_bytes,
            });
        }
        if scanned.stopped_at_index && footer_at.is_none() {
            self.index_unusable = true;
            self.problems.push(Problem::BadIndex {
                offset: Some(scanned.stop),
                reason: "an index frame without a valid trailer after it (the writer died while closing the shard?)"
                    .into(),
            });
        }
        self.entries = scanned.entries;
        self.data_end = scanned.data_end;
    }

    /// The path the shard was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the shard is complete (its index was used) rather than open (scanned).
    pub fn is_complete(&self) -> bool {
        self.complete
    }

    /// The shard metadata, a JSON object as text.
    pub fn meta_json(&self) -> &str {
        &self.header.meta_json
    }

    /// The shard's 16 random identifying bytes.
    pub fn shard_id(&self) -> [u8; 16] {
        self.header.shard_id
    }

    /// Length of the file header, padding included: where the first frame starts.
    pub fn header_len(&self) -> u64 {
        self.header_len
    }

    /// Length of the file when it was opened (all the reader ever looks at).
    pub fn file_len(&self) -> u64 {
        self.map.len() as u64
    }

    /// The end of the record data: the end of the last valid record frame of an open shard, the
    /// index frame's offset of a complete one.
    pub fn data_end(&self) -> u64 {
        self.data_end
    }

    /// The records, in file order.
    pub fn entries(&self) -> &[IndexEntry] {
        &self.entries
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the shard has no records.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// What was found wrong while opening: an unusable index, corrupt records, damaged regions,
    /// the torn tail. Empty for a complete shard (whose payloads are checked only when read).
    pub fn problems(&self) -> &[Problem] {
        &self.problems
    }

    /// Bytes after the last valid frame of an open shard (0 for a complete one).
    pub fn torn_tail_bytes(&self) -> u64 {
        self.torn_tail_bytes
    }

    /// Whether the shard had a footer that could not be used, so that it was scanned instead.
    pub fn index_unusable(&self) -> bool {
        self.index_unusable
    }

    /// How many damaged parts (corrupt records, damaged regions) `recover` left out of the index
    /// of this complete shard, as its trailer says (0 for an open shard, and for a shard its
    /// writer completed). Those bytes are still in the file, between the indexed frames.
    pub fn lost_in_recovery(&self) -> u32 {
        self.lost_in_recovery
    }

    /// Whether a writer holds the shard's lock now (see [`is_being_written`]).
    pub fn is_being_written(&self) -> Result<bool> {
        is_being_written(&self.path)
    }

    fn entry(&self, i: usize) -> Result<&IndexEntry> {
        self.entries.get(i).ok_or_else(|| {
            Error::NotFound(format!(
                "#{i} in {}: the shard has {} records",
                self.path.display(),
                self.entries.len()
            ))
        })
    }

    fn corrupt(&self, e: &IndexEntry, reason: impl Into<String>) -> Error {
        Error::CorruptRecord {
            path: self.path.clone(),
            offset: e.frame_offset,
            key: Some(e.key.clone()),
            reason: reason.into(),
        }
    }

    /// The stored payload of a record, as the entry places it (inside the file, as checked when
    /// the entries were made).
    fn stored(&self, e: &IndexEntry) -> Result<&[u8]> {
        let start = e.payload_offset() as usize;
        self.map
            .get(start..start + e.stored_len as usize)
            .ok_or_else(|| self.corrupt(e, "payload lies outside the file"))
    }

    fn check_crc(&self, e: &IndexEntry, stored: &[u8]) -> Result<()> {
        payload::check_crc(stored, e.payload_crc).map_err(|reason| self.corrupt(e, reason))
    }

    /// Decodes a compressed payload; returns the blob and its header, parsed once by the codec
    /// and checked to name the record's key.
    fn decode(&self, e: &IndexEntry, stored: &[u8]) -> Result<(Vec<u8>, BlobHeader)> {
        let info = PayloadInfo {
            key: &e.key,
            codec: e.codec,
            raw_len: e.raw_len,
            payload_crc: None,
        };
        payload::decode_compressed(stored, &info).map_err(|reason| self.corrupt(e, reason))
    }

    /// Parses the header of a record's blob stored as is (codec `none`) and checks it.
    fn parse_blob(&self, e: &IndexEntry, raw: &[u8]) -> Result<BlobHeader> {
        codec::check_raw_len(raw.len(), e.raw_len).map_err(|reason| self.corrupt(e, reason))?;
        let header = blob::parse_header(raw).map_err(|reason| self.corrupt(e, reason))?;
        payload::check_key(&e.key, header).map_err(|reason| self.corrupt(e, reason))
    }

    /// The decoded payload (a safetensors blob) of record `i`: for codec `none` a slice of the
    /// mapping (no copy), else a decoded buffer. With `verify`, the stored payload is checked
    /// against its checksum first; the blob's header and key are always checked. Any failure is
    /// an [`Error::CorruptRecord`] naming the shard, offset and key.
    pub fn raw(&self, i: usize, verify: bool) -> Result<Cow<'_, [u8]>> {
        let e = self.entry(i)?;
        let stored = self.stored(e)?;
        if verify {
            self.check_crc(e, stored)?;
        }
        match e.codec {
            Codec::None => {
                self.parse_blob(e, stored)?;
                Ok(Cow::Borrowed(stored))
            }
            _ => Ok(Cow::Owned(self.decode(e, stored)?.0)),
        }
    }

    /// Reads record `i` into bytes the caller owns and may modify (see [`RecordBytes`]): for
    /// codec `none`, records of at least [`MAP_MIN_BYTES`] get a private copy-on-write mapping of
    /// their own (no copy), smaller ones a copy; compressed ones are decoded into memory that a
    /// dropped record or batch left ([`RecordBytes::recycled`]; a loop over records then
    /// faults in no new pages). Checks as [`ShardReader::raw`] does.
    pub fn read(&self, i: usize, verify: bool) -> Result<Record> {
        let e = self.entry(i)?;
        let stored = self.stored(e)?;
        // The checksum is checked on the reader's mapping, whose pages stay mapped from one read
        // to the next; a private mapping of the same (append-only) bytes is faulted in only
        // where the caller touches it.
        if verify {
            self.check_crc(e, stored)?;
        }
        let (bytes, header) = match e.codec {
            Codec::None => {
                let bytes = self.private_copy(e, stored);
                let header = self.parse_blob(e, bytes.as_slice())?;
                (bytes, header)
            }
            _ => {
                let info = PayloadInfo {
                    key: &e.key,
                    codec: e.codec,
                    raw_len: e.raw_len,
                    payload_crc: None, // checked above
                };
                payload::decode_owned(stored, &info).map_err(|reason| self.corrupt(e, reason))?
            }
        };
        Ok(Record {
            key: e.key.clone(),
            offset: e.frame_offset,
            header,
            bytes,
        })
    }

    /// The stored bytes of a codec-`none` record as bytes of the caller's own: a private mapping
    /// when large enough (and the kernel grants one), else a copy.
    fn private_copy(&self, e: &IndexEntry, stored: &[u8]) -> RecordBytes {
        if e.stored_len >= MAP_MIN_BYTES {
            // SAFETY: the mapping is private (copy-on-write): writes to it never reach the file,
            // and RecordBytes owns it for as long as anyone uses it. It covers the payload, which
            // lies inside the file's length at open; see `from_file` on files changing under a
            // mapping.
            let mapped = unsafe {
                memmap2::MmapOptions::new()
                    .offset(e.payload_offset())
                    .len(stored.len())
                    .map_copy(&self.file)
            };
            if let Ok(map) = mapped {
                return RecordBytes::from_mapping(map);
            }
            // Out of mappings or address space: a copy still works.
        }
        RecordBytes::from_vec(stored.to_vec())
    }

    /// Reads record `i` as [`decode_placed`] decodes it: the data of its tensor `name` straight
    /// into the start of `dst` when it fits there (a padded batch's row, zeros after it), the
    /// rest into a buffer of its own. Checks as [`ShardReader::read`] does; `scratch` is the calling thread's.
    pub fn read_placed(
        &self,
        i: usize,
        verify: bool,
        name: &str,
        dst: &mut [u8],
        scratch: &mut Scratch,
    ) -> Result<Placed> {
        let e = self.entry(i)?;
        let stored = self.stored(e)?;
        let info = PayloadInfo {
            key: &e.key,
            codec: e.codec,
            raw_len: e.raw_len,
            payload_crc: verify.then_some(e.payload_crc),
        };
        decode_placed(stored, &info, name, dst, scratch).map_err(|r| self.corrupt(e, r))
    }

    /// Copies record `i`'s stored payload, as the shard holds it (not decoded), into `dst`, which
    /// must be exactly its `stored_len` bytes long: for a decoder elsewhere, such as the GPU
    /// decoder's pinned staging buffer. With `verify` its checksum is checked as it is copied
    /// (a piece at a time, while the piece is still in the cache); `dst` then holds the bytes
    /// even when they do not match. Errors as [`ShardReader::raw`], and `InvalidInput` for a
    /// `dst` of another length.
    pub fn read_stored(&self, i: usize, verify: bool, dst: &mut [u8]) -> Result<()> {
        let e = self.entry(i)?;
        if dst.len() as u64 != e.stored_len {
            return Err(Error::InvalidInput(format!(
                "record {:?} of {} holds {} stored bytes, not {}: give it a buffer of its stored_len",
                e.key,
                self.path.display(),
                e.stored_len,
                dst.len()
            )));
        }
        // Read from the file, not copied from the mapping: the kernel copies from its page
        // cache without faulting the mapping's pages in. The range lies inside the file as it
        // was when opened (`stored` checks), and shards are append-only, so the bytes are the
        // mapping's.
        self.stored(e)?;
        let at = e.payload_offset();
        /// Read, then checksummed while in the cache: a piece well under L2's size.
        const PIECE: usize = 256 << 10;
        let mut crc = 0;
        for (n, piece) in dst.chunks_mut(PIECE).enumerate() {
            std::os::unix::fs::FileExt::read_exact_at(&self.file, piece, at + (n * PIECE) as u64)
                .map_err(|err| self.corrupt(e, format!("cannot read the payload: {err}")))?;
            if verify {
                crc = crate::format::crc32c_append(crc, piece);
            }
        }
        if !verify {
            return Ok(());
        }
        if crc != e.payload_crc {
            return Err(self.corrupt(e, payload::crc_mismatch(e.payload_crc, crc)));
        }
        Ok(())
    }

    /// Asks the kernel to read record `i`'s stored bytes into the page cache in the background
    /// (`MADV_WILLNEED`), so that a batch's later records are read from the disk while its first
    /// ones decode. Only advice: a record out of range, or a kernel that declines, changes
    /// nothing.
    pub fn will_need(&self, i: usize) {
        if let Some(e) = self.entries.get(i) {
            let _ = self.map.advise_range(
                memmap2::Advice::WillNeed,
                e.payload_offset() as usize,
                e.stored_len as usize,
            );
        }
    }

    /// Maps record `i`'s stored bytes into this process's page tables at once
    /// (`MADV_POPULATE_READ`), waiting for those still on the disk, instead of one page fault
    /// for every few pages as the decoder reads them. Only advice, as [`ShardReader::will_need`].
    pub fn populate(&self, i: usize) {
        if let Some(e) = self.entries.get(i) {
            let _ = self.map.advise_range(
                memmap2::Advice::PopulateRead,
                e.payload_offset() as usize,
                e.stored_len as usize,
            );
        }
    }

    /// Checks record `i` fully: the frame header at its offset decodes and agrees with its entry
    /// (which for a complete shard comes from the index), the payload matches its checksum,
    /// decodes to `raw_len` bytes, and is a safetensors blob whose key is the record's.
    pub fn check(&self, i: usize) -> Result<()> {
        let e = self.entry(i)?;
        let frame = self.map.get(e.frame_offset as usize..).unwrap_or(&[]);
        let h = FrameHeader::decode(frame)
            .map_err(|err| self.corrupt(e, format!("frame header: {}", String::from(err))))?;
        if !e.matches(&h) {
            return Err(self.corrupt(
                e,
                format!("the frame header disagrees with the index: {h:?}"),
            ));
        }
        self.raw(i, true).map(drop)
    }
}
