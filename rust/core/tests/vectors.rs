//! The shared test vectors (tests/vectors, written by the pure-Python writer): the Rust reader
//! finds in each exactly what `expected.json` says (see tests/vectors/README.md).

use layertap_core::format::crc32c;
use layertap_core::reader::{is_torn_empty, ShardReader};
use layertap_core::recover::recover;
use layertap_core::{Dtype, Error};
use serde_json::Value;
use std::path::PathBuf;

fn vectors_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/vectors")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An IEEE half-precision value, widened exactly.
fn f16_to_f64(bits: u16) -> f64 {
    let sign = if bits & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = ((bits >> 10) & 0x1f) as i32;
    let frac = (bits & 0x3ff) as f64;
    sign * match exp {
        0 => frac * 2f64.powi(-24),
        31 if frac == 0.0 => f64::INFINITY,
        31 => f64::NAN,
        e => (1.0 + frac / 1024.0) * 2f64.powi(e - 15),
    }
}

/// A float8 e4m3fn value, widened exactly.
fn e4m3_to_f64(b: u8) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exp, frac) = (((b >> 3) & 15) as i32, (b & 7) as f64);
    sign * match (exp, b & 0x7F) {
        (_, 0x7F) => f64::NAN,
        (0, _) => frac * 2f64.powi(-9),
        (e, _) => (1.0 + frac / 8.0) * 2f64.powi(e - 7),
    }
}

/// The elements of a tensor as JSON numbers, as expected.json writes them.
fn values(dtype: Dtype, data: &[u8]) -> Vec<Value> {
    let n = dtype.size();
    data.chunks_exact(n)
        .map(|c| match dtype {
            Dtype::BF16 => {
                Value::from(f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16) as f64)
            }
            Dtype::F16 => Value::from(f16_to_f64(u16::from_le_bytes([c[0], c[1]]))),
            Dtype::F32 => Value::from(f32::from_le_bytes(c.try_into().unwrap()) as f64),
            Dtype::F64 => Value::from(f64::from_le_bytes(c.try_into().unwrap())),
            Dtype::F8_E4M3 => Value::from(e4m3_to_f64(c[0])),
            Dtype::I8 => Value::from(c[0] as i8),
            Dtype::U8 | Dtype::BOOL => Value::from(c[0]),
            Dtype::I16 => Value::from(i16::from_le_bytes([c[0], c[1]])),
            Dtype::U16 => Value::from(u16::from_le_bytes([c[0], c[1]])),
            Dtype::I32 => Value::from(i32::from_le_bytes(c.try_into().unwrap())),
            Dtype::U32 => Value::from(u32::from_le_bytes(c.try_into().unwrap())),
            Dtype::I64 => Value::from(i64::from_le_bytes(c.try_into().unwrap())),
            Dtype::U64 => Value::from(u64::from_le_bytes(c.try_into().unwrap())),
        })
        .collect()
}

/// Numbers compared by value (`1.0` and `1` are the same number here). serde_json's default
/// float parsing may be off by an ulp of f64, so `F32` values are compared at f32 precision, where
/// the exactly widened value written in expected.json has only one neighbour.
fn same_numbers(dtype: Dtype, got: &[Value], want: &[Value]) -> bool {
    let same = |x: &Value, y: &Value| match dtype {
        Dtype::F32 => x.as_f64().map(|v| v as f32) == y.as_f64().map(|v| v as f32),
        _ => x == y || x.as_f64() == y.as_f64(),
    };
    got.len() == want.len() && got.iter().zip(want).all(|(x, y)| same(x, y))
}

