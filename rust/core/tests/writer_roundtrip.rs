//! Round trips through the writer: every codec and dtype, both I/O backends, completions,
//! ordering, rotation, shard metadata, batching across many pieces.

mod writer_support;

use layertap_core::blob::TensorSpec;
use layertap_core::writer::{
    Durability, IoMode, RecordInput, ShardWriter, TensorInput, WriterConfig,
    MAX_SHARD_METADATA_JSON,
};
use layertap_core::{Codec, Dtype, Error};
use proptest::prelude::*;
use std::collections::BTreeMap;
use writer_support::*;

#[test]
fn records_round_trip_in_order_with_completions() {
    let modes = io_modes();
    eprintln!("backends tested: {}", modes.len());
    for io in modes {
        for codec in Codec::ALL {
            let dir = tempfile::tempdir().unwrap();
            let w = ShardWriter::open(dir.path(), config(io, codec)).unwrap();
            if std::env::var_os("LAYERTAP_IO").is_none() {
                let want = if io == IoMode::Uring {
                    "io_uring"
                } else {
                    "pwrite"
                };
                assert_eq!(w.backend().name(), want);
            }
            for i in 0..50u64 {
                let seq = w
                    .submit(record(&format!("req-{i}"), 1 + i % 7, 64, i))
                    .unwrap();
                assert_eq!(seq, i);
            }
            w.flush().unwrap();
            let done = w.poll().unwrap();
            assert_eq!(
                done.iter().map(|c| c.seq).collect::<Vec<_>>(),
                (0..50).collect::<Vec<_>>()
            );
            let stats = w.stats().unwrap();
            assert_eq!(
                (
                    stats.records_submitted,
                    stats.records_written,
                    stats.queue_depth
                ),
                (50, 50, 0)
            );
            assert_eq!(stats.inflight_bytes, 0);
            w.close().unwrap();
            assert_eq!(w.stats().unwrap().shards_closed, 1);

            let shards = read_dir(dir.path());
            assert_eq!(shards.len(), 1);
            let shard = &shards[0];
            assert!(shard.index.is_some(), "closed shard is complete");
            assert_eq!(shard.records.len(), 50);
            for (i, (rec, c)) in shard.records.iter().zip(&done).enumerate() {
                let i = i as u64;
                assert_eq!(rec.key, format!("req-{i}"));
                assert_eq!(
                    (c.key.as_str(), c.offset, c.shard.as_path()),
                    (rec.key.as_str(), rec.offset, shard.path.as_path())
                );
                assert_eq!(
                    (c.stored_len, c.raw_len),
                    (rec.header.stored_len, rec.header.raw_len)
                );
                assert_eq!(rec.header.codec, codec);
                assert_eq!(rec.header.num_tokens as u64, 1 + i % 7);
                assert_eq!(rec.tensors, record_tensors(1 + i % 7, 64, i));
                assert_eq!(rec.metadata["model"], "tiny");
                assert_eq!(rec.metadata["key"], rec.key);
            }
            let raw: u64 = done.iter().map(|c| c.raw_len).sum();
            let stored: u64 = done.iter().map(|c| c.stored_len).sum();
            assert_eq!((stats.bytes_in, stats.bytes_stored), (raw, stored));
            if codec == Codec::None {
                assert_eq!(raw, stored);
            }
        }
    }
}

/// The crate's own reader agrees with the test reader about what the writer wrote.
#[test]
fn the_crate_reader_reads_what_the_writer_wrote() {
    for codec in Codec::ALL {
        let dir = tempfile::tempdir().unwrap();
        let cfg = WriterConfig {
            shard_size: 64 << 10,
            ..config(IoMode::Pwrite, codec)
        };
        let w = ShardWriter::open(dir.path(), cfg).unwrap();
        for i in 0..30u64 {
            w.submit(record(&format!("r{i}"), 1 + i % 5, 256, i))
                .unwrap();
        }
        w.close().unwrap();
        let mut n = 0u64;
        for path in shard_paths(dir.path()) {
            let reader = layertap_core::reader::ShardReader::open(&path).unwrap();
            assert!(reader.is_complete() && reader.problems().is_empty());
            for i in 0..reader.len() {
                let rec = reader.read(i, true).unwrap();
                assert_eq!(rec.key, format!("r{n}"));
                let got: Vec<_> = rec
                    .header
                    .tensors
                    .iter()
                    .map(|t| (t.spec.clone(), rec.tensor_data(t).to_vec()))
                    .collect();
                assert_eq!(got, record_tensors(1 + n % 5, 256, n));
                n += 1;
            }
        }
        assert_eq!(n, 30);
    }
}

