//! Byte layout of shards: file header, frame header, index entries and trailer, and the codec
//! ids frames carry, exactly as docs/FORMAT.md describes them. Pure encoding and decoding; no
//! I/O. What each codec does to a payload is in [`crate::codec`], which builds on this module.

use crate::error::{Error, Result};
use crate::options::{quoted, refused, Rule};

/// First bytes of every shard.
pub const FILE_MAGIC: [u8; 8] = *b"\x89LTAP\r\n\x1a";
/// Format version written and read.
pub const VERSION: u16 = 1;
/// First bytes of every frame.
pub const FRAME_MAGIC: [u8; 4] = *b"LTRF";
/// Last bytes of a complete shard.
pub const TRAILER_MAGIC: [u8; 8] = *b"LTAPTAIL";
/// Size of the fixed part of a frame header.
pub const FRAME_HEADER_LEN: usize = 48;
/// Size of the trailer.
pub const TRAILER_LEN: usize = 32;
/// Size of the fixed part of an index entry.
pub const INDEX_ENTRY_FIXED_LEN: usize = 40;
/// Size of the fixed part of the file header (before the metadata JSON).
pub const FILE_HEADER_FIXED_LEN: usize = 32;
/// Largest shard metadata a reader accepts.
pub const MAX_META_LEN: usize = 1 << 20;

/// CRC32C (Castagnoli) of `bytes`.
#[inline]
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(bytes)
}

/// Continues a CRC32C over more bytes: from the register the checksum `crc` was taken from
/// (the final xor, all ones, undone).
#[inline]
pub fn crc32c_append(crc: u32, bytes: &[u8]) -> u32 {
    let mut digest =
        crc_fast::Digest::new_with_init_state(crc_fast::CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    digest.update(bytes);
    digest.finalize() as u32
}

/// The CRC32C of `a`'s bytes followed by `b`'s, from their checksums and `b`'s length.
#[inline]
pub fn crc32c_combine(a: u32, b: u32, b_len: usize) -> u32 {
    crc_fast::checksum_combine(
        crc_fast::CrcAlgorithm::Crc32Iscsi,
        u64::from(a),
        u64::from(b),
        b_len as u64,
    ) as u32
}

/// `n` rounded up to a multiple of 8.
#[inline]
pub const fn align8(n: u64) -> u64 {
    (n + 7) & !7
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().unwrap())
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// The kind of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// A record.
    Record = 1,
    /// The shard's index.
    Index = 2,
}

impl FrameKind {
    fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(FrameKind::Record),
            2 => Some(FrameKind::Index),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Codec ids

/// How a record's payload is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codec {
    /// Stored as is.
    None,
    /// One zstd frame.
    Zstd,
    /// Byte-plane split of 2-byte tensors, then one zstd frame.
    Bp16Zstd,
    /// Floating tensors' top 9 bits Huffman-coded in context, the other bits stored.
    ExpHuf,
}

impl Codec {
    /// Every codec.
    pub const ALL: [Codec; 4] = [Codec::None, Codec::Zstd, Codec::Bp16Zstd, Codec::ExpHuf];

    /// The id stored in frame headers.
    pub fn id(self) -> u8 {
        match self {
            Codec::None => 0,
            Codec::Zstd => 1,
            Codec::Bp16Zstd => 2,
            Codec::ExpHuf => 3,
        }
    }

    /// The codec with stored id `id`.
    pub fn from_id(id: u8) -> Result<Codec> {
        Codec::ALL
            .into_iter()
            .find(|c| c.id() == id)
            .ok_or_else(|| Error::invalid(format!("unknown codec id {id}")))
    }

