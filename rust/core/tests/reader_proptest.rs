//! Property: whatever is done to a shard's bytes (bits flipped, bytes overwritten, zeroed,
//! inserted, the file cut), opening, reading, checking and recovering it never panic, and a
//! record is returned only if it is exactly what was written.

mod reader_common;

use layertap_core::codec::Codec;
use layertap_core::reader::ShardReader;
use layertap_core::recover::recover;
use proptest::prelude::*;
use reader_common::*;
use std::collections::{BTreeSet, HashMap};
use std::path::Path;

#[derive(Debug, Clone)]
enum Mutation {
    Flip { at: usize, bit: u8 },
    Overwrite { at: usize, bytes: Vec<u8> },
    Zero { at: usize, len: usize },
    Insert { at: usize, bytes: Vec<u8> },
    Cut { at: usize },
}

impl Mutation {
    /// Applies the mutation; positions are taken modulo the length so every one lands.
    fn apply(&self, b: &mut Vec<u8>) {
        if b.is_empty() {
            return;
        }
        let n = b.len();
        match self {
            Mutation::Flip { at, bit } => b[at % n] ^= 1 << (bit % 8),
            Mutation::Overwrite { at, bytes } => {
                for (k, &x) in bytes.iter().enumerate() {
                    if let Some(slot) = b.get_mut(at % n + k) {
                        *slot = x;
                    }
                }
            }
            Mutation::Zero { at, len } => {
                let s = at % n;
                let e = (s + len).min(n);
                b[s..e].fill(0);
            }
            Mutation::Insert { at, bytes } => {
                let s = at % (n + 1);
                b.splice(s..s, bytes.iter().copied());
            }
            Mutation::Cut { at } => b.truncate(at % (n + 1)),
        }
    }
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (any::<usize>(), any::<u8>()).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..64))
            .prop_map(|(at, bytes)| Mutation::Overwrite { at, bytes }),
        1 => (any::<usize>(), 1usize..256).prop_map(|(at, len)| Mutation::Zero { at, len }),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..24))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        1 => any::<usize>().prop_map(|at| Mutation::Cut { at }),
    ]
}

fn codec() -> impl Strategy<Value = Codec> {
    prop::sample::select(Codec::ALL.to_vec())
}

fn records() -> impl Strategy<Value = Vec<RecordSpec>> {
    prop::collection::vec(
        (codec(), any::<bool>(), 1u64..6, 1usize..300, any::<u8>()),
        0..5,
    )
    .prop_map(|specs| {
        specs
            .into_iter()
            .enumerate()
            .map(|(i, (codec, sample, tokens, len, seed))| {
                let key = format!("p-{i}");
                if sample {
                    RecordSpec::sample(&key, codec, tokens, seed as u64)
                } else {
                    RecordSpec::bytes(&key, codec, len, seed)
                }
            })
            .collect()
    })
}

/// Reads every record of the shard at `path` (if it opens), checking that each record returned
/// is the one written under its key; returns the keys read intact.
fn read_all(
    path: &Path,
    written: &HashMap<String, Vec<u8>>,
) -> Result<BTreeSet<String>, TestCaseError> {
    let Ok(r) = ShardReader::open(path) else {
        return Ok(BTreeSet::new());
    };
    let mut intact = BTreeSet::new();
    for (i, e) in r.entries().iter().enumerate() {
        let want = written.get(&e.key);
        if let Ok(rec) = r.read(i, true) {
            prop_assert_eq!(
                Some(&rec.bytes.as_slice().to_vec()),
                want,
                "read({}) of {:?}",
                i,
                e.key
            );
            intact.insert(e.key.clone());
        }
        if let Ok(raw) = r.raw(i, true) {
            prop_assert_eq!(Some(&raw.to_vec()), want, "raw({}) of {:?}", i, e.key);
        }
        if r.check(i).is_ok() {
            prop_assert!(
                intact.contains(&e.key),
                "check({}) passed a record read() refused",
                i
            );
        }
        // Unverified reads may return damaged bytes, but must not panic either.
        let _ = r.read(i, false);
        let _ = r.raw(i, false);
    }
    Ok(intact)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 384, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn mutated_shards_never_panic_nor_lie(
        recs in records(),
        complete in any::<bool>(),
        mutations in prop::collection::vec(mutation(), 0..4),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let shard = build_shard(&recs, complete);
        let written: HashMap<String, Vec<u8>> =
            shard.entries.iter().map(|e| e.key.clone()).zip(shard.raws.iter().cloned()).collect();
        let mut bytes = shard.bytes;
        for m in &mutations {
            m.apply(&mut bytes);
        }
        let path = write_file(dir.path(), "s.lts", &bytes);
        let was_complete = ShardReader::open(&path).map(|r| r.is_complete()).unwrap_or(false);
        let before = read_all(&path, &written)?;
        if mutations.is_empty() {
            prop_assert_eq!(before.len(), recs.len());
        }
        if let Ok(report) = recover(&path) {
            if report.removed {
                // A torn empty shard (cut inside its header) holds nothing: recovery removes it.
                prop_assert!(before.is_empty() && !path.exists());
                return Ok(());
            }
            let after = read_all(&path, &written)?;
            let r = ShardReader::open(&path).unwrap();
            prop_assert!(r.is_complete());
            prop_assert_eq!(r.len() as u64, report.records);
            if !was_complete {
                // Recovery keeps every record the scan found intact.
                prop_assert!(before.is_subset(&after), "{:?} lost in {:?}", before, after);
            }
        }
    }
}
