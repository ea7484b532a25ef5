//! Records whose floating tensors come already encoded as exp-huf blocks (the GPU encoder's
//! path, `TensorInput::exphuf_block`): stored byte for byte as the writer's own exp-huf
//! encoding stores them, and every block or combination that a reader would not decode to
//! the record given is refused at submission.

mod writer_support;

use layertap_core::blob::TensorSpec;
use layertap_core::format::FrameHeader;
use layertap_core::writer::{IoMode, RecordInput, ShardWriter, TensorInput, WriterConfig};
use layertap_core::{Codec, Dtype, Error};
use std::collections::BTreeMap;
use std::path::Path;
use writer_support::*;

/// bf16 values shaped like activations (a bell around 0, scale ~1): exp-huf codes them, where
/// uniform random bytes would fall back to raw blocks.
fn activations(seed: u64, n: usize) -> Vec<u8> {
    let noise = bytes(seed, 4 * n);
    noise
        .chunks_exact(4)
        .flat_map(|c| {
            let sum: f32 = c.iter().map(|&b| b as f32 / 255.0).sum::<f32>() - 2.0;
            ((sum.to_bits() >> 16) as u16).to_le_bytes()
        })
        .collect()
}

fn spec(name: &str, dtype: Dtype, shape: Vec<u64>) -> TensorSpec {
    TensorSpec {
        name: name.into(),
        dtype,
        shape,
    }
}

/// The connector's record: bf16 `hidden_states` [tokens, 2, 64] and i64 `token_ids`.
fn tensors(tokens: u64, hs: Vec<u8>) -> (TensorSpec, Vec<u8>, TensorSpec, Vec<u8>) {
    let ids = bytes(7, 8 * tokens as usize);
    (
        spec("hidden_states", Dtype::BF16, vec![tokens, 2, 64]),
        hs,
        spec("token_ids", Dtype::I64, vec![tokens]),
        ids,
    )
}

fn rec(key: &str, tensors: Vec<TensorInput>) -> RecordInput {
    RecordInput {
        key: key.into(),
        tensors,
        metadata: BTreeMap::from([("model".to_string(), "tiny".to_string())]),
        num_tokens: 0,
    }
}

fn exphuf_writer(dir: &Path) -> ShardWriter {
    ShardWriter::open(dir, config(IoMode::Pwrite, Codec::ExpHuf)).unwrap()
}

/// The only record of the shards in `dir`: its frame header and stored payload.
fn only_frame(dir: &Path) -> (FrameHeader, Vec<u8>) {
    let records = read_records(dir);
    assert_eq!(records.len(), 1);
    let r = &records[0];
    let shard = std::fs::read(&shard_paths(dir)[0]).unwrap();
    let at = r.offset as usize + r.header.header_len() as usize;
    (
        r.header.clone(),
        shard[at..at + r.header.stored_len as usize].to_vec(),
    )
}

/// The exp-huf block the writer itself stored for `hidden_states`, the record's first tensor
/// in data order: the payload after the blob's length and JSON header, less the token ids.
fn block_of(payload: &[u8], ids_len: usize) -> Vec<u8> {
    let n = u64::from_le_bytes(payload[..8].try_into().unwrap()) as usize;
    payload[8 + n..payload.len() - ids_len].to_vec()
}

/// Writes `hs` through the writer's own encoder and returns the frame and the block it made.
fn encoded_by_writer(tokens: u64, hs: Vec<u8>) -> (FrameHeader, Vec<u8>, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let (hs_spec, hs, ids_spec, ids) = tensors(tokens, hs);
    let w = exphuf_writer(dir.path());
    w.submit(rec(
        "r",
        vec![
            TensorInput::new(hs_spec, hs),
            TensorInput::new(ids_spec, ids.clone()),
        ],
    ))
    .unwrap();
    w.close().unwrap();
    let (header, payload) = only_frame(dir.path());
    let block = block_of(&payload, ids.len());
    (header, payload, block)
}

