"""The vLLM side of a run: the ``LLM`` arguments (the user's ``--engine-args`` plus the
hidden-states extraction and the layertap connector), and the loop that feeds rows to the engine
and collects what the connector says about each.

Rows are streamed: the loop keeps a window of requests in the engine (twice ``max_num_seqs``, so
the scheduler never runs short) and adds more as requests finish, so memory does not grow with
the dataset. It drives ``LLMEngine.add_request``/``step`` directly rather than ``LLM.generate``,
to see each request finish.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from layertap._checks import json_object, positive_int
from layertap._choices import DEFAULT_CAPTURE
from layertap.generate.data import BadRow
from layertap.generate.errors import GenerateError
from layertap.vllm.config import ConfigError, parse_options
from layertap.vllm.models import IN_MODEL_ENV_VAR, register_in_model

#: ``LLM`` arguments that generate sets itself.
RESERVED_ENGINE_ARGS = ("model", "speculative_config", "kv_transfer_config")
#: Connector options that generate sets itself (``capture`` and ``layer_ids`` from ``--capture``
#: and ``--layers``).
RESERVED_CONNECTOR_ARGS = ("output_dir", "writer_id", "shard_metadata", "capture", "layer_ids")
#: Requests kept in the engine per ``max_num_seqs``.
WINDOW_PER_SEQ = 2


def parse_engine_args(engine_args: Any) -> dict:
    """``--engine-args`` as a dict without the arguments generate sets, else GenerateError (no
    vLLM import: ``check_engine_args`` checks the names against vLLM's)."""
    engine_args = json_object("--engine-args", engine_args, GenerateError)
    reserved = [k for k in engine_args if k in RESERVED_ENGINE_ARGS]
    if reserved:
        raise GenerateError(f"--engine-args may not set {reserved[0]!r}: layertap generate sets it")
    return dict(engine_args)


def check_engine_args(engine_args: dict) -> None:
    """``engine_args`` (parsed) must be ``LLM`` arguments vLLM knows, else GenerateError."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)} | set(inspect.signature(LLM.__init__).parameters)
    unknown = sorted(k for k in engine_args if k not in known)
    if unknown:
        raise GenerateError(f"--engine-args: {unknown[0]!r} is not an argument of vLLM's LLM")


def check_connector_args(connector_args: dict, output_dir: str) -> dict:
    """Connector options (``--connector-args``) checked now, as the connector will."""
    reserved = [k for k in connector_args if k in RESERVED_CONNECTOR_ARGS]
    if reserved:
        raise GenerateError(f"--connector-args may not set {reserved[0]!r}: layertap generate sets it")
    options = {"writer": "rust", "codec": "bp16-zstd", **connector_args}
    try:
        parse_options({**options, "output_dir": output_dir})
    except ConfigError as e:
        raise GenerateError(f"--connector-args: {e}") from None
    return options


def sampling_kwargs(sampling_args: dict, max_tokens: int) -> dict:
    """``SamplingParams`` arguments of every request, checked by building one."""
    from vllm import SamplingParams

    positive_int("--max-tokens", max_tokens, GenerateError)
    if sampling_args.get("n", 1) != 1:
        raise GenerateError("--sampling-args: n must be 1 (one record per row)")
    kwargs = {**sampling_args, "max_tokens": max_tokens, "detokenize": False}
    try:
        SamplingParams(**kwargs)
    except Exception as e:  # TypeError for unknown names, ValueError/VLLMValidationError for values
        raise GenerateError(f"--sampling-args: {e}") from None
    return kwargs


@contextlib.contextmanager
def in_model_plugin(architectures: list[str]) -> Iterator[None]:
    """Turns the plugin's in-model classes on for ``architectures`` while the engine starts and
    runs: registered in this process (for an engine that runs in it) and, through
    ``LAYERTAP_IN_MODEL``, in the processes the engine starts, which inherit the environment. A
    value the user set is kept; the one set here is removed at the end."""
    set_here = os.environ.get(IN_MODEL_ENV_VAR, "").strip() in ("", "0")
    if set_here:
        os.environ[IN_MODEL_ENV_VAR] = ",".join(architectures)
    try:
        register_in_model(architectures)
        yield
    finally:
        if set_here:
            del os.environ[IN_MODEL_ENV_VAR]


def llm_kwargs(
    model: str, layers: list[int], engine_args: dict, connector: dict, capture: str = DEFAULT_CAPTURE
) -> dict:
    """The ``LLM`` arguments: with ``capture="method"`` vLLM's ``extract_hidden_states`` method
    caches the layers; with ``"in-model"`` the model class does (no speculative configuration;
    start the engine inside ``in_model_plugin``)."""
    kv_transfer = {
        "kv_connector": "LayertapConnector",
        "kv_connector_module_path": "layertap.vllm",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": connector,
    }
    if capture == "in-model":
        kv_transfer["kv_connector_extra_config"] = {**connector, "capture": "in-model", "layer_ids": list(layers)}
        return {**engine_args, "model": model, "kv_transfer_config": kv_transfer}
    return {
        **engine_args,
        "model": model,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}},
        },
        "kv_transfer_config": kv_transfer,
    }


@dataclass
class Outcome:
    """What the loop learned about the rows it ran."""

    saved: np.ndarray
    """bool per row of the data: the connector took the row's record."""
    saved_count: int = 0
    tokens: int = 0
    """Tokens of the records the connector took."""
    bad: list[tuple[int, str]] = field(default_factory=list)
    """Rows not saved, with the reason (bad input, or refused by vLLM or the connector)."""
    drain_seconds: float = 0.0
    """From the last request's end until the engine's writer had put every record in a file
    (engine in its own process; in this process the engine writes them as it stops)."""


def run_rows(
    llm: Any,
    items: Iterator,
    num_rows: int,
    sampling: dict,
    record_params: dict,
    on_progress: Callable[..., None],
) -> Outcome:
    """Feeds ``items`` (``(row, token ids, loss mask or None)`` or ``BadRow``) to the engine and
    waits for every request to finish. ``record_params``: the connector's request parameters
    every row's request adds (``include_output_tokens``, ``window``, ``reduction``: see
    ``run.record_params``). ``on_progress(rows=, tokens=, bad=)`` after each step."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    base = SamplingParams(**{**_model_defaults(engine), **sampling})
    window = WINDOW_PER_SEQ * int(engine.vllm_config.scheduler_config.max_num_seqs)
    outcome = Outcome(saved=np.zeros(num_rows, dtype=bool))
    inflight: dict[str, int] = {}
    exhausted = False
    while True:
        bad = 0
        while not exhausted and len(inflight) < window:
            item = next(items, None)
            if item is None:
                exhausted = True
                break
            if isinstance(item, BadRow):
                outcome.bad.append((item.index, item.reason))
                bad += 1
                continue
            row, ids, mask = item
            kv: dict[str, Any] = {"sample_id": str(row), "record_metadata": {"row": str(row)}, **record_params}
            if mask is not None:
                kv["loss_mask"] = mask
            params = copy.copy(base)  # vLLM clones it again for its own use
            params.extra_args = {"kv_transfer_params": kv}
            try:
                engine.add_request(str(row), {"prompt_token_ids": ids}, params)
            except ValueError as e:  # vLLM's input checks (too long, out of vocabulary...)
                outcome.bad.append((row, f"refused by vLLM: {e}"))
                bad += 1
                continue
            inflight[str(row)] = row
        if not inflight:
            on_progress(bad=bad)
            if exhausted:
                return outcome
            continue
        rows = tokens = 0
        for out in engine.step():
            if not out.finished:
                continue
            row = inflight.pop(out.request_id)
            answer = (out.kv_transfer_params or {}).get("layertap", {})
            if "key" in answer:
                outcome.saved[row] = True
                rows += 1
                tokens += answer["num_tokens"]
            else:
                outcome.bad.append((row, f"not saved by the connector: {answer.get('error', 'no answer')}"))
                bad += 1
        outcome.saved_count += rows
        outcome.tokens += tokens
        on_progress(rows=rows, tokens=tokens, bad=bad)


def _model_defaults(engine: Any) -> dict:
    """The model's generation defaults (``generation_config.json``), as ``LLM.generate`` uses them."""
    get = getattr(engine.model_config, "get_diff_sampling_param", None)
    return dict(get() or {}) if get else {}


def shutdown(llm: Any, timeout: float) -> None:
    """Stops the engine: the connector writes what it holds and closes its shards."""
    client = llm.llm_engine.engine_core
    try:
        client.shutdown(timeout=timeout)
    except TypeError:  # vLLM versions whose shutdown takes no timeout
        client.shutdown()
    ctx = getattr(client, "ctx", None)  # vLLM leaves its ZMQ context open (it warns when collected)
    if ctx is not None and not ctx.closed:
        ctx.destroy(linger=0)