    /// The codec's name (`"none"`, `"zstd"`, `"bp16-zstd"`, `"exp-huf"`).
    pub fn name(self) -> &'static str {
        match self {
            Codec::None => "none",
            Codec::Zstd => "zstd",
            Codec::Bp16Zstd => "bp16-zstd",
            Codec::ExpHuf => "exp-huf",
        }
    }

    /// The codec named `name`; another name is an error of the writer option `codec`.
    pub fn from_name(name: &str) -> Result<Codec> {
        Codec::ALL
            .into_iter()
            .find(|c| c.name() == name)
            .ok_or_else(|| refused("codec", Rule::Codec, &quoted(name)))
    }
}

impl std::fmt::Display for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

// ---------------------------------------------------------------------------------------------
// File header

/// The file header of a shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileHeader {
    /// 16 random bytes identifying the shard.
    pub shard_id: [u8; 16],
    /// The shard metadata, a JSON object as UTF-8 text.
    pub meta_json: String,
}

impl FileHeader {
    /// Encodes the header, padding included. Its length is where the first frame starts.
    pub fn encode(&self) -> Vec<u8> {
        let meta = self.meta_json.as_bytes();
        let mut out = Vec::with_capacity(align8(36 + meta.len() as u64) as usize);
        out.extend_from_slice(&FILE_MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&(meta.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.shard_id);
        out.extend_from_slice(meta);
        let crc = crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out.resize(align8(out.len() as u64) as usize, 0);
        out
    }

    /// Decodes a header from the start of a file. Returns the header and its padded length.
    /// `Err(reason)` says why the bytes are not a shard header.
    pub fn decode(bytes: &[u8]) -> std::result::Result<(FileHeader, u64), String> {
        if bytes.len() < 8 || bytes[..8] != FILE_MAGIC {
            return Err("wrong magic bytes".into());
        }
        if bytes.len() < FILE_HEADER_FIXED_LEN + 4 {
            return Err(format!(
                "file is {} bytes long, too short for a header",
                bytes.len()
            ));
        }
        let version = u16_at(bytes, 8);
        if version != VERSION {
            return Err(format!(
                "format version {version}; this reader reads version {VERSION}"
            ));
        }
        let flags = u16_at(bytes, 10);
        if flags != 0 {
            return Err(format!("unknown header flags {flags:#x}"));
        }
        let meta_len = u32_at(bytes, 12) as usize;
        if meta_len > MAX_META_LEN {
            return Err(format!(
                "shard metadata of {meta_len} bytes is larger than {MAX_META_LEN}"
            ));
        }
        let crc_at = FILE_HEADER_FIXED_LEN + meta_len;
        if bytes.len() < crc_at + 4 {
            // A file a writer left inside its header is a torn empty shard, which the readers
            // tell apart before they say this: here the header was damaged or the file cut.
            return Err(format!(
                "its header's metadata length ({meta_len} bytes) runs past the end of the file: the header was damaged or the file cut (restore the shard from a copy; `layertap recover` leaves it)"
            ));
        }
        if crc32c(&bytes[..crc_at]) != u32_at(bytes, crc_at) {
            return Err("header checksum mismatch".into());
        }
        let meta_json = std::str::from_utf8(&bytes[FILE_HEADER_FIXED_LEN..crc_at])
            .map_err(|_| "shard metadata is not UTF-8".to_string())?
            .to_string();
        let shard_id = bytes[16..32].try_into().unwrap();
        Ok((
            FileHeader {
                shard_id,
                meta_json,
            },
            align8(crc_at as u64 + 4),
        ))
    }
}

// ---------------------------------------------------------------------------------------------
// Frames

/// The header of a frame, key included.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameHeader {
    /// Record or index.
    pub kind: FrameKind,
    /// How the payload is stored.
    pub codec: Codec,
    /// The record key (empty for the index).
    pub key: String,
    /// Payload length as stored.
    pub stored_len: u64,
    /// Payload length decoded.
    pub raw_len: u64,
    /// Tokens in the record.
    pub num_tokens: u32,
    /// CRC32C of the stored payload.
    pub payload_crc: u32,
}

