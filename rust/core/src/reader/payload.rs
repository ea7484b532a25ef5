//! One record decoded from its stored payload alone, as a frame holds it (docs/FORMAT.md,
//! "Reading", step 4): what readers that find a record's bytes elsewhere than in a mapped shard
//! use (a shard still being written, read by `layertap.follow`; an object of Mooncake Store).
//! [`ShardReader`](super::ShardReader) decodes through the same checks.

use super::place::decode_into;
use super::record::{RecordBytes, MAP_MIN_BYTES};
use crate::blob::BlobHeader;
use crate::codec::{self, Codec};
use crate::format::{crc32c, crc32c_combine};
use crate::parallel::in_parts;

/// How far zstd can expand its input: a block of at most 128 KiB takes at least 4 bytes stored
/// (a 3-byte block header and one byte of an RLE block). A record whose `raw_len` is larger than
/// this many times its `stored_len` cannot be genuine, and is rejected before anything is
/// allocated for it.
pub(crate) const ZSTD_MAX_RATIO: u64 = 32 << 10;

/// What a frame says of its payload.
#[derive(Debug, Clone, Copy)]
pub struct PayloadInfo<'a> {
    /// The record key, which the blob's `__metadata__` must name.
    pub key: &'a str,
    /// How the payload is stored.
    pub codec: Codec,
    /// The decoded blob's length.
    pub raw_len: u64,
    /// The stored payload's CRC-32C, or `None` not to check it.
    pub payload_crc: Option<u32>,
}

/// `Err(reason)` when `stored` does not match the checksum `want`.
pub(crate) fn check_crc(stored: &[u8], want: u32) -> Result<(), String> {
    check_crc_on(stored, want, 1)
}

/// A checksum piece a thread takes at least: chosen as some 20 us of work with the crc32
/// instruction, about as long as starting a thread; crc-fast's folding (`529a388`) does it in
/// about 5 us here, so larger pieces may pay better (not measured; reader_batch.rs checks the
/// combining on a `[512, 4, 256]` bf16 record split at this size).
const CRC_PIECE: usize = 1 << 18;

/// [`check_crc`] on up to `threads` threads (the caller's among them): the payload in pieces of
/// at least [`CRC_PIECE`] bytes, their checksums combined.
pub(crate) fn check_crc_on(stored: &[u8], want: u32, threads: usize) -> Result<(), String> {
    let parts = threads.min(stored.len() / CRC_PIECE).max(1);
    let crc = if parts == 1 {
        crc32c(stored)
    } else {
        let mut pieces: Vec<(&[u8], u32)> = stored
            .chunks(stored.len().div_ceil(parts))
            .map(|p| (p, 0))
            .collect();
        in_parts(&mut pieces, 1, |(p, crc)| *crc = crc32c(p));
        pieces[1..]
            .iter()
            .fold(pieces[0].1, |a, &(p, b)| crc32c_combine(a, b, p.len()))
    };
    if crc != want {
        return Err(crc_mismatch(want, crc));
    }
    Ok(())
}

/// What a payload whose checksum is `got` where its frame says `want` is told.
pub(crate) fn crc_mismatch(want: u32, got: u32) -> String {
    format!("payload checksum mismatch (frame says {want:#010x}, payload has {got:#010x})")
}

/// Checks that a blob's `__metadata__["key"]` is `key`.
pub(crate) fn check_key(key: &str, header: BlobHeader) -> Result<BlobHeader, String> {
    match header.metadata.get("key") {
        Some(k) if k == key => Ok(header),
        Some(k) => Err(format!("the payload's __metadata__ names key {k:?}")),
        None => Err("the payload's __metadata__ has no key".to_string()),
    }
}

/// `Err(reason)` when `raw_len` is more than `stored_len` stored bytes can decode to (see
/// [`ZSTD_MAX_RATIO`]): checked before anything is allocated for the record.
pub(crate) fn check_ratio(stored_len: usize, raw_len: u64) -> Result<(), String> {
    if raw_len > (stored_len as u64).saturating_mul(ZSTD_MAX_RATIO) {
        return Err(format!(
            "raw length {raw_len} is more than {stored_len} stored bytes can decode to"
        ));
    }
    Ok(())
}

/// Decodes a compressed payload (any codec but `none`) into a new `Vec`: the blob and its
/// header, checked to name the record's key.
pub(crate) fn decode_compressed(
    stored: &[u8],
    info: &PayloadInfo<'_>,
) -> Result<(Vec<u8>, BlobHeader), String> {
    check_ratio(stored.len(), info.raw_len)?;
    let decoded = codec::decode(info.codec, stored, info.raw_len)?;
    Ok((decoded.blob, check_key(info.key, decoded.header)?))
}