#[test]
fn every_vector_reads_as_expected() {
    let dir = vectors_dir();
    let expected_path = dir.join("expected.json");
    let text = std::fs::read_to_string(&expected_path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (tests/vectors/README.md says how to make it)",
            expected_path.display()
        )
    });
    let expected: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(expected["format_version"], 1);
    let files = expected["files"].as_object().unwrap();
    assert!(
        files.len() >= 10,
        "expected.json lists {} files",
        files.len()
    );
    for (name, want) in files {
        let path = dir.join(name);
        let r = ShardReader::open(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            r.file_len(),
            want["file_bytes"].as_u64().unwrap(),
            "{name}: file_bytes"
        );
        assert_eq!(
            r.is_complete(),
            want["complete"].as_bool().unwrap(),
            "{name}: complete"
        );
        assert_eq!(
            r.header_len(),
            want["header_len"].as_u64().unwrap(),
            "{name}: header_len"
        );
        assert_eq!(
            hex(&r.shard_id()),
            want["shard_id"].as_str().unwrap(),
            "{name}: shard_id"
        );
        let meta: Value = serde_json::from_str(r.meta_json()).unwrap();
        assert_eq!(meta, want["meta"], "{name}: meta");
        assert_eq!(
            r.data_end(),
            want["data_end"].as_u64().unwrap(),
            "{name}: data_end"
        );
        assert_eq!(
            r.torn_tail_bytes(),
            want["torn_tail_bytes"].as_u64().unwrap(),
            "{name}: torn tail"
        );
        assert_eq!(
            r.lost_in_recovery() as u64,
            want["lost_in_recovery"].as_u64().unwrap(),
            "{name}: lost in recovery"
        );
        let problems: Vec<Value> = r
            .problems()
            .iter()
            .map(|p| serde_json::json!({"kind": p.kind(), "offset": p.offset(), "key": p.key()}))
            .collect();
        assert_eq!(
            Value::from(problems.clone()),
            want["open_problems"],
            "{name}: problems found opening"
        );

        let records = want["records"].as_array().unwrap();
        assert_eq!(r.len(), records.len(), "{name}: record count");
        let mut verify_problems = problems;
        for (i, (e, w)) in r.entries().iter().zip(records).enumerate() {
            let ctx = format!("{name} record {i} ({:?})", e.key);
            assert_eq!(e.key, w["key"].as_str().unwrap(), "{ctx}");
            assert_eq!(e.frame_offset, w["frame_offset"].as_u64().unwrap(), "{ctx}");
            assert_eq!(e.frame_len(), w["frame_len"].as_u64().unwrap(), "{ctx}");
            assert_eq!(e.codec.name(), w["codec"].as_str().unwrap(), "{ctx}");
            assert_eq!(e.stored_len, w["stored_len"].as_u64().unwrap(), "{ctx}");
            assert_eq!(e.raw_len, w["raw_len"].as_u64().unwrap(), "{ctx}");
            assert_eq!(
                e.num_tokens as u64,
                w["num_tokens"].as_u64().unwrap(),
                "{ctx}"
            );
            assert_eq!(
                e.payload_crc as u64,
                w["payload_crc"].as_u64().unwrap(),
                "{ctx}"
            );
            if !w["ok"].as_bool().unwrap() {
                for res in [
                    r.read(i, true).map(drop),
                    r.raw(i, true).map(drop),
                    r.check(i),
                ] {
                    match res {
                        Err(Error::CorruptRecord {
                            path: p,
                            offset,
                            key,
                            ..
                        }) => {
                            assert_eq!(p, path, "{ctx}");
                            assert_eq!(offset, e.frame_offset, "{ctx}");
                            assert_eq!(key.as_deref(), Some(e.key.as_str()), "{ctx}");
                        }
                        other => panic!("{ctx}: expected a corrupt record, got {other:?}"),
                    }
                }
                verify_problems.push(serde_json::json!({"kind": "corrupt_record", "offset": e.frame_offset, "key": e.key}));
                continue;
            }
            r.check(i).unwrap_or_else(|err| panic!("{ctx}: {err}"));
            let raw = r.raw(i, true).unwrap();
            assert_eq!(
                crc32c(&raw) as u64,
                w["raw_crc32c"].as_u64().unwrap(),
                "{ctx}: decoded payload"
            );
            let rec = r.read(i, true).unwrap();
            assert_eq!(rec.bytes.as_slice(), &raw[..], "{ctx}");
            let metadata: serde_json::Map<String, Value> = rec
                .header
                .metadata
                .iter()
                .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
                .collect();
            assert_eq!(Value::Object(metadata), w["metadata"], "{ctx}: metadata");
            let tensors = w["tensors"].as_array().unwrap();
            assert_eq!(
                rec.header.tensors.len(),
                tensors.len(),
                "{ctx}: tensor count"
            );
            for (t, wt) in rec.header.tensors.iter().zip(tensors) {
                assert_eq!(t.spec.name, wt["name"].as_str().unwrap(), "{ctx}");
                assert_eq!(
                    t.spec.dtype.name(),
                    wt["dtype"].as_str().unwrap(),
                    "{ctx}: {}",
                    t.spec.name
                );
                assert_eq!(
                    Value::from(t.spec.shape.clone()),
                    wt["shape"],
                    "{ctx}: {}",
                    t.spec.name
                );
                let got = values(t.spec.dtype, rec.tensor_data(t));
                assert!(
                    same_numbers(t.spec.dtype, &got, wt["values"].as_array().unwrap()),
                    "{ctx}: values of {}",
                    t.spec.name
                );
            }
        }
        // Dataset.verify() lists problems in file order.
        verify_problems.sort_by_key(|p| p["offset"].as_u64());
        assert_eq!(
            Value::from(verify_problems),
            want["verify_problems"],
            "{name}: verify problems"
        );
    }
}