#[test]
fn shard_header_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = WriterConfig {
        writer_id: Some("rank3".into()),
        shard_metadata: BTreeMap::from([("model".to_string(), "m".to_string())]),
        ..Default::default()
    };
    let w = ShardWriter::open(dir.path(), cfg).unwrap();
    w.submit(record("a", 2, 8, 1)).unwrap();
    w.close().unwrap();
    let shard = read_shard(&dir.path().join("rank3-000000.lts"));
    let meta = &shard.meta;
    assert_eq!(meta["writer_id"], "rank3");
    assert_eq!(meta["shard_index"], 0);
    assert!(meta["created_unix_ms"].as_u64().unwrap() > 1_600_000_000_000);
    assert_eq!(
        meta["writer"],
        format!("layertap-rust {}", env!("CARGO_PKG_VERSION"))
    );
    assert_eq!(meta["user"], serde_json::json!({"model": "m"}));
    let keys: Vec<&str> = meta
        .as_object()
        .unwrap()
        .keys()
        .map(|k| k.as_str())
        .collect();
    assert_eq!(
        keys,
        [
            "writer_id",
            "shard_index",
            "created_unix_ms",
            "writer",
            "user"
        ]
    );
}

/// Shard metadata is measured as the header stores it, escapes included (`\u0001` is 6 bytes
/// there): measured raw, 200,000 control characters passed, every record was reported written,
/// and no reader or `recover` could open the shard (a header over 1 MiB).
#[test]
fn shard_metadata_is_measured_as_the_header_stores_it() {
    let dir = tempfile::tempdir().unwrap();
    let open = |name: &str, value: String| {
        let cfg = WriterConfig {
            writer_id: Some("m".into()),
            shard_metadata: BTreeMap::from([("m".to_string(), value)]),
            ..Default::default()
        };
        ShardWriter::open(dir.path().join(name), cfg)
    };
    let refused = |name: &str, value: String, json_len: usize| {
        let err = open(name, value).err().expect("refused");
        assert!(
            matches!(
                err,
                Error::InvalidOption {
                    option: "metadata",
                    ..
                }
            ),
            "{err}"
        );
        let want = format!("metadata is too large: {json_len} bytes as JSON");
        assert!(err.to_string().contains(&want), "{err}");
        assert!(!dir.path().join(name).exists(), "nothing written");
    };
    // `{"m":"` and `"}`: 8 bytes around the value.
    refused("controls", "\x01".repeat(200_000), 8 + 6 * 200_000);
    // Every kind of escape (`\"`, `\\`, `\u0001`, `\n`) and a 2-byte character: 14 bytes a unit,
    // padded to exactly the limit, which opens; one byte more does not.
    let unit = "\"\\\x01\né";
    let units = (MAX_SHARD_METADATA_JSON - 8) / 14;
    let at_limit = unit.repeat(units) + &"x".repeat(MAX_SHARD_METADATA_JSON - 8 - 14 * units);
    refused("over", at_limit.clone() + "x", MAX_SHARD_METADATA_JSON + 1);
    let w = open("at", at_limit.clone()).unwrap();
    w.submit(record("a", 2, 8, 1)).unwrap();
    w.close().unwrap();
    let path = dir.path().join("at/m-000000.lts");
    let reader = layertap_core::reader::ShardReader::open(&path).unwrap();
    assert!(reader.is_complete() && reader.len() == 1);
    let shard = read_shard(&path);
    assert_eq!(shard.meta["user"]["m"], at_limit.as_str());
    assert_eq!(shard.records.len(), 1);
}

#[test]
fn shards_rotate_at_shard_size_and_keep_order() {
    for io in io_modes() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = WriterConfig {
            shard_size: 40 << 10,
            writer_id: Some("w".into()),
            ..config(io, Codec::None)
        };
        let w = ShardWriter::open(dir.path(), cfg).unwrap();
        // Each record is ~16 KiB raw: two fit a 40 KiB shard, three do not.
        for i in 0..9u64 {
            w.submit(record(&format!("r{i}"), 32, 128, i)).unwrap();
        }
        // One record larger than a shard: it gets a shard of its own.
        w.submit(record("big", 256, 128, 99)).unwrap();
        w.submit(record("after", 1, 8, 100)).unwrap();
        w.close().unwrap();
        let shards = read_dir(dir.path());
        let names: Vec<String> = shards
            .iter()
            .map(|s| s.path.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            (0..7).map(|n| format!("w-{n:06}.lts")).collect::<Vec<_>>()
        );
        let counts: Vec<usize> = shards.iter().map(|s| s.records.len()).collect();
        assert_eq!(counts, [2, 2, 2, 2, 1, 1, 1]);
        for s in &shards {
            assert!(s.index.is_some());
            let len = std::fs::metadata(&s.path).unwrap().len();
            let data_end = s
                .records
                .last()
                .map(|r| r.offset + r.header.frame_len())
                .unwrap();
            assert!(
                data_end <= 40 << 10 || s.records.len() == 1,
                "{:?} data ends at {data_end}",
                s.path
            );
            assert!(len > data_end);
        }
        let keys: Vec<String> = shards
            .iter()
            .flat_map(|s| s.records.iter().map(|r| r.key.clone()))
            .collect();
        let mut want: Vec<String> = (0..9).map(|i| format!("r{i}")).collect();
        want.extend(["big".into(), "after".into()]);
        assert_eq!(keys, want);
        assert_eq!(w.stats().unwrap().shards_closed, 7);
    }
}

