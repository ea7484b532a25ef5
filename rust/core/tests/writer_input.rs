//! Every kind of bad input gets the right error before anything is queued, and the writer
//! keeps working after it.

mod writer_support;

use layertap_core::blob::TensorSpec;
use layertap_core::writer::{
    Durability, RecordInput, ShardWriter, TensorInput, WriterConfig, IO_ENV_VAR,
};
use layertap_core::{Codec, Dtype, Error};
use std::collections::BTreeMap;
use writer_support::*;

fn tensor(name: &str, dtype: Dtype, shape: Vec<u64>, len: usize) -> TensorInput {
    TensorInput::new(
        TensorSpec {
            name: name.into(),
            dtype,
            shape,
        },
        vec![7u8; len],
    )
}

fn rec(key: &str, tensors: Vec<TensorInput>) -> RecordInput {
    RecordInput {
        key: key.into(),
        tensors,
        metadata: BTreeMap::new(),
        num_tokens: 0,
    }
}

fn invalid(w: &ShardWriter, r: RecordInput, word: &str) {
    match w.submit(r) {
        Err(Error::InvalidInput(msg)) => {
            assert!(msg.contains(word), "{msg:?} should mention {word:?}");
        }
        other => panic!("expected InvalidInput mentioning {word:?}, got {other:?}"),
    }
}

#[test]
fn bad_records_are_refused_with_invalid_input() {
    let dir = tempfile::tempdir().unwrap();
    let w = ShardWriter::open(dir.path(), WriterConfig::default()).unwrap();
    let ok = || vec![tensor("x", Dtype::F32, vec![2], 8)];
    invalid(&w, rec("", ok()), "empty");
    invalid(&w, rec("a/b", ok()), "'/'");
    invalid(&w, rec("a\\b", ok()), "'\\\\'");
    invalid(&w, rec("a\nb", ok()), "'\\n'");
    invalid(&w, rec("a\u{7f}b", ok()), "control");
    invalid(&w, rec(&"k".repeat(1025), ok()), "1025 bytes");
    invalid(&w, rec("k", vec![]), "at least one tensor");
    invalid(
        &w,
        rec("k", vec![tensor("x", Dtype::F32, vec![2], 7)]),
        "has 7 bytes but F32 [2] needs 8",
    );
    invalid(
        &w,
        rec("k", vec![tensor("__metadata__", Dtype::U8, vec![1], 1)]),
        "not allowed",
    );
    invalid(
        &w,
        rec("k", vec![tensor("", Dtype::U8, vec![1], 1)]),
        "not allowed",
    );
    invalid(
        &w,
        rec(
            "k",
            vec![
                tensor("x", Dtype::U8, vec![1], 1),
                tensor("x", Dtype::U8, vec![1], 1),
            ],
        ),
        "twice",
    );
    invalid(
        &w,
        rec("k", vec![tensor("x", Dtype::U64, vec![u64::MAX, 2], 8)]),
        "too large",
    );
    let mut with_key = rec("k", ok());
    with_key.metadata.insert("key".into(), "other".into());
    invalid(&w, with_key, "\"key\"");

    // None of it was queued, and the writer still works. An empty tensor is not bad input: a
    // record of zero tokens holds them.
    assert_eq!(w.stats().unwrap().records_submitted, 0);
    let empty = vec![tensor("x", Dtype::BF16, vec![0, 4], 0)];
    assert_eq!(w.submit(rec("zero-tokens", empty)).unwrap(), 0);
    assert_eq!(w.submit(rec("k", ok())).unwrap(), 1);
    match w.submit(rec("k", ok())) {
        Err(Error::DuplicateKey { key }) => assert_eq!(key, "k"),
        other => panic!("expected DuplicateKey, got {other:?}"),
    }
    assert_eq!(w.submit(rec("k2", ok())).unwrap(), 2);
    w.close().unwrap();
    assert!(matches!(
        w.submit(rec("k3", ok())),
        Err(Error::Closed(None))
    ));
    assert!(matches!(w.flush(), Err(Error::Closed(None))));
    let keys: Vec<String> = read_records(dir.path())
        .into_iter()
        .map(|r| r.key)
        .collect();
    assert_eq!(keys, ["zero-tokens", "k", "k2"]);
}

#[test]
fn keys_stay_taken_after_they_are_written() {
    let dir = tempfile::tempdir().unwrap();
    let w = ShardWriter::open(
        dir.path(),
        WriterConfig {
            shard_size: 1,
            ..Default::default()
        },
    )
    .unwrap();
    w.submit(record("same", 1, 4, 0)).unwrap();
    w.flush().unwrap();
    w.submit(record("other", 1, 4, 0)).unwrap(); // a new shard
    w.flush().unwrap();
    assert!(matches!(
        w.submit(record("same", 1, 4, 0)),
        Err(Error::DuplicateKey { .. })
    ));
}