#[test]
fn a_record_given_encoded_is_stored_as_the_writer_would_store_it() {
    for (what, tokens, hs) in [
        ("coded block", 96, activations(1, 96 * 128)),
        ("raw block", 8, bytes(3, 8 * 128 * 2)),
    ] {
        let (want_header, want_payload, block) = encoded_by_writer(tokens, hs.clone());
        // The writer codes by column (block mode 2).
        assert_eq!(block[0], if what == "raw block" { 0 } else { 2 }, "{what}");
        let dir = tempfile::tempdir().unwrap();
        let (hs_spec, _, ids_spec, ids) = tensors(tokens, hs.clone());
        let w = exphuf_writer(dir.path());
        w.submit(rec(
            "r",
            vec![
                TensorInput::exphuf_block(hs_spec, block),
                TensorInput::new(ids_spec, ids),
            ],
        ))
        .unwrap();
        w.close().unwrap();
        let (header, payload) = only_frame(dir.path());
        assert_eq!(payload, want_payload, "{what}: stored bytes");
        assert_eq!(
            header, want_header,
            "{what}: frame header (codec, lengths, CRC)"
        );
        // And the strict reader decodes it to the record's bytes.
        let records = read_records(dir.path());
        assert_eq!(
            records[0].tensors[0].1, hs,
            "{what}: hidden states read back"
        );
    }
}

fn refused(w: &ShardWriter, r: RecordInput, word: &str) {
    match w.submit(r) {
        Err(Error::InvalidInput(msg)) => {
            assert!(msg.contains(word), "{msg:?} should mention {word:?}");
        }
        other => panic!("expected InvalidInput mentioning {word:?}, got {other:?}"),
    }
}

#[test]
fn blocks_that_would_not_read_back_are_refused_at_submission() {
    let tokens = 96;
    let (_, _, block) = encoded_by_writer(tokens, activations(1, 96 * 128));
    let (hs_spec, hs, ids_spec, ids) = tensors(tokens, activations(1, 96 * 128));
    let dir = tempfile::tempdir().unwrap();
    let w = exphuf_writer(dir.path());
    let with_block = |b: Vec<u8>| {
        rec(
            "r",
            vec![
                TensorInput::exphuf_block(hs_spec.clone(), b),
                TensorInput::new(ids_spec.clone(), ids.clone()),
            ],
        )
    };
    refused(
        &w,
        with_block(block[..block.len() - 1].to_vec()),
        "stream lengths add up",
    );
    let mut padded = block.clone();
    padded.push(0);
    refused(&w, with_block(padded), "stream lengths add up");
    refused(&w, with_block(block[..40].to_vec()), "cut off");
    refused(&w, with_block(vec![]), "empty");
    let mut mode = block.clone();
    mode[0] = 3;
    refused(&w, with_block(mode), "mode 3");
    let mut contexts = block.clone();
    contexts[1] = 0;
    refused(&w, with_block(contexts), "context");
    // A raw block for another tensor's size.
    refused(&w, with_block(vec![0; 1 + hs.len() - 2]), "raw block");
    // A block made for a tensor of another size.
    let other = rec(
        "r",
        vec![
            TensorInput::exphuf_block(
                spec("hidden_states", Dtype::BF16, vec![tokens / 2, 2, 64]),
                block.clone(),
            ),
            TensorInput::new(
                spec("token_ids", Dtype::I64, vec![tokens / 2]),
                ids[..ids.len() / 2].to_vec(),
            ),
        ],
    );
    refused(&w, other, "stream");
    // A floating tensor as it is beside a block.
    let mixed = rec(
        "r",
        vec![
            TensorInput::exphuf_block(hs_spec.clone(), block.clone()),
            TensorInput::new(spec("loss", Dtype::F32, vec![2]), vec![0; 8]),
            TensorInput::new(ids_spec.clone(), ids.clone()),
        ],
    );
    refused(&w, mixed, "every floating tensor");
    // A block for a tensor exp-huf stores as it is.
    let ids_block = rec(
        "r",
        vec![
            TensorInput::exphuf_block(hs_spec.clone(), block.clone()),
            TensorInput::exphuf_block(ids_spec.clone(), ids.clone()),
        ],
    );
    refused(&w, ids_block, "stores as it is");
    // The writer keeps working, and has written nothing of the refused records.
    w.submit(with_block(block.clone())).unwrap();
    w.close().unwrap();
    assert_eq!(read_records(dir.path()).len(), 1);

    // Blocks need a writer of codec exp-huf, and one that quantizes nothing itself.
    for (cfg, word) in [
        (config(IoMode::Pwrite, Codec::Bp16Zstd), "codec \"exp-huf\""),
        (
            WriterConfig {
                lossy: Some(layertap_core::fp8::Lossy::Fp8E4m3),
                ..config(IoMode::Pwrite, Codec::ExpHuf)
            },
            "quantizes",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let w = ShardWriter::open(dir.path(), cfg).unwrap();
        refused(&w, with_block(block.clone()), word);
    }
}
