"""The scheduler half of the connector: decides, when a request finishes, whether and under
which key its hidden states are saved, keeps its KV blocks until the worker has copied them,
and tells the client where the record goes (``kv_transfer_params``)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from vllm.v1.request import RequestStatus

from layertap._keys import KeyWindow
from layertap.vllm import registry
from layertap.vllm import window as capture_window
from layertap.vllm.config import ConnectorOptions, sample_id_problem
from layertap.vllm.engine_facts import EngineFacts, read_engine_facts
from layertap.vllm.extras import loss_mask_array, record_metadata_problem
from layertap.vllm.metadata import LayertapMetadata, StepSaves
from layertap.vllm.models.conv_state import method_generated_rows_problem
from layertap.vllm.online import PARAMS_KEY
from layertap.vllm.stats import DRAIN_WAIT, SchedulerStats

logger = logging.getLogger("vllm.layertap")  # under vLLM's logging configuration

#: The reason counted for a request not saved because it did not ask (the ``save`` option).
NOT_REQUESTED = "not_requested"
#: Finish states whose hidden states are saved: the request ran to its end. Aborted, ignored
#: (prompt too long) and failed requests are not.
_SAVED_STATES = frozenset(("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION"))


#: The same as ``RequestStatus`` members (an IntEnum: a set lookup without a Python call).
_SAVED_STATUSES = frozenset(getattr(RequestStatus, n) for n in _SAVED_STATES if hasattr(RequestStatus, n))


def _generated_rows_problem(vllm_config: Any, options: ConnectorOptions) -> str | None:
    """The refusal for requests asking for generated tokens where this engine would record them
    wrong (``models.conv_state``); their prompts alone are recorded right."""
    from vllm.platforms import current_platform

    return method_generated_rows_problem(
        getattr(vllm_config.model_config, "architectures", None) or [],
        options.capture,
        True,
        current_platform.is_cpu(),
        capture_option='capture="in-model" (kv_connector_extra_config)',
        prompts_only="send the request without include_output_tokens (its prompt tokens only)",
    )


class SchedulerSide:
    """Everything the connector does in the scheduler (engine core) process.

    Per finished request it checks the request, appends a few entries to the step's
    ``StepSaves`` and answers with the record's location; per step it hands the ``StepSaves``
    over as it is. No object per request besides the answer vLLM asks for, and nothing per
    request at the end of a step (``update_connector_output`` counts)."""

    def __init__(
        self, vllm_config: Any, kv_cache_config: Any, options: ConnectorOptions, facts: EngineFacts | None = None
    ):
        self.options = options
        self.facts = facts = facts or read_engine_facts(vllm_config, kv_cache_config, options)
        self._unsent = StepSaves()
        self._unsent_lock = threading.Lock()
        self._held = 0  # requests whose blocks wait for the worker's copy
        self.keys = KeyWindow(options.key_memory)
        """Keys given out lately: the writer refuses a key twice (docs/CONNECTOR.md)."""
        self._location = {"dataset": options.output_dir, "writer_id": facts.writer_id}
        if options.mooncake is not None:
            self._location["store"] = options.mooncake.split("?", 1)[0]  # fetch reads it from there
        self.stats = SchedulerStats()
        self._requested_only = options.save == "requested"
        self._outputs_refused = None if vllm_config is None else _generated_rows_problem(vllm_config, options)
        if self._outputs_refused:
            logger.warning("layertap: requests with include_output_tokens will not be saved: %s", self._outputs_refused)
        registry.register_scheduler(facts.engine_id, self)

    @classmethod
    def from_facts(cls, facts: EngineFacts, options: ConnectorOptions) -> SchedulerSide:
        """Without a vLLM configuration (benchmarks and tests drive it directly)."""
        return cls(None, None, options, facts)

    # -- every step ---------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any = None) -> LayertapMetadata:
        saves = self.take_unsent()
        # The worker's statistics hold the requests not saved; vLLM steps the engine once more
        # after a request finishes (to tell the workers), so the last ones reach it too.
        not_saved = self.stats.not_saved_totals()
        if saves:
            return LayertapMetadata(saves, not_saved=not_saved)
        metadata = LayertapMetadata(not_saved=not_saved)
        if getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0 and self.stats.writing():
            metadata.drain_wait = DRAIN_WAIT  # a step taken only for the writer (has_pending_push_work)
        return metadata

    def update_connector_output(self, finished_sending: Any) -> None:
        if finished_sending:
            # Each held request is reported once (get_finished_count() == 1).
            self._held = max(0, self._held - len(finished_sending))

    def has_pending_block_frees(self) -> bool:
        """Whether blocks will come back without preempting anything (vLLM 0.32 asks, 0.26 does not)."""
        return self._held > 0

    def take_unsent(self) -> StepSaves:
        with self._unsent_lock:
            saves, self._unsent = self._unsent, StepSaves()
        return saves

    # -- a request finished -------------------------------------------------------------------

    def request_finished(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """Plans the save of a finished request. Returns (keep its blocks, kv_transfer_params)."""
        status = request.status
        completed = status in _SAVED_STATUSES or getattr(status, "name", status) in _SAVED_STATES
        if not completed and getattr(status, "name", status) == "FINISHED_ABORTED":
            return False, None  # no response carries an answer, and nothing is counted
        req_id = request.request_id
        params = request.kv_transfer_params
        if self._requested_only or (isinstance(params, dict) and "save" in params):
            unwanted = self._unwanted(req_id, params)
            if unwanted is not None:
                return unwanted
        if not completed:
            # Others (a prompt longer than the model, an error) say why nothing was saved.
            return self._refuse(
                req_id,
                "not_saved",
                f"the request finished as {getattr(status, 'name', status)}; only completed requests are saved",
            )
        extras = window_spec = None
        if params:
            checked = self._check_params(request, params)
            if isinstance(checked[0], bool):
                return checked  # a refusal
            key, include_outputs, extras, window_spec = checked
        else:
            key, include_outputs = req_id, False
        if include_outputs:
            # The last token was sampled, never fed back: the cache has no hidden states for it.
            num_tokens = request.num_tokens - 1
            token_ids = request.all_token_ids[:num_tokens]  # a list (slicing vLLM's ConstantList)
        else:
            token_ids = request.prompt_token_ids
            num_tokens = len(token_ids) if token_ids is not None else 0
        if num_tokens <= 0:
            return self._refuse(req_id, "not_saved", "the request has no token ids (prompt embeddings?)")
        if type(token_ids) is not list:
            token_ids = list(token_ids)
        facts = self.facts
        blocks = block_ids[facts.group_id] if facts.group_id < len(block_ids) else ()
        if len(blocks) * facts.block_size < num_tokens:
            return self._refuse(
                req_id,
                "not_saved",
                f"only {len(blocks) * facts.block_size} of {num_tokens} tokens are in the KV cache",
            )
        mask = None
        if extras is not None and extras[1] is not None:
            num_prompt = request.num_prompt_tokens
            mask, problem = loss_mask_array(extras[1], num_prompt, num_tokens - num_prompt)
            if problem:
                return self._refuse(req_id, "invalid_request", problem)
        window = None
        if window_spec is not None:
            window, problem = capture_window.resolve(window_spec, num_tokens)
            if problem:
                return self._refuse(req_id, "invalid_request", problem)
            token_ids = capture_window.stored_token_ids(token_ids, window)
            num_tokens = len(token_ids)
            if mask is not None:
                mask = mask[window[0] : window[1]]
            meta = dict(extras[0] or {}) if extras is not None else {}
            meta.update(capture_window.metadata(window))
            extras = (meta, None)
        if mask is not None:
            extras = (extras[0], mask.tobytes())
        if not self.keys.add_new(key):
            what = "sample_id" if key is not req_id else "request id"
            return self._refuse(
                req_id,
                "invalid_request",
                f"{what} {key!r} was used by an earlier request; this engine's writer takes each key once",
            )
        with self._unsent_lock:
            unsent = self._unsent
            if not unsent.keys:
                unsent.finished_at = time.time()  # one clock read per step, for the record delay
            unsent.add(key, req_id, token_ids, num_tokens, request.num_prompt_tokens, blocks, extras, window)
        self._held += 1
        self.stats.accepted()
        # fetch checks that the record it reads is this request's (request_id).
        return True, {PARAMS_KEY: {**self._location, "key": key, "num_tokens": num_tokens, "request_id": req_id}}

    def _unwanted(self, req_id: str, params: Any) -> tuple[bool, dict | None] | None:
        """The answer for a request not to be saved by the ``save`` option and its own flag, or
        None. Quiet: on a shared endpoint most requests may not ask."""
        if not params:  # asks nothing (vLLM's server passes no empty kv_transfer_params on)
            if not self._requested_only:
                return None
            self.stats.not_saved(NOT_REQUESTED)
            return False, None  # a client that sent nothing gets nothing back
        if not isinstance(params, dict):
            return None  # refused as a bad kv_transfer_params (_check_params)
        save = params.get("save")
        if save is None:
            if not self._requested_only or params.get("sample_id") is not None:
                return None
            why = (
                'this server saves only requests that ask: send "save": true or a "sample_id" in '
                'kv_transfer_params (the connector\'s option save is "requested")'
            )
        elif type(save) is not bool:
            return self._refuse(req_id, "invalid_request", f"save must be true or false, got {save!r}")
        elif save:
            return None
        else:
            why = 'the request\'s kv_transfer_params say "save": false'
        self.stats.not_saved(NOT_REQUESTED)
        return False, {PARAMS_KEY: {"error": why, "reason": NOT_REQUESTED}}

    def _check_params(self, request: Any, params: Any) -> tuple:
        """``(key, include_output_tokens, extras, window request)`` from ``kv_transfer_params``, or a
        refusal; the loss mask and window are checked against the recorded tokens later."""
        req_id = request.request_id
        if not isinstance(params, dict):
            return self._refuse(req_id, "invalid_request", f"kv_transfer_params must be an object, got {params!r}")
        include_outputs = params.get("include_output_tokens", False)
        if not isinstance(include_outputs, bool):
            return self._refuse(
                req_id, "invalid_request", f"include_output_tokens must be true or false, got {include_outputs!r}"
            )
        if include_outputs and self._outputs_refused:
            return self._refuse(req_id, "invalid_request", self._outputs_refused)
        sample_id = params.get("sample_id")
        if sample_id is not None:
            problem = sample_id_problem(sample_id)
            if problem:
                return self._refuse(req_id, "invalid_request", problem)
            key = sample_id
        else:
            key = req_id
        record_metadata = params.get("record_metadata")
        if record_metadata is not None:
            problem = record_metadata_problem(record_metadata)
            if problem:
                return self._refuse(req_id, "invalid_request", problem)
        loss_mask = params.get("loss_mask")
        window_spec, problem = capture_window.check(params)
        if problem:
            return self._refuse(req_id, "invalid_request", problem)
        if window_spec is not None and window_spec[2] and loss_mask is not None:
            return self._refuse(
                req_id,
                "invalid_request",
                "loss_mask is one entry per stored token; a reduction stores one vector: send one or the other",
            )
        extras = None
        if record_metadata or loss_mask is not None:
            extras = (dict(record_metadata) if record_metadata else None, loss_mask)
        return key, include_outputs, extras, window_spec

    def _refuse(self, req_id: str, reason: str, message: str) -> tuple[bool, dict]:
        logger.warning("layertap: hidden states of request %s not saved: %s", req_id, message)
        self.stats.not_saved(reason)
        return False, {PARAMS_KEY: {"error": message, "reason": reason}}
