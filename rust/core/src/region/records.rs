//! The records of a region: each request's hidden states and token ids as slices of the pool,
//! and its metadata, named as `crate::record` says (docs/RECORD.md).

use super::leases::Lease;
use super::pool::{Pool, PoolSlice};
use crate::blob::TensorSpec;
use crate::dtype::Dtype;
use crate::record;
use crate::writer::{RecordInput, TensorInput};
use std::collections::BTreeMap;
use std::sync::Arc;

/// A record's extras from its client: metadata entries and a loss mask.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Extras {
    /// Entries added to the record's metadata (the scheduler half refused any that would
    /// replace the connector's own, `record::CONNECTOR_METADATA`).
    pub metadata: BTreeMap<String, String>,
    /// The `loss_mask` tensor's bytes (`U8`, one per byte).
    pub loss_mask: Option<Vec<u8>>,
}

/// One request of a step: its key and what its metadata says about it.
#[derive(Debug, Clone)]
pub struct Request {
    /// The record key.
    pub key: String,
    /// vLLM's request id.
    pub request_id: String,
    /// Tokens in the record.
    pub num_tokens: u64,
    /// How many of them are the prompt's.
    pub num_prompt_tokens: u64,
    /// The client's extras, if it sent any.
    pub extras: Option<Extras>,
}

/// What every record of one engine shares: the hidden states' dtype and row shape, and the
/// metadata template.
#[derive(Debug, Clone)]
pub(crate) struct RecordShape {
    pub dtype: Dtype,
    /// Shape of one token's hidden states (`[layers, hidden]`).
    pub row_shape: Vec<u64>,
    /// Bytes of one token's hidden states.
    pub row_bytes: usize,
    /// The connector's per-engine metadata (`layer_ids`, `model`, `dtype`).
    pub metadata: BTreeMap<String, String>,
}

/// Where a region's records lie in the pool.
pub(crate) struct RegionSlices<'a> {
    pub pool: &'a Arc<Pool>,
    pub lease: &'a Arc<Lease>,
    pub hidden_offset: usize,
    pub ids_offset: usize,
}

impl RecordShape {
    /// The record of `req`, tokens `[at, at + num_tokens)` of the region (which `submit` checked
    /// lie within it; `PoolSlice::new` holds that).
    pub fn record(&self, region: &RegionSlices<'_>, at: usize, req: &Request) -> RecordInput {
        let n = req.num_tokens;
        let len = n as usize;
        let mut metadata = self.metadata.clone();
        metadata.insert(record::NUM_TOKENS.into(), n.to_string());
        metadata.insert(record::REQUEST_ID.into(), req.request_id.clone());
        metadata.insert(
            record::NUM_PROMPT_TOKENS.into(),
            req.num_prompt_tokens.to_string(),
        );
        let slice = |start: usize, len: usize| {
            PoolSlice::new(region.pool.clone(), region.lease.clone(), start, len)
        };
        let mut shape = Vec::with_capacity(1 + self.row_shape.len());
        shape.push(n);
        shape.extend_from_slice(&self.row_shape);
        let mut tensors = vec![
            TensorInput::new(
                TensorSpec {
                    name: record::HIDDEN_STATES.into(),
                    dtype: self.dtype,
                    shape,
                },
                slice(
                    region.hidden_offset + at * self.row_bytes,
                    len * self.row_bytes,
                ),
            ),
            TensorInput::new(
                TensorSpec {
                    name: record::TOKEN_IDS.into(),
                    dtype: Dtype::I64,
                    shape: vec![n],
                },
                slice(region.ids_offset + at * 8, len * 8),
            ),
        ];
        if let Some(extras) = &req.extras {
            metadata.extend(extras.metadata.iter().map(|(k, v)| (k.clone(), v.clone())));
            if let Some(mask) = &extras.loss_mask {
                tensors.push(TensorInput::new(
                    TensorSpec {
                        name: record::LOSS_MASK.into(),
                        dtype: Dtype::U8,
                        shape: vec![mask.len() as u64],
                    },
                    mask.clone(),
                ));
            }
        }
        RecordInput {
            key: req.key.clone(),
            tensors,
            metadata,
            num_tokens: u32::try_from(n).unwrap_or(u32::MAX),
        }
    }
}