#[test]
fn many_tensors_exceed_iov_max_in_one_record() {
    for io in io_modes() {
        let dir = tempfile::tempdir().unwrap();
        let w = ShardWriter::open(dir.path(), config(io, Codec::None)).unwrap();
        let tensors: Vec<TensorInput> = (0..1500u64)
            .map(|i| {
                let spec = TensorSpec {
                    name: format!("t{i}"),
                    dtype: Dtype::U8,
                    shape: vec![1 + i % 5],
                };
                TensorInput::new(spec, bytes(i, 1 + (i % 5) as usize))
            })
            .collect();
        let rec = RecordInput {
            key: "wide".into(),
            tensors,
            metadata: BTreeMap::new(),
            num_tokens: 0,
        };
        w.submit(rec).unwrap();
        for i in 0..300u64 {
            w.submit(record(&format!("n{i}"), 1, 4, i)).unwrap();
        }
        w.close().unwrap();
        let recs = read_records(dir.path());
        assert_eq!(recs.len(), 301);
        assert_eq!(recs[0].tensors.len(), 1500);
        assert_eq!(recs[0].tensors[1499].1, bytes(1499, 5));
    }
}

#[test]
fn durability_modes_write_the_same_records() {
    for durability in [
        Durability::None,
        Durability::OnClose,
        Durability::EveryBytes(4096),
    ] {
        for io in io_modes() {
            let dir = tempfile::tempdir().unwrap();
            let cfg = WriterConfig {
                durability,
                shard_size: 64 << 10,
                ..config(io, Codec::Zstd)
            };
            let w = ShardWriter::open(dir.path(), cfg).unwrap();
            for i in 0..40u64 {
                w.submit(record(&format!("k{i}"), 4, 64, i)).unwrap();
                if i % 10 == 0 {
                    w.flush().unwrap();
                }
            }
            w.close().unwrap();
            let recs = read_records(dir.path());
            assert_eq!(recs.len(), 40, "{durability:?}");
            for (i, r) in recs.iter().enumerate() {
                assert_eq!(r.tensors, record_tensors(4, 64, i as u64));
            }
        }
    }
}

#[test]
fn close_is_idempotent_and_drop_closes() {
    let dir = tempfile::tempdir().unwrap();
    {
        let w = ShardWriter::open(dir.path(), WriterConfig::default()).unwrap();
        w.submit(record("x", 3, 16, 5)).unwrap();
        // dropped without close
    }
    let shards = read_dir(dir.path());
    assert_eq!(shards.len(), 1);
    assert!(shards[0].index.is_some(), "drop completes the shard");
    assert_eq!(shards[0].records[0].tensors, record_tensors(3, 16, 5));

    let w = ShardWriter::open(dir.path(), WriterConfig::default()).unwrap();
    w.submit(record("y", 1, 4, 0)).unwrap();
    w.close().unwrap();
    w.close().unwrap();
    assert_eq!(w.poll().unwrap().len(), 1, "completions survive close");
}

#[test]
fn empty_writer_leaves_an_empty_complete_shard() {
    let dir = tempfile::tempdir().unwrap();
    let w = ShardWriter::open(dir.path(), WriterConfig::default()).unwrap();
    w.close().unwrap();
    let shards = read_dir(dir.path());
    assert_eq!(shards.len(), 1);
    assert_eq!(shards[0].index.as_deref(), Some(&[][..]));
}

