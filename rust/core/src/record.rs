//! The hidden-states record (docs/RECORD.md): the names of its tensors and of its `__metadata__`
//! members, the one place in the core that spells them. The Python twin is
//! `layertap._spec.record`; `tests/vectors` checks that both agree with what the writers make.
//!
//! A record of the vLLM connector (and of `layertap generate`) holds:
//! - [`HIDDEN_STATES`]: `[tokens, layers, hidden]` in the engine's dtype (`BF16`, `F16`, `F32`),
//!   or `F8_E4M3` with [`crate::fp8::SCALE_NAME`] beside it when the writer is lossy;
//! - [`TOKEN_IDS`]: `I64 [tokens]`;
//! - [`LOSS_MASK`]: `U8 [tokens]`, only when the request's client sent one;
//!
//! and the metadata members [`KEY`] (the writer's), [`LAYER_IDS`], [`MODEL`], [`DTYPE`] (the
//! connector's per-engine template), [`NUM_TOKENS`], [`REQUEST_ID`], [`NUM_PROMPT_TOKENS`] (per
//! record), then the client's own entries, which may not replace any of these.

/// The hidden states of the saved layers, one row `[layers, hidden]` per token.
pub const HIDDEN_STATES: &str = "hidden_states";
/// The tokens' ids, `I64 [tokens]`.
pub const TOKEN_IDS: &str = "token_ids";
/// Which tokens a trainer learns from, `U8 [tokens]` (1: learn), when the client sent one.
pub const LOSS_MASK: &str = "loss_mask";

/// Metadata: the record key (docs/FORMAT.md, "Keys"), set by the writer.
pub const KEY: &str = "key";
/// Metadata: the saved layers in vLLM's numbering, a JSON list of ints (`[2, 16, 29]`).
pub const LAYER_IDS: &str = "layer_ids";
/// Metadata: the model's name as the engine was given it.
pub const MODEL: &str = "model";
/// Metadata: the engine's dtype, torch's name without `torch.` (`bfloat16`).
pub const DTYPE: &str = "dtype";
/// Metadata: tokens in the record, decimal.
pub const NUM_TOKENS: &str = "num_tokens";
/// Metadata: vLLM's id of the request.
pub const REQUEST_ID: &str = "request_id";
/// Metadata: how many of the record's tokens are the prompt's, decimal.
pub const NUM_PROMPT_TOKENS: &str = "num_prompt_tokens";
/// Metadata of a capture window's record: its first position, decimal.
pub const WINDOW_START: &str = "window_start";
/// Metadata of a capture window's record: the position past its last, decimal.
pub const WINDOW_END: &str = "window_end";
/// Metadata of a reduced record (one row): `last` or `mean`.
pub const REDUCTION: &str = "reduction";

/// The metadata members the connector writes, which a client's entries may not replace.
pub const CONNECTOR_METADATA: [&str; 10] = [
    KEY,
    LAYER_IDS,
    MODEL,
    DTYPE,
    NUM_TOKENS,
    REQUEST_ID,
    NUM_PROMPT_TOKENS,
    WINDOW_START,
    WINDOW_END,
    REDUCTION,
];