/// Decodes a compressed payload (with the checks of [`decode_payload`]) into bytes of the
/// caller's own: for a record of at least [`MAP_MIN_BYTES`], memory that a dropped record or
/// batch left ([`RecordBytes::recycled`]: its pages faulted in already; every byte is
/// written), else new memory (cheap from the heap, and the kept pieces stay for large records).
pub(crate) fn decode_owned(
    stored: &[u8],
    info: &PayloadInfo<'_>,
) -> Result<(RecordBytes, BlobHeader), String> {
    check_ratio(stored.len(), info.raw_len)?;
    let mut bytes = owned_memory(info.raw_len)?;
    let header = super::batch::with_scratch(|scratch| {
        decode_into(stored, info, bytes.as_mut_slice(), scratch)
    })?;
    Ok((bytes, header))
}

/// `len` bytes of the caller's own to decode or copy a record into: for a record of at least
/// [`MAP_MIN_BYTES`], memory that a dropped record or batch left ([`RecordBytes::recycled`]),
/// else new memory.
fn owned_memory(len: u64) -> Result<RecordBytes, String> {
    let n = usize::try_from(len).map_err(|_| "raw length too large".to_string())?;
    let memory = if len < MAP_MIN_BYTES {
        Some(RecordBytes::from_vec(vec![0; n]))
    } else {
        RecordBytes::recycled(n)
    };
    memory.ok_or_else(|| format!("cannot allocate {n} bytes to decode the payload into"))
}

/// The record whose stored payload is `stored`: checked against its checksum (unless
/// `info.payload_crc` is `None`), decoded, its blob's header parsed and its key checked. Returns
/// the blob (a copy for codec `none`) and its header; `Err(reason)` says what is wrong, for the
/// caller to report with where the record lies. The blob is decoded as
/// [`ShardReader::read`](super::ShardReader::read) decodes: into memory a dropped record left
/// when it is large, with the thread's reusable buffers. (Into new memory, a `fetch` of an
/// 11 MB bf16-zstd record from Mooncake Store faulted in 21 MB of pages, 5,352 faults, and took
/// 22 ms of CPU; 10.5 ms this way, none faulted: 2-core machine, 2026-12-06.)
pub fn decode_payload(
    stored: &[u8],
    info: &PayloadInfo<'_>,
) -> Result<(RecordBytes, BlobHeader), String> {
    if let Some(want) = info.payload_crc {
        check_crc(stored, want)?;
    }
    let checked = PayloadInfo {
        payload_crc: None, // checked above
        ..*info
    };
    match info.codec {
        Codec::None => {
            codec::check_raw_len(stored.len(), info.raw_len)?;
            let header = check_key(info.key, crate::blob::parse_header(stored)?)?;
            let mut bytes = owned_memory(info.raw_len)?;
            bytes.as_mut_slice().copy_from_slice(stored);
            Ok((bytes, header))
        }
        _ => decode_owned(stored, &checked),
    }
}

/// The record whose stored payload lies at `payload_offset` of `file` (`stored_len` bytes), read
/// as [`ShardReader::read`](super::ShardReader::read) reads it, with the checks of
/// [`decode_payload`]: for a shard still being written (`layertap.follow`), whose frames a
/// caller found without a [`ShardReader`](super::ShardReader). Codec `none` records of at least
/// [`MAP_MIN_BYTES`] get a private copy-on-write mapping of their own (no copy); compressed ones
/// are decoded from a read-only mapping of the payload. `Err(reason)` when the file ends before
/// the payload does, or as [`decode_payload`].
pub fn read_payload(
    file: &std::fs::File,
    payload_offset: u64,
    stored_len: u64,
    info: &PayloadInfo<'_>,
) -> Result<(RecordBytes, BlobHeader), String> {
    let file_len = file
        .metadata()
        .map_err(|e| format!("cannot read the file's length: {e}"))?
        .len();
    if payload_offset.saturating_add(stored_len) > file_len {
        return Err("payload is cut off by the end of the file".to_string());
    }
    let len = usize::try_from(stored_len).map_err(|_| "stored length too large".to_string())?;
    if stored_len < MAP_MIN_BYTES {
        let mut stored = vec![0u8; len];
        std::os::unix::fs::FileExt::read_exact_at(file, &mut stored, payload_offset)
            .map_err(|e| format!("cannot read the payload: {e}"))?;
        return decode_payload(&stored, info);
    }
    // SAFETY: the range lies inside the file (checked above); shards are append-only, so the
    // bytes under the mapping do not change (see `ShardReader::from_file` on files changing
    // under a mapping). The private mapping is copy-on-write: writes never reach the file.
    let map = unsafe {
        memmap2::MmapOptions::new()
            .offset(payload_offset)
            .len(len)
            .map_copy(file)
    }
    .map_err(|e| format!("cannot map the payload: {e}"))?;
    if let Some(want) = info.payload_crc {
        check_crc(&map, want)?;
    }
    match info.codec {
        Codec::None => {
            codec::check_raw_len(map.len(), info.raw_len)?;
            let header = check_key(info.key, crate::blob::parse_header(&map)?)?;
            Ok((RecordBytes::from_mapping(map), header))
        }
        _ => {
            let checked = PayloadInfo {
                payload_crc: None, // checked above
                ..*info
            };
            decode_owned(&map, &checked)
        }
    }
}
