"""What the scheduler half tells the worker half each step: the requests to save."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class SaveRequest:
    """One finished request whose hidden states are to be written."""

    req_id: str
    key: str
    """The record key: the client's ``sample_id``, else the request id."""
    token_ids: np.ndarray
    """int64, one per token saved (prompt, plus outputs but the last with include_output_tokens)."""
    block_ids: list[int]
    """The request's blocks of the hidden-states group, enough for ``token_ids``."""
    num_prompt_tokens: int
    record_metadata: dict[str, str] | None = None
    """The client's ``record_metadata``, checked (``extras.py``)."""
    loss_mask: np.ndarray | None = None
    """uint8 0/1, one per token saved, from the client's ``loss_mask`` (``extras.py``)."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class LayertapMetadata(KVConnectorMetadata):
    """Scheduler to worker, once per step: the requests finished since the last step."""

    saves: list[SaveRequest] = field(default_factory=list)
