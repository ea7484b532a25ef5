"""The scheduler half of the connector: decides, when a request finishes, whether and under
which key its hidden states are saved, keeps its KV blocks until the worker has copied them,
and tells the client where the record goes (``kv_transfer_params``)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from layertap.vllm import registry
from layertap.vllm.config import ConnectorOptions, sample_id_problem
from layertap.vllm.engine import EngineFacts, read_engine_facts
from layertap.vllm.extras import loss_mask_array, record_metadata_problem
from layertap.vllm.metadata import LayertapMetadata, SaveRequest
from layertap.vllm.online import PARAMS_KEY

logger = logging.getLogger("vllm.layertap")  # under vLLM's logging configuration

#: Request kv_transfer_params the connector reads.
REQUEST_KEYS = ("sample_id", "include_output_tokens", "record_metadata", "loss_mask")
#: Finish states whose hidden states are saved: the request ran to its end. Aborted, ignored
#: (prompt too long) and failed requests are not.
_SAVED_STATES = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION")


class SchedulerSide:
    """Everything the connector does in the scheduler (engine core) process."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, options: ConnectorOptions):
        self._setup(read_engine_facts(vllm_config, kv_cache_config, options), options)

    @classmethod
    def from_facts(cls, facts: EngineFacts, options: ConnectorOptions) -> SchedulerSide:
        """A scheduler half for an engine described by ``facts``, without a vLLM configuration
        (benchmarks and tests drive it directly)."""
        side = cls.__new__(cls)
        side._setup(facts, options)
        return side

    def _setup(self, facts: EngineFacts, options: ConnectorOptions) -> None:
        self.options = options
        self.facts = facts
        self._unsent: list[SaveRequest] = []
        self._unsent_lock = threading.Lock()
        self._held: set[str] = set()
        """Requests whose blocks wait for the worker's copy."""
        self._keys: set[str] = set()
        """Keys given out: the writer refuses a key twice."""
        registry.register_scheduler(self.facts.engine_id, self)

    # -- every step ---------------------------------------------------------------------------

    def build_connector_meta(self) -> LayertapMetadata:
        with self._unsent_lock:
            saves, self._unsent = self._unsent, []
        return LayertapMetadata(saves)

    def update_connector_output(self, finished_sending: Any) -> None:
        if finished_sending:
            self._held.difference_update(finished_sending)

    def has_pending_block_frees(self) -> bool:
        """Whether blocks will come back without preempting anything (vLLM 0.32 asks, 0.26 does not)."""
        return bool(self._held)

    def take_unsent(self) -> list[SaveRequest]:
        with self._unsent_lock:
            saves, self._unsent = self._unsent, []
        return saves

    # -- a request finished -------------------------------------------------------------------

    def request_finished(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """Plans the save of a finished request. Returns (keep its blocks, kv_transfer_params)."""
        status = getattr(request.status, "name", str(request.status))
        if status not in _SAVED_STATES:
            # An aborted request has no response to carry an answer; others (a prompt longer
            # than the model, an error) say why nothing was saved.
            if status == "FINISHED_ABORTED":
                return False, None
            return self._refuse(
                request.request_id, "not_saved", f"the request finished as {status}; only completed requests are saved"
            )
        params = request.kv_transfer_params or {}
        req_id = request.request_id
        if not isinstance(params, dict):
            return self._refuse(req_id, "invalid_request", f"kv_transfer_params must be an object, got {params!r}")
        sample_id = params.get("sample_id")
        include_outputs = params.get("include_output_tokens", False)
        if not isinstance(include_outputs, bool):
            return self._refuse(
                req_id, "invalid_request", f"include_output_tokens must be true or false, got {include_outputs!r}"
            )
        if sample_id is not None:
            problem = sample_id_problem(sample_id)
            if problem:
                return self._refuse(req_id, "invalid_request", problem)
            key = sample_id
        else:
            key = req_id
        if key in self._keys:
            what = "sample_id" if sample_id is not None else "request id"
            return self._refuse(
                req_id,
                "invalid_request",
                f"{what} {key!r} was used by an earlier request; this engine's writer takes each key once",
            )
        record_metadata = params.get("record_metadata")
        if record_metadata is not None:
            problem = record_metadata_problem(record_metadata)
            if problem:
                return self._refuse(req_id, "invalid_request", problem)
        if include_outputs:
            # The last token was sampled, never fed back: the cache has no hidden states for it.
            token_ids = list(request.all_token_ids)[:-1]
        else:
            token_ids = request.prompt_token_ids
        if not token_ids:
            return self._refuse(req_id, "not_saved", "the request has no token ids (prompt embeddings?)")
        num_tokens = len(token_ids)
        loss_mask = None
        if params.get("loss_mask") is not None:
            num_prompt = int(request.num_prompt_tokens)
            loss_mask, problem = loss_mask_array(params["loss_mask"], num_prompt, num_tokens - num_prompt)
            if problem:
                return self._refuse(req_id, "invalid_request", problem)
        gid = self.facts.group_id
        blocks = block_ids[gid] if 0 <= gid < len(block_ids) else []
        if len(blocks) * self.facts.block_size < num_tokens:
            return self._refuse(
                req_id,
                "not_saved",
                f"only {len(blocks) * self.facts.block_size} of {num_tokens} tokens are in the KV cache",
            )
        self._keys.add(key)
        save = SaveRequest(
            req_id=req_id,
            key=key,
            token_ids=np.asarray(token_ids, dtype=np.int64),
            block_ids=list(blocks[: -(-num_tokens // self.facts.block_size)]),
            num_prompt_tokens=int(request.num_prompt_tokens),
            record_metadata=dict(record_metadata) if record_metadata else None,
            loss_mask=loss_mask,
        )
        with self._unsent_lock:
            self._unsent.append(save)
        self._held.add(req_id)
        return True, {
            PARAMS_KEY: {
                "dataset": self.options.output_dir,
                "writer_id": self.facts.writer_id,
                "key": key,
                "num_tokens": num_tokens,
            }
        }

    def _refuse(self, req_id: str, reason: str, message: str) -> tuple[bool, dict]:
        logger.warning("layertap: hidden states of request %s not saved: %s", req_id, message)
        return False, {PARAMS_KEY: {"error": message, "reason": reason}}
