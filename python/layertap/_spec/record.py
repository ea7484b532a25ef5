"""The hidden-states record (docs/RECORD.md): the names of its tensors and metadata members, the
one place in Python that spells them (the Rust twin is ``rust/core/src/record.rs``). Decoding a
record's stored payload is the core's: ``layertap._decoder`` (the Rust core, or the Python
reference's ``_py/decode.py``)."""

from __future__ import annotations

#: The hidden states of the saved layers: ``[tokens, layers, hidden]`` in the engine's dtype, or
#: ``F8_E4M3`` beside ``hidden_states_scale`` in a lossy record (docs/FP8.md).
HIDDEN_STATES = "hidden_states"
#: The tokens' ids: ``I64 [tokens]``.
TOKEN_IDS = "token_ids"
#: Which tokens a trainer learns from (1) or not (0): ``U8 [tokens]``, when the client sent one.
LOSS_MASK = "loss_mask"

#: Metadata: the record key, set by the writer (docs/FORMAT.md, "Keys").
KEY = "key"
#: Metadata: the saved layers in vLLM's numbering, a JSON list of ints (``"[2, 16, 29]"``).
LAYER_IDS = "layer_ids"
#: Metadata: the model's name or path as the engine was given it.
MODEL = "model"
#: Shard metadata: ``user["source"]`` of every shard ``layertap generate`` writes. Here, not in
#: ``layertap.generate``, so that ``verify`` can tell such shards apart without importing it.
GENERATE_SOURCE = "layertap.generate"
#: Metadata: the engine's dtype as torch names it, without ``torch.`` (``"bfloat16"``).
DTYPE = "dtype"
#: Metadata: tokens in the record, a decimal string.
NUM_TOKENS = "num_tokens"
#: Metadata: vLLM's id of the request.
REQUEST_ID = "request_id"
#: Metadata: how many of the record's tokens are the prompt's, a decimal string.
NUM_PROMPT_TOKENS = "num_prompt_tokens"

#: Metadata of a record of a capture window (docs/CONNECTOR.md, "Windows and reductions"): the
#: first position it holds and the one past its last, decimal strings ...
WINDOW_START = "window_start"
WINDOW_END = "window_end"
#: ... and, for a reduced record (one row), how the window was reduced: ``"last"`` or ``"mean"``.
REDUCTION = "reduction"

#: The metadata members the connector writes, which a client's ``record_metadata`` may not set.
CONNECTOR_METADATA = (
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
)