#[test]
fn writers_run_concurrently_in_one_directory() {
    let dir = tempfile::tempdir().unwrap();
    std::thread::scope(|s| {
        for t in 0..3 {
            let path = dir.path();
            s.spawn(move || {
                let w = ShardWriter::open(
                    path,
                    WriterConfig {
                        level: 1,
                        ..Default::default()
                    },
                )
                .unwrap();
                for i in 0..20u64 {
                    w.submit(record(&format!("t{t}-{i}"), 2, 32, i)).unwrap();
                }
                w.close().unwrap();
            });
        }
    });
    let shards = read_dir(dir.path());
    assert_eq!(shards.len(), 3);
    assert_eq!(shards.iter().map(|s| s.records.len()).sum::<usize>(), 60);
}

#[test]
fn every_dtype_with_every_codec() {
    for codec in Codec::ALL {
        let dir = tempfile::tempdir().unwrap();
        let w = ShardWriter::open(dir.path(), config(IoMode::Auto, codec)).unwrap();
        let mut want = Vec::new();
        for (i, dtype) in Dtype::ALL.into_iter().enumerate() {
            // Odd element counts, so 1-byte tensors leave the payload unaligned.
            let spec = TensorSpec {
                name: dtype.name().to_lowercase(),
                dtype,
                shape: vec![3, 5 + i as u64],
            };
            let data = bytes(i as u64, spec.byte_len().unwrap() as usize);
            want.push((spec.clone(), data.clone()));
            w.submit(RecordInput {
                key: format!("{dtype}"),
                tensors: vec![TensorInput::new(spec, data)],
                metadata: BTreeMap::new(),
                num_tokens: 0,
            })
            .unwrap();
        }
        w.close().unwrap();
        let got: Vec<_> = read_records(dir.path())
            .into_iter()
            .map(|r| r.tensors[0].clone())
            .collect();
        assert_eq!(got, want, "{codec}");
    }
}

fn arb_tensor() -> impl Strategy<Value = (Dtype, Vec<u64>, u64)> {
    (
        0..Dtype::ALL.len(),
        prop::collection::vec(1u64..6, 0..4),
        any::<u64>(),
    )
        .prop_map(|(d, shape, seed)| (Dtype::ALL[d], shape, seed))
}

/// A key, tensors as (dtype, shape, seed), and metadata.
type ArbRecord = (
    String,
    Vec<(Dtype, Vec<u64>, u64)>,
    BTreeMap<String, String>,
);

fn arb_record() -> impl Strategy<Value = ArbRecord> {
    (
        "[a-zA-Z0-9 ._:é-]{1,40}",
        prop::collection::vec(arb_tensor(), 1..5),
        prop::collection::btree_map("[a-z_]{1,8}", "\\PC{0,12}", 0..3),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Any tensors of any dtype, with any codec and backend, read back exactly.
    #[test]
    fn any_record_round_trips(
        recs in prop::collection::vec(arb_record(), 1..6),
        codec in 0..3usize,
        uring in any::<bool>(),
        direct in any::<bool>(),
        level in 1..6i32,
    ) {
        let codec = Codec::ALL[codec];
        let io = if uring && io_modes().contains(&IoMode::Uring) { IoMode::Uring } else { IoMode::Pwrite };
        let dir = tempfile::tempdir().unwrap();
        let cfg = WriterConfig { level, direct, ..config(io, codec) };
        let w = ShardWriter::open(dir.path(), cfg).unwrap();
        let mut want = Vec::new();
        for (n, (key, tensors, mut meta)) in recs.into_iter().enumerate() {
            let key = format!("{n}-{key}");
            meta.remove("key");
            let inputs: Vec<TensorInput> = tensors.iter().enumerate().map(|(i, (dtype, shape, seed))| {
                let spec = TensorSpec { name: format!("t{i}"), dtype: *dtype, shape: shape.clone() };
                let len = spec.byte_len().unwrap() as usize;
                TensorInput::new(spec, bytes(*seed, len))
            }).collect();
            let read: Vec<_> = inputs.iter().map(|t| (t.spec.clone(), t.data.bytes().to_vec())).collect();
            w.submit(RecordInput { key: key.clone(), tensors: inputs, metadata: meta.clone(), num_tokens: 7 }).unwrap();
            meta.insert("key".into(), key.clone());
            want.push((key, read, meta));
        }
        w.close().unwrap();
        let got = read_records(dir.path());
        prop_assert_eq!(got.len(), want.len());
        for (g, (key, tensors, meta)) in got.iter().zip(&want) {
            prop_assert_eq!(&g.key, key);
            prop_assert_eq!(&g.tensors, tensors);
            prop_assert_eq!(&g.metadata, meta);
            prop_assert_eq!(g.header.num_tokens, 7);
            prop_assert_eq!(g.header.codec, codec);
        }
    }
}
