//! The compression threads' lossy stage (`WriterConfig::lossy`): quantizes a prepared record's
//! `hidden_states` ([`crate::fp8`]), puts the scales tensor after it, adds the error statistics
//! to the metadata and builds the header the record is stored with. On the compression threads,
//! not the submitting one: the vLLM connector submits from the engine thread. The fp8 values
//! go into a buffer of the writer's [`OutPool`], recycled like the encoded payloads.

use super::input::{LossyPlan, Prepared, TensorInput};
use super::out_pool::OutPool;
use crate::blob::{self, TensorSpec};
use crate::dtype::Dtype;
use crate::error::Result;
use crate::fp8;
use std::sync::Arc;

/// Applies `rec`'s lossy plan, if it has one; afterwards `rec.raw_len` is its stored length.
pub(crate) fn apply(rec: &mut Prepared, pool: &Arc<OutPool>) -> Result<()> {
    let Some(LossyPlan {
        lossy,
        index,
        mut metadata,
    }) = rec.lossy.take()
    else {
        return Ok(());
    };
    let source = &rec.tensors[index];
    let tokens = source.spec.shape[0];
    let data = source.data.bytes();
    // One byte per element.
    let values = pool.take(data.len() / source.spec.dtype.size());
    let quantized = fp8::quantize_into(
        source.spec.dtype,
        data,
        usize::try_from(tokens).unwrap_or(usize::MAX),
        values,
    )?;
    let values = TensorSpec {
        dtype: Dtype::F8_E4M3,
        ..source.spec.clone()
    };
    let scales = TensorSpec {
        name: fp8::SCALE_NAME.into(),
        dtype: Dtype::F32,
        shape: vec![tokens],
    };
    // The caller's buffer is released here, before the record is compressed.
    rec.tensors[index] = TensorInput::new(values, quantized.values);
    rec.tensors
        .insert(index + 1, TensorInput::new(scales, quantized.scales));
    if let Some(dtype) = metadata.get("dtype").cloned() {
        metadata.insert("fp8_source_dtype".into(), dtype);
    }
    metadata.insert("lossy".into(), lossy.name().into());
    for (name, value) in quantized.errors {
        metadata.insert(name.into(), value);
    }
    let specs: Vec<&TensorSpec> = rec.tensors.iter().map(|t| &t.spec).collect();
    rec.blob_header = blob::build_header_of(&specs, &metadata)?;
    rec.raw_len = rec.blob_header.len() as u64
        + rec
            .tensors
            .iter()
            .map(|t| t.data.bytes().len() as u64)
            .sum::<u64>();
    rec.two_byte = rec
        .tensors
        .iter()
        .map(|t| t.spec.dtype.is_two_byte())
        .collect();
    Ok(())
}
