"""The vLLM side of a run: the ``LLM`` arguments, and the loop that feeds rows to the engine and
collects what the connector says about each.

Rows are streamed: the loop keeps a window of requests in the engine (twice ``max_num_seqs``, so
the scheduler never runs short), so memory does not grow with the dataset. It drives
``LLMEngine.add_request``/``step`` rather than ``LLM.generate``, to see each request finish.
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

from layertap._choices import DEFAULT_CAPTURE
from layertap.generate.data import BadRow
from layertap.generate.errors import GenerateError
from layertap.generate.same_data import PROMPT_HASH, prompt_hash
from layertap.vllm.config import ConfigError, parse_options
from layertap.vllm.models import IN_MODEL_ENV_VAR, register_in_model

#: How long ``shutdown`` waits for vLLM's output thread to close its sockets: it does within
#: milliseconds of vLLM's shutdown signalling it, but a shutdown that an interrupt cut short
#: (Ctrl-C or SIGTERM as the engine stopped) never signals it, and the second call does nothing
#: (vLLM's finalizer is gone): the whole wait is then spent, and the context left to vLLM.
OUTPUT_THREAD_SECONDS = 2.0
#: Requests kept in the engine per ``max_num_seqs``.
WINDOW_PER_SEQ = 2
#: A CPU engine's KV cache, when the user sizes none: room for this many sequences of
#: ``max_model_len`` tokens (a CPU computes a few sequences at a time; rows are mostly shorter)...
CPU_KV_SEQUENCES = 32
#: ... within this share of the memory available (vLLM's own default, 92% of the machine's
#: memory, fails its check or is killed by the kernel wherever anything else runs), ...
CPU_KV_SHARE = 0.25
#: ... and at least this many sequences of ``max_model_len`` by our estimate of a token's bytes
#: (vLLM refuses a cache without room for one; its blocks and the hidden states' group take more
#: than the estimate), if that fits in this share of it.
CPU_KV_MIN_SEQUENCES = 2
CPU_KV_MAX_SHARE = 0.9
#: ``LLM`` arguments and variables with which a user sizes a CPU engine's KV cache themselves.
KV_CACHE_ARGS = ("kv_cache_memory_bytes", "gpu_memory_utilization")
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def gpus_per_engine(engine_args: dict) -> int:
    return int(engine_args.get("tensor_parallel_size", 1)) * int(engine_args.get("pipeline_parallel_size", 1))


def check_engine_args(engine_args: dict) -> None:
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)} | set(inspect.signature(LLM.__init__).parameters)
    unknown = sorted(k for k in engine_args if k not in known)
    if unknown:
        raise GenerateError(f"--engine-args: {unknown[0]!r} is not an argument of vLLM's LLM")


def check_connector_args(connector_args: dict, output_dir: str) -> dict:
    """``--connector-args`` checked now, as the connector will."""
    options = {"writer": "rust", "codec": "bp16-zstd", **connector_args}
    try:
        parse_options({**options, "output_dir": output_dir})
    except ConfigError as e:
        raise GenerateError(f"--connector-args: {e}") from None
    return options


def sampling_kwargs(sampling_args: dict, max_tokens: int) -> dict:
    """``SamplingParams`` arguments of every request, checked by building one."""
    from vllm import SamplingParams

    kwargs = {**sampling_args, "max_tokens": max_tokens, "detokenize": False}
    try:
        SamplingParams(**kwargs)
    except Exception as e:  # TypeError for unknown names, ValueError/VLLMValidationError for values
        raise GenerateError(f"--sampling-args: {e}") from None
    return kwargs


def cpu_kv_cache_default(
    engine_args: dict, info: Any, num_layer_ids: int, model_len: int, engines_here: int = 1
) -> dict | None:
    """On a CPU engine whose KV cache the user did not size: sets
    ``engine_args["kv_cache_memory_bytes"]`` from what the machine has free (docs/GENERATE.md, "On
    a CPU"), split between the ``engines_here`` engines, and returns what was chosen and why."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or any(k in engine_args for k in KV_CACHE_ARGS):
        return None
    if os.environ.get(KV_CACHE_ENV, "").strip():
        return None
    from layertap._text import human_bytes

    width = 4 if str(engine_args.get("dtype", "")).replace("torch.", "") in ("float32", "float") else 2
    kv_width = 1 if str(engine_args.get("kv_cache_dtype", "auto")).startswith("fp8") else width
    per_token = info.kv_elements_per_token * kv_width + num_layer_ids * info.hidden_size * width
    if per_token <= 0:
        return None  # a configuration of other names: vLLM's own sizing
    available = _cpu_available_memory() // max(1, engines_here)
    each = f" for each of {engines_here} engines" if engines_here > 1 else ""
    least = CPU_KV_MIN_SEQUENCES * per_token * model_len
    if least > CPU_KV_MAX_SHARE * available:
        raise GenerateError(
            f"a CPU engine's KV cache for sequences of {model_len:,} tokens (--max-len plus --max-tokens) needs "
            f"about {human_bytes(least)}, and this machine has {human_bytes(available)} free{each}: pass a "
            "smaller --max-len, or size it yourself (kv_cache_memory_bytes in --engine-args)"
        )
    chosen = max(least, min(CPU_KV_SEQUENCES * per_token * model_len, int(CPU_KV_SHARE * available)))
    chosen = -(-chosen // (1 << 20)) << 20  # whole MiB
    engine_args["kv_cache_memory_bytes"] = chosen
    return {
        "kv_cache_memory_bytes": chosen,
        "reason": f"chosen for a CPU engine: room for about {chosen // (per_token * model_len):,} sequences of "
        f"{model_len:,} tokens within a quarter of the {human_bytes(available)} free{each}; set it in "
        "--engine-args to choose",
    }


def _cpu_available_memory() -> int:
    """The memory vLLM's CPU worker will see as available, as it computes it."""
    try:
        from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

        return int(get_memory_node_info(get_allowed_cpu_list()[0].numa_node).available_memory)
    except Exception:  # another vLLM's layout: the machine's
        import psutil

        return int(psutil.virtual_memory().available)


@contextlib.contextmanager
def in_model_plugin(architectures: list[str]) -> Iterator[None]:
    """Turns the plugin's in-model classes on for ``architectures`` while the engine runs: here,
    and through ``LAYERTAP_IN_MODEL`` in the processes it starts. A value the user set is kept."""
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
    """The ``LLM`` arguments: with ``capture="method"`` vLLM's ``extract_hidden_states`` caches the
    layers; with ``"in-model"`` the model class does (start the engine inside ``in_model_plugin``)."""
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
    bad: list[tuple[int, str]] = field(default_factory=list)
    """Rows not saved, with the reason (bad input, or refused by vLLM or the connector)."""
    drain_seconds: float = 0.0
    """From the last request's end until every record was in a file (engine in its own process)."""


def run_rows(
    llm: Any, items: Iterator, sampling: dict, record_params: dict, on_progress: Callable[..., None], outcome: Outcome
) -> None:
    """Feeds ``items`` (``(row, token ids, loss mask or None)`` or ``BadRow``) to the engine until
    every request finished, with ``record_params`` (``run.record_params``) in each. ``outcome`` is
    filled in as requests finish, so that a caller interrupted meanwhile knows what they came to."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    # The model's generation defaults (generation_config.json), as LLM.generate uses them.
    base = SamplingParams(**{**engine.model_config.get_diff_sampling_param(), **sampling})
    window = WINDOW_PER_SEQ * int(engine.vllm_config.scheduler_config.max_num_seqs)
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
            metadata = {"row": str(row), PROMPT_HASH: prompt_hash(ids)}  # the fingerprint: same_data.py
            kv: dict[str, Any] = {"sample_id": str(row), "record_metadata": metadata, **record_params}
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
                return
            continue
        rows = tokens = 0
        for out in engine.step():
            if not out.finished:
                continue
            row = inflight.pop(out.request_id)
            answer = (out.kv_transfer_params or {}).get("layertap", {})
            if "key" in answer:
                outcome.saved[row] = True
                outcome.saved_count += 1
                outcome.tokens += answer["num_tokens"]
                rows += 1
                tokens += answer["num_tokens"]
            else:
                outcome.bad.append((row, f"not saved by the connector: {answer.get('error', 'no answer')}"))
                bad += 1
        on_progress(rows=rows, tokens=tokens, bad=bad)


def shutdown(llm: Any, timeout: float | None = None) -> None:
    """Stops the engine: the connector writes what it holds and closes its shards."""
    client = llm.llm_engine.engine_core
    try:
        client.shutdown(timeout=timeout)
    except TypeError:  # vLLM versions whose shutdown takes no timeout
        client.shutdown()
    # vLLM leaves its ZMQ context open (it warns when collected), so it is destroyed here, which
    # closes the sockets still open. The sync client's output thread closes its own two sockets
    # once shutdown signals it, and shutdown returns without waiting: a socket closed from this
    # thread while that thread closes or polls it is what libzmq forbids, and it aborted a run
    # after its last row (SIGABRT, "Assertion failed: _state == term_ack_sent ||
    # _state == term_req_sent2 (src/pipe.cpp:355)"). So the thread is waited for first, and a
    # context whose thread does not end is left to vLLM.
    thread = getattr(client, "output_queue_thread", None)
    if thread is not None:
        thread.join(OUTPUT_THREAD_SECONDS)
        if thread.is_alive():
            return
    ctx = getattr(client, "ctx", None)
    if ctx is not None and not ctx.closed:
        ctx.destroy(linger=0)
