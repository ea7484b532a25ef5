//! What callers hand the writer: records made of tensor descriptions and the buffers holding
//! their bytes, and the checks a record passes before anything is queued.

use crate::blob::{self, TensorSpec};
use crate::error::{Error, Result};
use crate::fp8::{self, Lossy};
use crate::names;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Memory holding one tensor's bytes, owned by the writer until the record is written.
///
/// The writer reads the bytes from its own threads and, on the `none` path, hands their address
/// to the kernel, so an implementation MUST return the same memory from every call of `bytes`
/// for as long as the value lives, and that memory must not be modified while the writer holds
/// the value. The writer drops the value (on one of its threads) once the record's bytes are
/// written, or when it gives up on the record.
pub trait RecordBuffer: Send + 'static {
    /// The tensor's bytes, C order, little-endian elements.
    fn bytes(&self) -> &[u8];
}

impl RecordBuffer for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

impl RecordBuffer for Box<[u8]> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

impl RecordBuffer for Arc<[u8]> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

impl RecordBuffer for Arc<Vec<u8>> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

impl RecordBuffer for &'static [u8] {
    fn bytes(&self) -> &[u8] {
        self
    }
}

/// One tensor of a record: its name, dtype and shape, and its bytes.
pub struct TensorInput {
    /// Name, dtype, shape.
    pub spec: TensorSpec,
    /// The bytes; their length must be what `spec` needs.
    pub data: Box<dyn RecordBuffer>,
}

impl TensorInput {
    /// A tensor from a spec and any buffer.
    pub fn new(spec: TensorSpec, data: impl RecordBuffer) -> TensorInput {
        TensorInput {
            spec,
            data: Box::new(data),
        }
    }
}

impl std::fmt::Debug for TensorInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorInput")
            .field("spec", &self.spec)
            .field("bytes", &self.data.bytes().len())
            .finish()
    }
}

/// One record to write.
#[derive(Debug)]
pub struct RecordInput {
    /// The record key (docs/FORMAT.md, "Keys"); unique for the writer's lifetime.
    pub key: String,
    /// The tensors, in the order they are stored.
    pub tensors: Vec<TensorInput>,
    /// Extra `__metadata__` entries; may not set `key`, which the writer sets.
    pub metadata: BTreeMap<String, String>,
    /// Tokens in the record (the length of `token_ids`), 0 if none.
    pub num_tokens: u32,
}

/// A checked record: its blob header is built, its length known; or, for a lossy writer, a
/// record whose `hidden_states` the compression thread quantizes first (`lossy`), which then
/// builds the header and knows the length.
pub(crate) struct Prepared {
    pub key: String,
    pub blob_header: Vec<u8>,
    pub tensors: Vec<TensorInput>,
    /// Whether each tensor has 2-byte elements (for `bp16-zstd`).
    pub two_byte: Vec<bool>,
    pub num_tokens: u32,
    /// Length of the decoded payload: blob header plus tensor bytes. For a record still to be
    /// quantized, its length as given, which is what it takes from the budget until then.
    pub raw_len: u64,
    /// The quantization still to do, and the metadata the header is built from then.
    pub lossy: Option<LossyPlan>,
}

/// What the lossy stage does to a prepared record (`super::lossy`).
pub(crate) struct LossyPlan {
    pub lossy: Lossy,
    /// Index of `hidden_states` among the tensors.
    pub index: usize,
    /// The record's metadata, `key` included.
    pub metadata: BTreeMap<String, String>,
}

/// Records checked and with their headers built, not yet queued
/// ([`super::ShardWriter::prepare_many`]).
pub struct PreparedBatch {
    pub(crate) records: Vec<Prepared>,
}

impl PreparedBatch {
    /// Records in the batch.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether the batch holds no record.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The bytes the batch takes from the writer's budget: its records' decoded lengths.
    pub fn raw_len(&self) -> u64 {
        self.records.iter().map(|r| r.raw_len).sum()
    }
}

/// Checks a record and builds its safetensors header (for a lossy writer, the checks only:
/// the header is built once `hidden_states` is quantized). Nothing about the writer's state is
/// looked at here (duplicate keys are checked by the writer).
pub(crate) fn prepare(rec: RecordInput, lossy: Option<Lossy>) -> Result<Prepared> {
    let RecordInput {
        key,
        tensors,
        mut metadata,
        num_tokens,
    } = rec;
    names::check_key(&key)?;
    if metadata.contains_key("key") {
        return Err(Error::invalid(format!(
            "record {key:?}: metadata may not set \"key\"; the writer stores the record key there"
        )));
    }
    let specs: Vec<&TensorSpec> = tensors.iter().map(|t| &t.spec).collect();
    metadata.insert("key".into(), key.clone());
    let blob_header = blob::build_header_of(&specs, &metadata)
        .map_err(|e| Error::invalid(format!("record {key:?}: {}", strip_prefix(e))))?;
    let mut raw_len = blob_header.len() as u64;
    for t in &tensors {
        let want = t.spec.byte_len()?;
        let got = t.data.bytes().len() as u64;
        if got != want {
            return Err(Error::invalid(format!(
                "record {key:?}: tensor {:?} has {got} bytes but {} {:?} needs {want}",
                t.spec.name, t.spec.dtype, t.spec.shape
            )));
        }
        raw_len += got;
    }
    let plan = match lossy {
        Some(lossy) => lossy_plan(&key, &tensors, lossy, metadata)?,
        None => None,
    };
    let two_byte = tensors.iter().map(|t| t.spec.dtype.is_two_byte()).collect();
    Ok(Prepared {
        key,
        blob_header: if plan.is_some() {
            Vec::new()
        } else {
            blob_header
        },
        tensors,
        two_byte,
        num_tokens,
        raw_len,
        lossy: plan,
    })
}

/// What a lossy writer will do to a record: quantize its `hidden_states`, if it has one (a
/// record without is stored as given, as the Python writers do).
fn lossy_plan(
    key: &str,
    tensors: &[TensorInput],
    lossy: Lossy,
    metadata: BTreeMap<String, String>,
) -> Result<Option<LossyPlan>> {
    let Some(index) = tensors.iter().position(|t| t.spec.name == fp8::QUANTIZED) else {
        return Ok(None);
    };
    let spec = &tensors[index].spec;
    let name = lossy.name();
    if !fp8::quantizable(spec.dtype) {
        return Err(Error::invalid(format!(
            "record {key:?}: lossy={name:?} needs hidden_states as BF16, F16 or F32, not {:?}",
            spec.dtype
        )));
    }
    if spec.shape.is_empty() {
        return Err(Error::invalid(format!(
            "record {key:?}: lossy={name:?} needs hidden_states with a token axis"
        )));
    }
    if tensors.iter().any(|t| t.spec.name == fp8::SCALE_NAME) {
        return Err(Error::invalid(format!(
            "record {key:?}: lossy={name:?} adds a tensor {:?}; the record has one already",
            fp8::SCALE_NAME
        )));
    }
    Ok(Some(LossyPlan {
        lossy,
        index,
        metadata,
    }))
}

fn strip_prefix(e: Error) -> String {
    match e {
        Error::InvalidInput(msg) => msg,
        other => other.to_string(),
    }
}
