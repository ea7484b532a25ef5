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
    finished_at: float = 0.0
    """When the scheduler saw the request end (``time.time()``: the worker may be another
    process, or with Ray another host); 0: unknown. For the record delay metric."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class LayertapMetadata(KVConnectorMetadata):
    """Scheduler to worker, once per step: the requests finished since the last step."""

    saves: list[SaveRequest] = field(default_factory=list)
    drain_wait: float = 0.0
    """Seconds the worker may wait for its writer this step: set when the engine steps only
    because records are still being written (``SchedulerCounters``), so that those steps do
    not spin."""
