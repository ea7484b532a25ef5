//! Shared by the writer tests: a small, strict reader of shards built directly on
//! `format`, `codec` and `blob` (independent of the crate's reader), and record builders.
#![allow(dead_code)]

use layertap_core::blob::TensorSpec;
use layertap_core::codec;
use layertap_core::format::{self, FileHeader, FrameHeader, FrameKind, IndexEntry, Trailer};
use layertap_core::writer::{IoMode, RecordInput, TensorInput, WriterConfig};
use layertap_core::Dtype;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A record read back.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadRecord {
    pub key: String,
    pub offset: u64,
    pub header: FrameHeader,
    pub metadata: BTreeMap<String, String>,
    pub tensors: Vec<(TensorSpec, Vec<u8>)>,
}

/// A shard read back.
#[derive(Debug)]
pub struct ReadShard {
    pub path: PathBuf,
    pub meta: serde_json::Value,
    pub records: Vec<ReadRecord>,
    /// The index, if the shard is complete.
    pub index: Option<Vec<IndexEntry>>,
    /// Bytes after the last valid frame of an open shard.
    pub torn_tail: u64,
}

/// Reads a shard strictly: every frame must be valid, every payload must decode, the index
/// (if any) must agree with the frames.
pub fn read_shard(path: &Path) -> ReadShard {
    let bytes = std::fs::read(path).unwrap();
    let (fh, header_len) = FileHeader::decode(&bytes).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let meta: serde_json::Value = serde_json::from_str(&fh.meta_json).unwrap();
    let mut pos = header_len as usize;
    let mut records = Vec::new();
    let mut index = None;
    let mut torn_tail = 0;
    while pos < bytes.len() {
        let h = match FrameHeader::decode(&bytes[pos..]) {
            Ok(h) => h,
            Err(format::FrameHeaderError::Truncated) => {
                torn_tail = (bytes.len() - pos) as u64;
                break;
            }
            Err(e) => panic!("{path:?}: bad frame at {pos}: {e:?}"),
        };
        let payload_at = pos + h.header_len() as usize;
        let stored = &bytes[payload_at..payload_at + h.stored_len as usize];
        assert_eq!(
            format::crc32c(stored),
            h.payload_crc,
            "{path:?}: payload crc at {pos}"
        );
        let pad = &bytes[payload_at + h.stored_len as usize..pos + h.frame_len() as usize];
        assert!(pad.iter().all(|&b| b == 0), "padding must be zero");
        if h.kind == FrameKind::Index {
            let entries = format::decode_index(stored).unwrap();
            let end = pos + h.frame_len() as usize;
            assert_eq!(
                end + format::TRAILER_LEN,
                bytes.len(),
                "trailer must end the file"
            );
            let t = Trailer::decode(&bytes[end..]).expect("valid trailer");
            assert_eq!(t.index_offset, pos as u64);
            assert_eq!(t.record_count, entries.len() as u64);
            index = Some(entries);
            break;
        }
        let codec::Decoded {
            blob: raw,
            header: bh,
        } = codec::decode(h.codec, stored, h.raw_len).unwrap();
        assert_eq!(
            bh.metadata.get("key"),
            Some(&h.key),
            "__metadata__.key must be the frame key"
        );
        let tensors = bh
            .tensors
            .iter()
            .map(|t| (t.spec.clone(), raw[t.range.clone()].to_vec()))
            .collect();
        records.push(ReadRecord {
            key: h.key.clone(),
            offset: pos as u64,
            metadata: bh.metadata,
            tensors,
            header: h.clone(),
        });
        pos += h.frame_len() as usize;
    }
    if let Some(entries) = &index {
        assert_eq!(entries.len(), records.len(), "index lists every record");
        for (e, r) in entries.iter().zip(&records) {
            assert_eq!(e.frame_offset, r.offset);
            assert!(e.matches(&r.header), "index entry agrees with frame {e:?}");
        }
    }
    ReadShard {
        path: path.to_path_buf(),
        meta,
        records,
        index,
        torn_tail,
    }
}

/// The shard files of a directory, sorted by name.
pub fn shard_paths(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "lts"))
        .collect();
    v.sort();
    v
}

/// Every shard of a directory, read strictly.
pub fn read_dir(dir: &Path) -> Vec<ReadShard> {
    shard_paths(dir).iter().map(|p| read_shard(p)).collect()
}

/// Every record of a directory, in dataset order.
pub fn read_records(dir: &Path) -> Vec<ReadRecord> {
    read_dir(dir).into_iter().flat_map(|s| s.records).collect()
}

/// Deterministic bytes.
pub fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// A record like the connector writes: bf16 hidden states `[tokens, 2, hidden]` and i64
/// token ids.
pub fn record(key: &str, tokens: u64, hidden: u64, seed: u64) -> RecordInput {
    let hs = TensorSpec {
        name: "hidden_states".into(),
        dtype: Dtype::BF16,
        shape: vec![tokens, 2, hidden],
    };
    let ids = TensorSpec {
        name: "token_ids".into(),
        dtype: Dtype::I64,
        shape: vec![tokens],
    };
    let hs_len = hs.byte_len().unwrap() as usize;
    RecordInput {
        key: key.into(),
        tensors: vec![
            TensorInput::new(hs, bytes(seed, hs_len)),
            TensorInput::new(ids, bytes(seed + 1, 8 * tokens as usize)),
        ],
        metadata: BTreeMap::from([("model".to_string(), "tiny".to_string())]),
        num_tokens: tokens as u32,
    }
}

/// The tensors of `record(key, tokens, hidden, seed)`, as read back.
pub fn record_tensors(tokens: u64, hidden: u64, seed: u64) -> Vec<(TensorSpec, Vec<u8>)> {
    record("k", tokens, hidden, seed)
        .tensors
        .into_iter()
        .map(|t| (t.spec.clone(), t.data.bytes().to_vec()))
        .collect()
}

/// Both I/O modes, with whether each is available here. io_uring unavailable is reported,
/// not hidden: tests print how many backends ran.
pub fn io_modes() -> Vec<IoMode> {
    let mut modes = vec![IoMode::Pwrite];
    let dir = tempfile::tempdir().unwrap();
    let cfg = WriterConfig {
        io: IoMode::Uring,
        ..Default::default()
    };
    match layertap_core::writer::ShardWriter::open(dir.path(), cfg) {
        Ok(_) => modes.push(IoMode::Uring),
        Err(e) => eprintln!("NOTE: io_uring unavailable here, only pwrite tested: {e}"),
    }
    modes
}

/// A config for tests: small batches, given io mode and codec.
pub fn config(io: IoMode, codec: codec::Codec) -> WriterConfig {
    WriterConfig {
        io,
        codec,
        level: 1,
        batch_bytes: 64 << 10,
        threads: Some(2),
        ..Default::default()
    }
}