#[test]
fn files_that_are_not_shards() {
    let dir = vectors_dir();
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let files = expected["not_shards"].as_object().unwrap();
    assert!(files.len() >= 3);
    let tmp = tempfile::tempdir().unwrap();
    for (name, want) in files {
        let torn = want["torn_empty"].as_bool().unwrap();
        let bytes = std::fs::read(dir.join(name)).unwrap();
        assert_eq!(is_torn_empty(&bytes), torn, "{name}");
        let copy = tmp.path().join(name);
        std::fs::write(&copy, &bytes).unwrap();
        match ShardReader::open(&copy) {
            Err(Error::NotAShard { reason, .. }) => {
                assert_eq!(
                    reason.contains("torn empty shard"),
                    torn,
                    "{name}: {reason}"
                );
            }
            other => panic!("{name}: {other:?}"),
        }
        match recover(&copy) {
            Ok(report) if torn => {
                assert!(report.removed && report.records == 0, "{name}");
                assert_eq!(report.truncated_bytes, bytes.len() as u64, "{name}");
                assert!(!copy.exists(), "{name}: a torn empty shard is removed");
            }
            Err(Error::NotAShard { .. }) if !torn => {
                assert_eq!(std::fs::read(&copy).unwrap(), bytes, "{name}: left alone");
            }
            other => panic!("{name}: {other:?}"),
        }
    }
}

/// `layout.json`: the region sink's layout gives each token the indices the vector holds (and
/// Python's `HiddenStatesCache.write_indices` the same, `tests/test_py_vectors.py`), through
/// `Layout` alone and through `RegionSink::fill` into a pool.
#[test]
fn layout_vectors() {
    use layertap_core::region::{Layout, RegionSink};
    let text = std::fs::read_to_string(vectors_dir().join("layout.json")).unwrap();
    let vectors: Value = serde_json::from_str(&text).unwrap();
    let cases = vectors["cases"].as_array().unwrap();
    assert!(cases.len() >= 5);
    let ints = |v: &Value| -> Vec<i64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap())
            .collect()
    };
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let row_steps = case["row_steps"].as_array().map(|s| {
            let s: Vec<i64> = s.iter().map(|x| x.as_i64().unwrap()).collect();
            (s[0], s[1])
        });
        let layout = || {
            Layout::new(
                case["block_size"].as_u64().unwrap(),
                case["tensor_block_size"].as_u64().unwrap(),
                row_steps,
                ints(&case["layer_rows"]),
            )
            .unwrap()
        };
        let width = case["index_width"].as_u64().unwrap() as usize;
        assert_eq!(layout().width(), width, "{name}");
        let want: Vec<i64> = case["indices"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(ints)
            .collect();
        let requests: Vec<(Vec<u64>, u64)> = case["requests"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let blocks = ints(&r["block_ids"])
                    .into_iter()
                    .map(|b| b as u64)
                    .collect();
                (blocks, r["num_tokens"].as_u64().unwrap())
            })
            .collect();

        let mut got = Vec::new();
        for (blocks, n) in &requests {
            let mut out = vec![-1i64; *n as usize * width];
            layout().write_request(blocks, &mut out);
            got.extend(out);
        }
        assert_eq!(got, want, "{name}: Layout::write_request");

        let mut pool = vec![0u8; 1 << 14];
        let base = pool.as_mut_ptr();
        // SAFETY: the vector's buffer stays in place when the vector moves into the sink,
        // which owns it from here on; nothing else writes it.
        let sink = unsafe {
            RegionSink::new(
                Box::new(pool),
                base,
                1 << 14,
                Dtype::BF16,
                vec![1, 1],
                Default::default(),
                layout(),
            )
        }
        .unwrap();
        let counts: Vec<u64> = requests.iter().map(|r| r.1).collect();
        let total = sink
            .fill(0, 4096, &counts, |i, ids, blocks| {
                ids.fill(i as i64);
                blocks.extend_from_slice(&requests[i].0);
                Ok::<(), Error>(())
            })
            .unwrap();
        assert_eq!(total as usize * width, want.len(), "{name}");
        // SAFETY: test only: the index range lies in the pool (4096 + 8 * its length < 16 KiB),
        // which `sink` keeps alive; nothing writes it meanwhile.
        let bytes = unsafe { std::slice::from_raw_parts(base.add(4096), want.len() * 8) };
        let filled: Vec<i64> = bytes
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(filled, want, "{name}: RegionSink::fill");
    }
}
