"""The checks of a client's per-request additions, ``record_metadata`` and ``loss_mask``
(docs/CONNECTOR.md, "Per request"). Nothing here imports vLLM.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from layertap._spec.record import CONNECTOR_METADATA  # a client may not set them

#: Caller metadata per record is kept small: it travels with every request and lands in every
#: record's header.
MAX_RECORD_METADATA_BYTES = 64 << 10


def record_metadata_problem(value: Any) -> str | None:
    """Why ``value`` cannot be a request's ``record_metadata``, or None."""
    if not isinstance(value, dict):
        return f"record_metadata must be an object of strings, got {type(value).__name__}"
    size = 0
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            return f"record_metadata entry {k!r}: {v!r:.80}: names and values must be strings"
        if k in CONNECTOR_METADATA:
            return f"record_metadata may not set {k!r}: the connector writes it ({', '.join(CONNECTOR_METADATA)})"
        try:
            size += len(k.encode()) + len(v.encode())
        except UnicodeEncodeError:
            return f"record_metadata entry {k!r}: not valid UTF-8 (a lone surrogate)"
    if size > MAX_RECORD_METADATA_BYTES:
        return f"record_metadata holds {size} bytes; the limit is {MAX_RECORD_METADATA_BYTES}"
    return None


def loss_mask_array(value: Any, num_prompt_tokens: int, num_output_tokens: int) -> tuple[np.ndarray | None, str | None]:
    """The record's ``loss_mask`` (uint8 per recorded token) from a request's (one per prompt
    token: what a client knows when it sends it), or the problem; output tokens get 1."""
    if not isinstance(value, (list, tuple)):
        return None, f"loss_mask must be a list of 0 and 1, got {type(value).__name__}"
    if len(value) != num_prompt_tokens:
        return None, (f"loss_mask has {len(value)} entries; it needs one per prompt token ({num_prompt_tokens})")
    try:
        mask = np.array(value)
    except (ValueError, TypeError, OverflowError):
        mask = None
    if mask is None or mask.ndim != 1 or mask.dtype.kind not in "biu" or ((mask != 0) & (mask != 1)).any():
        return None, "loss_mask entries must be 0 or 1 (or false and true)"
    if num_output_tokens:
        mask = np.concatenate([mask.astype(np.uint8, copy=False), np.ones(num_output_tokens, np.uint8)])
    return mask.astype(np.uint8, copy=False), None