/// Why a frame header at some offset is not valid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameHeaderError {
    /// Fewer bytes remain than the header needs (a torn tail).
    Truncated,
    /// The bytes are not a valid frame header.
    Invalid(String),
}

impl FrameHeader {
    /// Bytes from the frame start to the payload: `align8(48 + key_len)`.
    pub fn header_len(&self) -> u64 {
        align8((FRAME_HEADER_LEN + self.key.len()) as u64)
    }

    /// Total frame length, padding included.
    pub fn frame_len(&self) -> u64 {
        self.header_len() + align8(self.stored_len)
    }

    /// Encodes the header, key and padding: the bytes that precede the payload.
    pub fn encode(&self) -> Vec<u8> {
        let key = self.key.as_bytes();
        let mut out = Vec::with_capacity(self.header_len() as usize);
        out.extend_from_slice(&FRAME_MAGIC);
        out.push(self.kind as u8);
        out.push(self.codec.id());
        out.extend_from_slice(&(key.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.stored_len.to_le_bytes());
        out.extend_from_slice(&self.raw_len.to_le_bytes());
        out.extend_from_slice(&self.num_tokens.to_le_bytes());
        out.extend_from_slice(&self.payload_crc.to_le_bytes());
        out.extend_from_slice(&[0u8; 12]);
        let crc = crc32c_append(crc32c(&out), key);
        out.extend_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(key);
        out.resize(self.header_len() as usize, 0);
        out
    }

    /// Decodes the frame header at the start of `bytes` (which runs to the end of the file).
    /// Checks magic, kind, codec, header CRC and that the whole frame fits in `bytes`.
    pub fn decode(bytes: &[u8]) -> std::result::Result<FrameHeader, FrameHeaderError> {
        use FrameHeaderError::*;
        if bytes.len() < FRAME_HEADER_LEN {
            return Err(Truncated);
        }
        if bytes[..4] != FRAME_MAGIC {
            return Err(Invalid("wrong frame magic".into()));
        }
        let key_len = u16_at(bytes, 6) as usize;
        if bytes.len() < FRAME_HEADER_LEN + key_len {
            return Err(Truncated);
        }
        let key_bytes = &bytes[FRAME_HEADER_LEN..FRAME_HEADER_LEN + key_len];
        let want = crc32c_append(crc32c(&bytes[..44]), key_bytes);
        if want != u32_at(bytes, 44) {
            return Err(Invalid("frame header checksum mismatch".into()));
        }
        let kind = FrameKind::from_u8(bytes[4])
            .ok_or_else(|| Invalid(format!("unknown frame kind {}", bytes[4])))?;
        let codec = Codec::from_id(bytes[5]).map_err(|e| Invalid(e.to_string()))?;
        let key = std::str::from_utf8(key_bytes)
            .map_err(|_| Invalid("frame key is not UTF-8".into()))?
            .to_string();
        let header = FrameHeader {
            kind,
            codec,
            key,
            stored_len: u64_at(bytes, 8),
            raw_len: u64_at(bytes, 16),
            num_tokens: u32_at(bytes, 24),
            payload_crc: u32_at(bytes, 28),
        };
        // The whole frame, padding included, must be in the file.
        match header
            .header_len()
            .checked_add(align8(header.stored_len.min(u64::MAX - 7)))
        {
            Some(end) if end <= bytes.len() as u64 => Ok(header),
            // A frame longer than any file (its length overflows) runs past the end of this one
            // as well: the frame being written, as FORMAT.md's scan has it, not damage to
            // resynchronise past (the fuzzer found the readers disagreeing on this).
            Some(_) | None => Err(Truncated),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Index

/// One entry of a shard's index: where a record is and what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexEntry {
    /// Offset of the record's frame.
    pub frame_offset: u64,
    /// Payload length as stored.
    pub stored_len: u64,
    /// Payload length decoded.
    pub raw_len: u64,
    /// Tokens in the record.
    pub num_tokens: u32,
    /// CRC32C of the stored payload.
    pub payload_crc: u32,
    /// How the payload is stored.
    pub codec: Codec,
    /// The record key.
    pub key: String,
}

impl IndexEntry {
    /// The entry describing a record frame written at `frame_offset`.
    pub fn for_frame(frame_offset: u64, h: &FrameHeader) -> IndexEntry {
        IndexEntry {
            frame_offset,
            stored_len: h.stored_len,
            raw_len: h.raw_len,
            num_tokens: h.num_tokens,
            payload_crc: h.payload_crc,
            codec: h.codec,
            key: h.key.clone(),
        }
    }

    /// Offset of the record's payload.
    pub fn payload_offset(&self) -> u64 {
        self.frame_offset + align8((FRAME_HEADER_LEN + self.key.len()) as u64)
    }

    /// Length of the record's frame.
    pub fn frame_len(&self) -> u64 {
        align8((FRAME_HEADER_LEN + self.key.len()) as u64) + align8(self.stored_len)
    }

    /// Whether this entry agrees with the frame header found at its offset.
    pub fn matches(&self, h: &FrameHeader) -> bool {
        h.kind == FrameKind::Record
            && h.key == self.key
            && h.stored_len == self.stored_len
            && h.raw_len == self.raw_len
            && h.num_tokens == self.num_tokens
            && h.payload_crc == self.payload_crc
            && h.codec == self.codec
    }
}

/// Encodes an index payload.
pub fn encode_index(entries: &[IndexEntry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + entries.len() * 64);
    out.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    for e in entries {
        let start = out.len();
        out.extend_from_slice(&e.frame_offset.to_le_bytes());
        out.extend_from_slice(&e.stored_len.to_le_bytes());
        out.extend_from_slice(&e.raw_len.to_le_bytes());
        out.extend_from_slice(&e.num_tokens.to_le_bytes());
        out.extend_from_slice(&e.payload_crc.to_le_bytes());
        out.push(e.codec.id());
        out.push(0);
        out.extend_from_slice(&(e.key.len() as u16).to_le_bytes());
        out.extend_from_slice(&[0u8; 4]);
        out.extend_from_slice(e.key.as_bytes());
        out.resize(
            start + align8((INDEX_ENTRY_FIXED_LEN + e.key.len()) as u64) as usize,
            0,
        );
    }
    out
}

/// Decodes an index payload. `Err(reason)` says what is malformed.
pub fn decode_index(bytes: &[u8]) -> std::result::Result<Vec<IndexEntry>, String> {
    if bytes.len() < 8 {
        return Err("index shorter than its entry count".into());
    }
    let count = u64_at(bytes, 0);
    // Every entry takes at least 40 bytes, so a count larger than that is malformed; checking
    // first keeps a corrupt count from reserving a huge vector.
    if count > (bytes.len() as u64 - 8) / INDEX_ENTRY_FIXED_LEN as u64 {
        return Err(format!(
            "index claims {count} entries in {} bytes",
            bytes.len()
        ));
    }
    let mut entries = Vec::with_capacity(count as usize);
    let mut at = 8usize;
    for i in 0..count {
        if bytes.len() < at + INDEX_ENTRY_FIXED_LEN {
            return Err(format!("index entry {i} is cut off"));
        }
        let key_len = u16_at(bytes, at + 34) as usize;
        let key_at = at + INDEX_ENTRY_FIXED_LEN;
        if bytes.len() < key_at + key_len {
            return Err(format!("index entry {i} key is cut off"));
        }
        let codec = Codec::from_id(bytes[at + 32]).map_err(|e| format!("index entry {i}: {e}"))?;
        let key = std::str::from_utf8(&bytes[key_at..key_at + key_len])
            .map_err(|_| format!("index entry {i} key is not UTF-8"))?
            .to_string();
        entries.push(IndexEntry {
            frame_offset: u64_at(bytes, at),
            stored_len: u64_at(bytes, at + 8),
            raw_len: u64_at(bytes, at + 16),
            num_tokens: u32_at(bytes, at + 24),
            payload_crc: u32_at(bytes, at + 28),
            codec,
            key,
        });
        at += align8((INDEX_ENTRY_FIXED_LEN + key_len) as u64) as usize;
    }
    if at != bytes.len() {
        return Err(format!(
            "index has {} bytes after its last entry",
            bytes.len() - at
        ));
    }
    Ok(entries)
}

/// The index frame's header for an encoded index payload.
pub fn index_frame_header(payload: &[u8]) -> FrameHeader {
    FrameHeader {
        kind: FrameKind::Index,
        codec: Codec::None,
        key: String::new(),
        stored_len: payload.len() as u64,
        raw_len: payload.len() as u64,
        num_tokens: 0,
        payload_crc: crc32c(payload),
    }
}

// ---------------------------------------------------------------------------------------------
// Trailer

/// The last 32 bytes of a complete shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trailer {
    /// Offset of the index frame.
    pub index_offset: u64,
    /// Number of records in the index.
    pub record_count: u64,
    /// Damaged parts (corrupt records, damaged regions) that `recover` left out of the index
    /// when it completed the shard; 0 in a shard its writer completed.
    pub lost_in_recovery: u32,
}

impl Trailer {
    /// Encodes the trailer.
    pub fn encode(&self) -> [u8; TRAILER_LEN] {
        let mut out = [0u8; TRAILER_LEN];
        out[0..8].copy_from_slice(&self.index_offset.to_le_bytes());
        out[8..16].copy_from_slice(&self.record_count.to_le_bytes());
        out[16..20].copy_from_slice(&self.lost_in_recovery.to_le_bytes());
        let crc = crc32c(&out[..20]);
        out[20..24].copy_from_slice(&crc.to_le_bytes());
        out[24..32].copy_from_slice(&TRAILER_MAGIC);
        out
    }

    /// Decodes the last 32 bytes of a file, if they are a valid trailer.
    pub fn decode(bytes: &[u8]) -> Option<Trailer> {
        if bytes.len() != TRAILER_LEN || bytes[24..32] != TRAILER_MAGIC {
            return None;
        }
        if crc32c(&bytes[..20]) != u32_at(bytes, 20) {
            return None;
        }
        Some(Trailer {
            index_offset: u64_at(bytes, 0),
            record_count: u64_at(bytes, 8),
            lost_in_recovery: u32_at(bytes, 16),
        })
    }
}

/// The bytes a writer appends to close a shard whose records are `entries` and whose data ends
/// at `data_end`: the index frame (header, payload, padding) and the trailer.
pub fn encode_footer(entries: &[IndexEntry], data_end: u64) -> Vec<u8> {
    encode_recovered_footer(entries, data_end, 0)
}

/// [`encode_footer`] for a shard that `recover` completed, leaving `lost_in_recovery` damaged
/// parts out of its index.
pub fn encode_recovered_footer(
    entries: &[IndexEntry],
    data_end: u64,
    lost_in_recovery: u32,
) -> Vec<u8> {
    let payload = encode_index(entries);
    let header = index_frame_header(&payload);
    let mut out = header.encode();
    out.extend_from_slice(&payload);
    out.resize(header.frame_len() as usize, 0);
    out.extend_from_slice(
        &Trailer {
            index_offset: data_end,
            record_count: entries.len() as u64,
            lost_in_recovery,
        }
        .encode(),
    );
    out
}

impl From<FrameHeaderError> for String {
    fn from(e: FrameHeaderError) -> String {
        match e {
            FrameHeaderError::Truncated => "frame is cut off by the end of the file".into(),
            FrameHeaderError::Invalid(r) => r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }

    /// A checksum continued or combined over a split equals the whole's, for lengths on both
    /// sides of the folding loops' block sizes (and the empty piece).
    #[test]
    fn crc_append_and_combine_equal_the_whole() {
        let bytes: Vec<u8> = (0..20_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for n in [0, 1, 7, 8, 63, 64, 255, 256, 1000, 4096, 20_000] {
            let whole = crc32c(&bytes[..n]);
            for cut in [0, 1, n / 3, n / 2, n.saturating_sub(1), n] {
                let (a, b) = bytes[..n].split_at(cut.min(n));
                assert_eq!(
                    crc32c_append(crc32c(a), b),
                    whole,
                    "append, {n} bytes cut at {cut}"
                );
                assert_eq!(
                    crc32c_combine(crc32c(a), crc32c(b), b.len()),
                    whole,
                    "combine, {n} bytes cut at {cut}"
                );
            }
        }
        // Known value: RFC 3720's 32 bytes of zeros, in two pieces.
        assert_eq!(crc32c_append(crc32c(&[0; 5]), &[0; 27]), 0x8A91_36AA);
    }

    #[test]
    fn codec_ids_and_names() {
        for c in Codec::ALL {
            assert_eq!(Codec::from_name(c.name()).unwrap(), c);
            assert_eq!(Codec::from_id(c.id()).unwrap(), c);
        }
        let e = Codec::from_name("lz4").unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidOption {
                    option: "codec",
                    ..
                }
            ),
            "{e}"
        );
        assert!(Codec::from_id(9).is_err());
    }

    #[test]
    fn file_header_round_trip() {
        let h = FileHeader {
            shard_id: [7; 16],
            meta_json: r#"{"writer_id":"w"}"#.into(),
        };
        let bytes = h.encode();
        assert_eq!(bytes.len() % 8, 0);
        let (back, len) = FileHeader::decode(&bytes).unwrap();
        assert_eq!(back, h);
        assert_eq!(len, bytes.len() as u64);
        let mut bad = bytes;
        bad[20] ^= 1;
        assert!(FileHeader::decode(&bad).unwrap_err().contains("checksum"));
    }

    #[test]
    fn frame_header_round_trip_and_truncation() {
        let h = FrameHeader {
            kind: FrameKind::Record,
            codec: Codec::Zstd,
            key: "req-1".into(),
            stored_len: 13,
            raw_len: 99,
            num_tokens: 4,
            payload_crc: 0xdead_beef,
        };
        let mut bytes = h.encode();
        assert_eq!(bytes.len() as u64, h.header_len());
        bytes.extend_from_slice(&[0u8; 16]); // 13 payload bytes and 3 of padding
        assert_eq!(FrameHeader::decode(&bytes).unwrap(), h);
        assert_eq!(
            FrameHeader::decode(&bytes[..bytes.len() - 1]),
            Err(FrameHeaderError::Truncated)
        );
        bytes[50] ^= 0x40; // a bit of the key
        assert!(matches!(
            FrameHeader::decode(&bytes),
            Err(FrameHeaderError::Invalid(_))
        ));
    }

    #[test]
    fn index_round_trip() {
        let entries: Vec<IndexEntry> = (0..5)
            .map(|i| IndexEntry {
                frame_offset: 64 * i,
                stored_len: i,
                raw_len: 2 * i,
                num_tokens: i as u32,
                payload_crc: i as u32 * 7,
                codec: Codec::Bp16Zstd,
                key: "k".repeat(i as usize + 1),
            })
            .collect();
        let bytes = encode_index(&entries);
        assert_eq!(decode_index(&bytes).unwrap(), entries);
        assert!(decode_index(&bytes[..bytes.len() - 8]).is_err());
    }

    #[test]
    fn trailer_round_trip() {
        let t = Trailer {
            index_offset: 4096,
            record_count: 3,
            lost_in_recovery: 2,
        };
        let b = t.encode();
        assert_eq!(Trailer::decode(&b), Some(t));
        let mut bad = b;
        bad[3] ^= 1;
        assert_eq!(Trailer::decode(&bad), None);
    }
}
