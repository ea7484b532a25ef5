//! Builds shards byte by byte from the format module (independently of the writer), for the
//! reader and recovery tests.

#![allow(dead_code)]

use layertap_core::blob::{build_header, TensorSpec};
use layertap_core::codec::{Codec, Encoder};
use layertap_core::format::{encode_footer, FileHeader, FrameHeader, FrameKind, IndexEntry};
use layertap_core::Dtype;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One record to put in a shard.
#[derive(Debug, Clone)]
pub struct RecordSpec {
    pub key: String,
    pub codec: Codec,
    /// Tensors: name, dtype, shape, data.
    pub tensors: Vec<(String, Dtype, Vec<u64>, Vec<u8>)>,
    pub metadata: BTreeMap<String, String>,
}

impl RecordSpec {
    /// A record like the connector writes: BF16 hidden states `[tokens, 2, 8]` and I64 token ids.
    pub fn sample(key: &str, codec: Codec, tokens: u64, seed: u64) -> RecordSpec {
        let mut state = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut next = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as u8
        };
        // Smooth-ish bf16 values so that compression has something to do.
        let hidden: Vec<u8> = (0..tokens * 2 * 8)
            .flat_map(|_| [next(), 0x3f + (next() & 1)])
            .collect();
        let ids: Vec<u8> = (0..tokens)
            .flat_map(|t| (t * 7 + seed).to_le_bytes())
            .collect();
        RecordSpec {
            key: key.to_string(),
            codec,
            tensors: vec![
                (
                    "hidden_states".into(),
                    Dtype::BF16,
                    vec![tokens, 2, 8],
                    hidden,
                ),
                ("token_ids".into(), Dtype::I64, vec![tokens], ids),
            ],
            metadata: BTreeMap::from([("model".to_string(), "test".to_string())]),
        }
    }

    /// A record of one U8 tensor of `len` bytes.
    pub fn bytes(key: &str, codec: Codec, len: usize, seed: u8) -> RecordSpec {
        let data: Vec<u8> = (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect();
        RecordSpec {
            key: key.to_string(),
            codec,
            tensors: vec![("data".into(), Dtype::U8, vec![len as u64], data)],
            metadata: BTreeMap::new(),
        }
    }

    fn num_tokens(&self) -> u32 {
        self.tensors
            .iter()
            .find(|t| t.0 == "token_ids")
            .map(|t| t.2[0] as u32)
            .unwrap_or(0)
    }

    /// The safetensors blob (the decoded payload) and the stored payload.
    pub fn encode(&self) -> (Vec<u8>, Vec<u8>) {
        let specs: Vec<TensorSpec> = self
            .tensors
            .iter()
            .map(|(n, d, s, _)| TensorSpec {
                name: n.clone(),
                dtype: *d,
                shape: s.clone(),
            })
            .collect();
        let mut meta = self.metadata.clone();
        meta.insert("key".into(), self.key.clone());
        let header = build_header(&specs, &meta).unwrap();
        let mut pieces: Vec<&[u8]> = vec![&header];
        let mut two_byte = vec![false];
        for (_, d, _, data) in &self.tensors {
            pieces.push(data);
            two_byte.push(d.is_two_byte());
        }
        let raw = pieces.concat();
        let stored = Encoder::new(self.codec, 3)
            .unwrap()
            .encode(&pieces, &two_byte)
            .unwrap();
        (raw, stored)
    }
}

/// A shard built in memory, and what it holds.
#[derive(Debug, Clone)]
pub struct BuiltShard {
    pub bytes: Vec<u8>,
    pub header_len: u64,
    pub meta_json: String,
    /// Index entries of the records, in file order.
    pub entries: Vec<IndexEntry>,
    /// The decoded blob of each record.
    pub raws: Vec<Vec<u8>>,
    /// Where each record's frame header (key included) ends and its payload starts.
    pub payload_offsets: Vec<u64>,
    /// End of the record data (where the index frame starts when complete).
    pub data_end: u64,
}

impl BuiltShard {
    pub fn frame_end(&self, i: usize) -> u64 {
        self.entries[i].frame_offset + self.entries[i].frame_len()
    }
}

/// 94 bytes, so that the file header ends with 6 bytes of padding.
pub const META_JSON: &str = r#"{"writer_id":"test","shard_index":0,"created_unix_ms":1,"writer":"layertap-tests-x","user":{}}"#;

/// Builds a shard of `records`, with its footer when `complete`.
pub fn build_shard(records: &[RecordSpec], complete: bool) -> BuiltShard {
    let mut bytes = FileHeader {
        shard_id: [0x5a; 16],
        meta_json: META_JSON.into(),
    }
    .encode();
    let header_len = bytes.len() as u64;
    let mut entries = Vec::new();
    let mut raws = Vec::new();
    let mut payload_offsets = Vec::new();
    for r in records {
        let (raw, stored) = r.encode();
        let h = FrameHeader {
            kind: FrameKind::Record,
            codec: r.codec,
            key: r.key.clone(),
            stored_len: stored.len() as u64,
            raw_len: raw.len() as u64,
            num_tokens: r.num_tokens(),
            payload_crc: layertap_core::format::crc32c(&stored),
        };
        let at = bytes.len() as u64;
        entries.push(IndexEntry::for_frame(at, &h));
        bytes.extend_from_slice(&h.encode());
        payload_offsets.push(bytes.len() as u64);
        bytes.extend_from_slice(&stored);
        bytes.resize((at + h.frame_len()) as usize, 0);
        raws.push(raw);
    }
    let data_end = bytes.len() as u64;
    if complete {
        bytes.extend_from_slice(&encode_footer(&entries, data_end));
    }
    BuiltShard {
        bytes,
        header_len,
        meta_json: META_JSON.into(),
        entries,
        raws,
        payload_offsets,
        data_end,
    }
}

/// A few records of every codec, one of them larger than the private-mapping threshold.
pub fn mixed_records() -> Vec<RecordSpec> {
    vec![
        RecordSpec::sample("req-0", Codec::None, 3, 0),
        RecordSpec::sample("req-1", Codec::Zstd, 5, 1),
        RecordSpec::sample("req-2", Codec::Bp16Zstd, 4, 2),
        RecordSpec::bytes("big", Codec::None, 100_000, 3),
        RecordSpec::sample("req-4", Codec::None, 1, 4),
    ]
}

/// Writes `bytes` to `name` in `dir` and returns the path.
pub fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}
