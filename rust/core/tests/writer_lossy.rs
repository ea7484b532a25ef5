//! The lossy stage (`WriterConfig::lossy`, docs/FP8.md): a lossy writer stores `hidden_states`
//! as e4m3 with a scale per token, whatever the codec, and leaves everything else as given; bad
//! input is refused at submit, before anything is queued; the budget follows the records'
//! stored length.

mod writer_support;

use layertap_core::blob::TensorSpec;
use layertap_core::fp8::{self, Lossy};
use layertap_core::writer::{RecordInput, ShardWriter, TensorInput, WriterConfig};
use layertap_core::{Codec, Dtype, Error};
use std::collections::BTreeMap;
use writer_support::*;

fn bf16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
        .collect()
}

fn hidden_record(key: &str, tokens: u64, width: u64, extra: Option<(&str, Dtype)>) -> RecordInput {
    let values: Vec<f32> = (0..tokens * width)
        .map(|i| ((i as f32) * 0.37).sin() * (1.0 + (i % width) as f32))
        .collect();
    let mut tensors = vec![
        TensorInput::new(
            TensorSpec {
                name: "hidden_states".into(),
                dtype: Dtype::BF16,
                shape: vec![tokens, 2, width / 2],
            },
            bf16_bytes(&values),
        ),
        TensorInput::new(
            TensorSpec {
                name: "token_ids".into(),
                dtype: Dtype::I64,
                shape: vec![tokens],
            },
            (0..tokens as i64)
                .flat_map(|t| t.to_le_bytes())
                .collect::<Vec<u8>>(),
        ),
    ];
    if let Some((name, dtype)) = extra {
        tensors.push(TensorInput::new(
            TensorSpec {
                name: name.into(),
                dtype,
                shape: vec![tokens],
            },
            vec![0u8; tokens as usize * dtype.size()],
        ));
    }
    let mut metadata = BTreeMap::new();
    metadata.insert("dtype".into(), "bfloat16".into());
    RecordInput {
        key: key.into(),
        tensors,
        metadata,
        num_tokens: tokens as u32,
    }
}

fn lossy_config(codec: Codec) -> WriterConfig {
    WriterConfig {
        codec,
        lossy: Some(Lossy::Fp8E4m3),
        ..Default::default()
    }
}

#[test]
fn hidden_states_are_stored_as_e4m3_with_a_scale_per_token() {
    for codec in Codec::ALL {
        let dir = tempfile::tempdir().unwrap();
        let w = ShardWriter::open(dir.path(), lossy_config(codec)).unwrap();
        let rec = hidden_record("a", 5, 16, None);
        let source = rec.tensors[0].data.bytes().to_vec();
        w.submit(rec).unwrap();
        w.close().unwrap();
        assert_eq!(w.stats().unwrap().inflight_bytes, 0, "{codec:?}");
        let records = read_records(dir.path());
        assert_eq!(records.len(), 1);
        let r = &records[0];
        let names: Vec<&str> = r.tensors.iter().map(|(s, _)| s.name.as_str()).collect();
        assert_eq!(
            names,
            ["hidden_states", "hidden_states_scale", "token_ids"],
            "{codec:?}"
        );
        let (spec, values) = &r.tensors[0];
        assert_eq!(
            (spec.dtype, spec.shape.clone()),
            (Dtype::F8_E4M3, vec![5, 2, 8])
        );
        let (scale_spec, scales) = &r.tensors[1];
        assert_eq!(
            (scale_spec.dtype, scale_spec.shape.clone()),
            (Dtype::F32, vec![5])
        );
        // Exactly what the quantizer makes of the source bytes.
        let want = fp8::quantize(Dtype::BF16, &source, 5).unwrap();
        assert_eq!(values, &want.values);
        assert_eq!(scales, &want.scales);
        assert_eq!(r.metadata["lossy"], "fp8-e4m3");
        assert_eq!(r.metadata["fp8_source_dtype"], "bfloat16");
        for (name, value) in &want.errors {
            assert_eq!(&r.metadata[*name], value);
        }
        let rms: f64 = r.metadata["fp8_rms_rel_err"].parse().unwrap();
        assert!(rms > 0.0 && rms < 0.06, "{rms}");
        // The other tensors as given.
        assert_eq!(
            r.tensors[2].1,
            (0..5i64).flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()
        );
    }
}

#[test]
fn a_record_without_hidden_states_is_stored_as_given() {
    let dir = tempfile::tempdir().unwrap();
    let w = ShardWriter::open(dir.path(), lossy_config(Codec::Zstd)).unwrap();
    let mut plain = record("plain", 3, 8, 1);
    plain.tensors[0].spec.name = "features".into();
    w.submit(plain).unwrap();
    w.close().unwrap();
    let r = &read_records(dir.path())[0];
    assert!(!r.metadata.contains_key("lossy"));
    assert!(r
        .tensors
        .iter()
        .all(|(s, _)| s.name != "hidden_states_scale"));
}

#[test]
fn bad_input_is_refused_at_submit() {
    let dir = tempfile::tempdir().unwrap();
    let w = ShardWriter::open(dir.path(), lossy_config(Codec::Bp16Zstd)).unwrap();
    let mut ints = hidden_record("ints", 2, 4, None);
    ints.tensors[0].spec.dtype = Dtype::I16;
    let with_scales = hidden_record("scaled", 2, 4, Some(("hidden_states_scale", Dtype::F32)));
    for (rec, words) in [(ints, "BF16, F16 or F32"), (with_scales, "has one already")] {
        match w.submit_many(vec![hidden_record("fine", 2, 4, None), rec]) {
            Err(Error::InvalidInput(msg)) => assert!(msg.contains(words), "{msg}"),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(w.stats().unwrap().records_submitted, 0);
    w.close().unwrap();
}

#[test]
fn the_budget_follows_the_stored_length() {
    // A budget of one unquantized record: the records shrink to about half once quantized,
    // and everything they took comes back when they are written.
    let dir = tempfile::tempdir().unwrap();
    let cfg = WriterConfig {
        max_inflight_bytes: 40_000,
        ..lossy_config(Codec::None)
    };
    let w = ShardWriter::open(dir.path(), cfg).unwrap();
    for i in 0..40 {
        w.submit(hidden_record(&format!("r{i}"), 64, 256, None))
            .unwrap();
    }
    w.flush().unwrap();
    let stats = w.stats().unwrap();
    assert_eq!((stats.records_written, stats.inflight_bytes), (40, 0));
    w.close().unwrap();
    assert_eq!(read_records(dir.path()).len(), 40);
}