#[test]
fn bad_options_are_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    // Each refusal names its option (Python's OptionError), and says what the value must be.
    let bad = |cfg: WriterConfig, word: &str| match ShardWriter::open(dir.path(), cfg) {
        Err(Error::InvalidOption { option, problem }) => {
            assert_eq!(option, word);
            assert!(problem.starts_with("must be "), "{problem}");
        }
        Err(e) => panic!("expected InvalidOption, got {e}"),
        Ok(_) => panic!("expected InvalidOption naming {word}"),
    };
    bad(
        WriterConfig {
            level: 30,
            ..Default::default()
        },
        "level",
    );
    bad(
        WriterConfig {
            shard_size: 0,
            ..Default::default()
        },
        "shard_size",
    );
    bad(
        WriterConfig {
            durability: Durability::EveryBytes(0),
            ..Default::default()
        },
        "durability",
    );
    bad(
        WriterConfig {
            writer_id: Some(".x".into()),
            ..Default::default()
        },
        "writer_id",
    );
    bad(
        WriterConfig {
            threads: Some(0),
            ..Default::default()
        },
        "threads",
    );
    // Nothing was created by the refused writers.
    assert_eq!(shard_paths(dir.path()).len(), 0);
    // `none` ignores the level.
    ShardWriter::open(
        dir.path(),
        WriterConfig {
            codec: Codec::None,
            level: 30,
            ..Default::default()
        },
    )
    .unwrap();
}

#[test]
fn io_env_var_is_checked() {
    // Runs in a child process so that setting the variable cannot affect other tests.
    if std::env::var_os("LAYERTAP_TEST_ENV_CHILD").is_some() {
        let dir = tempfile::tempdir().unwrap();
        match std::env::var(IO_ENV_VAR).as_deref() {
            Ok("bogus") => {
                let e = ShardWriter::open(dir.path(), WriterConfig::default())
                    .err()
                    .expect("refused");
                assert!(e.to_string().contains(IO_ENV_VAR), "{e}");
            }
            Ok("pwrite") => {
                let w = ShardWriter::open(dir.path(), WriterConfig::default()).unwrap();
                assert_eq!(w.backend().name(), "pwrite");
            }
            other => panic!("unexpected {other:?}"),
        }
        return;
    }
    for value in ["bogus", "pwrite"] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "io_env_var_is_checked", "--test-threads=1"])
            .env("LAYERTAP_TEST_ENV_CHILD", "1")
            .env(IO_ENV_VAR, value)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{value}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"));
    }
}

#[test]
fn submit_many_takes_all_or_none() {
    let dir = tempfile::tempdir().unwrap();
    let w = ShardWriter::open(dir.path(), WriterConfig::default()).unwrap();
    let ok = || vec![tensor("x", Dtype::F32, vec![2], 8)];
    assert_eq!(w.submit(rec("k0", ok())).unwrap(), 0);
    let refused = |batch: Vec<RecordInput>| w.submit_many(batch).unwrap_err();
    // A bad record, a key twice in the batch, a key taken earlier: nothing of the batch queued.
    let bad = refused(vec![
        rec("k1", ok()),
        rec("k2", vec![tensor("x", Dtype::F32, vec![2], 7)]),
    ]);
    assert!(matches!(bad, Error::InvalidInput(_)), "{bad:?}");
    let twice = refused(vec![rec("k1", ok()), rec("k1", ok())]);
    assert!(
        matches!(&twice, Error::DuplicateKey { key } if key == "k1"),
        "{twice:?}"
    );
    let taken = refused(vec![rec("k1", ok()), rec("k0", ok())]);
    assert!(
        matches!(&taken, Error::DuplicateKey { key } if key == "k0"),
        "{taken:?}"
    );
    assert_eq!(w.stats().unwrap().records_submitted, 1);

    assert_eq!(
        w.submit_many(vec![rec("k1", ok()), rec("k2", ok()), rec("k3", ok())])
            .unwrap(),
        vec![1, 2, 3]
    );
    assert_eq!(w.submit_many(vec![]).unwrap(), Vec::<u64>::new());
    w.close().unwrap();
    let keys: Vec<String> = read_records(dir.path())
        .into_iter()
        .map(|r| r.key)
        .collect();
    assert_eq!(keys, ["k0", "k1", "k2", "k3"]);
}
