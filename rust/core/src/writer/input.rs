//! What callers hand the writer: records made of tensor descriptions and the buffers holding
//! their bytes, and the checks a record passes before anything is queued.

use crate::blob::{self, TensorSpec};
use crate::error::{Error, Result};
use crate::exphuf;
use crate::format::Codec;
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
    /// The bytes; their length must be what `spec` needs, unless the tensor is given encoded.
    pub data: Box<dyn RecordBuffer>,
    /// `data` holds the tensor's exp-huf block (docs/FORMAT.md, "Codec 3"), encoded by the
    /// caller, not its bytes ([`TensorInput::exphuf_block`]).
    encoded: bool,
}

impl TensorInput {
    /// A tensor from a spec and any buffer.
    pub fn new(spec: TensorSpec, data: impl RecordBuffer) -> TensorInput {
        TensorInput {
            spec,
            data: Box::new(data),
            encoded: false,
        }
    }

    /// A floating tensor (`BF16`, `F16`, `F32`) given as its exp-huf block, already encoded by
    /// the caller (the GPU encoder, `layertap.gpu.exphuf`, runs before the copy to the host).
    /// The writer stores the block as it is, so it needs a writer of codec `exp-huf`, and a
    /// record with one such tensor has all its floating tensors given so. Its framing is
    /// checked at submission ([`crate::exphuf::check_block`]); its streams are not decoded,
    /// which is what saves the host's CPU: the frame's CRC covers them from then on, and
    /// `layertap verify` decodes them.
    pub fn exphuf_block(spec: TensorSpec, block: impl RecordBuffer) -> TensorInput {
        TensorInput {
            spec,
            data: Box::new(block),
            encoded: true,
        }
    }

    /// Whether `data` holds an exp-huf block rather than the tensor's bytes.
    pub fn is_encoded(&self) -> bool {
        self.encoded
    }
}

impl std::fmt::Debug for TensorInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorInput")
            .field("spec", &self.spec)
            .field("bytes", &self.data.bytes().len())
            .field("encoded", &self.encoded)
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
    /// For a record whose floating tensors came encoded ([`TensorInput::exphuf_block`]): its
    /// stored length (the blob header, then each tensor's data as given), which the worker
    /// only checksums.
    pub encoded_len: Option<u64>,
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
pub(crate) fn prepare(rec: RecordInput, lossy: Option<Lossy>, codec: Codec) -> Result<Prepared> {
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
    let encoded_len = if tensors.iter().any(|t| t.encoded) {
        Some(check_encoded(&key, &tensors, lossy, codec)? + blob_header.len() as u64)
    } else {
        None
    };
    let mut raw_len = blob_header.len() as u64;
    for t in &tensors {
        let want = t.spec.byte_len()?;
        let got = t.data.bytes().len() as u64;
        if t.encoded {
            raw_len += want;
            continue;
        }
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
        encoded_len,
    })
}

/// Checks a record given with encoded tensors (see [`TensorInput::exphuf_block`]) and returns
/// the bytes its tensors' data take as given.
fn check_encoded(
    key: &str,
    tensors: &[TensorInput],
    lossy: Option<Lossy>,
    codec: Codec,
) -> Result<u64> {
    if codec != Codec::ExpHuf {
        return Err(Error::invalid(format!(
            "record {key:?}: tensors given as exp-huf blocks need a writer of codec \"exp-huf\", not {:?}",
            codec.name()
        )));
    }
    if let Some(lossy) = lossy {
        return Err(Error::invalid(format!(
            "record {key:?}: a writer with lossy={:?} quantizes the tensors itself; give them as they are, not as exp-huf blocks",
            lossy.name()
        )));
    }
    let mut stored = 0u64;
    for t in tensors {
        let (name, dtype) = (&t.spec.name, t.spec.dtype);
        let coded = exphuf::is_coded(dtype);
        if coded && !t.encoded {
            return Err(Error::invalid(format!(
                "record {key:?}: tensor {name:?} ({dtype:?}) is given as it is beside tensors given as exp-huf blocks; give every floating tensor of the record as a block"
            )));
        }
        if t.encoded {
            if !coded {
                return Err(Error::invalid(format!(
                    "record {key:?}: tensor {name:?} is {dtype:?}, which exp-huf stores as it is; give its bytes, not a block"
                )));
            }
            let elements =
                usize::try_from(t.spec.byte_len()? / dtype.size() as u64).map_err(|_| {
                    Error::invalid(format!("record {key:?}: tensor {name:?} is too large"))
                })?;
            exphuf::check_block(t.data.bytes(), dtype, elements).map_err(|e| {
                Error::invalid(format!(
                    "record {key:?}: tensor {name:?}: exp-huf block: {e}"
                ))
            })?;
        }
        stored += t.data.bytes().len() as u64;
    }
    Ok(stored)
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
