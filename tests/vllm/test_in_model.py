"""Capture in the model (connector option ``capture="in-model"``, ``layertap.vllm.models.in_model``):
the model class caches the hidden states itself, without vLLM's speculative method. The recorded
hidden states equal transformers' for every architecture the plugin covers (prefix caching, chunked
prefill, generated tokens), and the engine runs without speculative decoding: one token per
request in each decode step.

Llama runs the way users run it: the engine in its own process, which loads the plugin through its
entry point because ``LAYERTAP_IN_MODEL`` is set, and records read with ``fetch`` while it runs.
That test comes first, before this process registers anything. The other architectures run in
this process after ``register_in_model()`` (quicker to start), where the scheduler's output of every
step can be watched.
"""

from __future__ import annotations

import os

import pytest
import support_table
import torch

import layertap
from layertap.vllm import fetch
from layertap.vllm.models import FAMILIES, IN_MODEL_ENV_VAR, IN_MODEL_FAMILIES
from plugin_support import KERNEL_REPLACED, LAYERS, STORED_LAYERS, run_requests
from tiny_families import ARCHITECTURES, build_tiny_model
from vllm_support import (
    VLLM_WARNINGS,
    WORKER_IN_THE_ENGINE_PROCESS,
    Reference,
    assert_hidden_states_match,
    collections_of_young_objects,
    engine_args,
    pytest_env,
    running_llm,
    speculative_config,
    vllm_class_name,
)

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

ENTRY_POINT_ARCH = "LlamaForCausalLM"
#: Run in this process: every other architecture whose vLLM class has the EAGLE-3 interface (the
#: plugin's hooks are checked on them here only), and two of those the plugin gives it (their hooks
#: are checked with vLLM's method in test_plugin_values.py; the in-model class is the same for all):
#: a fused-residual family with sandwich norms and a scaled embedding, and one whose layers carry
#: the whole stream.
#: The hybrids (Qwen3-Next, Nemotron-H) run in test_hybrid_values.py, with engine settings of their own.
IN_PROCESS_ARCHS = [
    *(
        arch
        for arch in IN_MODEL_FAMILIES
        if arch not in FAMILIES and arch != ENTRY_POINT_ARCH and arch in ARCHITECTURES and arch not in KERNEL_REPLACED
    ),
    "Gemma2ForCausalLM",
    "GPT2LMHeadModel",
    "Glm4MoeForCausalLM",  # issue 36
]
FETCH_TIMEOUT = 60
#: Rows of docs/CONNECTOR.md's support table that this module's tests report
#: (tests/vllm/support_table.py).
SUPPORT_TABLE = [(arch, "in-model") for arch in [ENTRY_POINT_ARCH, *IN_PROCESS_ARCHS]]
COMPARED = "ids 0, 1, 2, N; 5 prompts (prefix cached, 5 chunks, 1 token) and generated tokens; one token per decode step; {dtype}"


def report(arch: str, dtype: str, errors: list[float], largest: float) -> None:
    support_table.report(
        arch,
        "in-model",
        vllm_class=vllm_class_name(arch),
        compared=COMPARED.format(dtype=dtype),
        worst_abs_error=max(errors),
        records=len(errors),
        largest_value=largest,
    )


def in_model_engine_args(model: str, output_dir, layers=LAYERS, **overrides):
    settings = dict(
        speculative_config=None,
        enable_prefix_caching=True,
        max_num_batched_tokens=64,  # longer prompts are prefilled in chunks
        max_num_seqs=8,
    )
    connector = {"pool_bytes": 8 << 20, "capture": "in-model", "layer_ids": list(layers)}
    return engine_args(model, output_dir, connector=connector, **{**settings, **overrides})


def test_llama_through_the_entry_point_in_the_engine_process(tmp_path):
    """``LAYERTAP_IN_MODEL`` names the architecture; the engine core, a process of its own, loads
    the plugin through its entry point and builds vLLM's Llama with the cache layer. bfloat16, the
    GPU's dtype."""
    model = build_tiny_model(tmp_path / "model", ENTRY_POINT_ARCH)
    args = in_model_engine_args(
        model, tmp_path / "hs", dtype="bfloat16", distributed_executor_backend=WORKER_IN_THE_ENGINE_PROCESS
    )
    with pytest_env({IN_MODEL_ENV_VAR: ENTRY_POINT_ARCH}), running_llm(True, **args) as llm:
        assert llm.llm_engine.vllm_config.speculative_config is None
        requests = run_requests(llm)
        records = [fetch(out.kv_transfer_params, timeout=FETCH_TIMEOUT) for out, _ in requests]
    reference = Reference(model)
    errors = []
    for record, (_, ids) in zip(records, requests):
        assert record.hidden_states.dtype == torch.bfloat16
        errors.append(assert_hidden_states_match(record, reference, ids, layers=STORED_LAYERS))
    largest = support_table.records_largest_value(records)
    report(ENTRY_POINT_ARCH, "bfloat16, engine in its own process", errors, largest)


def test_generate_with_capture_in_model(tmp_path):
    """``layertap.generate(capture="in-model")``: generate turns the plugin on for the run (nothing
    set by the caller, nothing left set after); token ids, generated tokens recorded."""
    from generate_support import TINY_ENGINE_ARGS, id_rows, write_jsonl

    model = build_tiny_model(tmp_path / "model", ENTRY_POINT_ARCH)
    rows = id_rows(6, 5, 80, seed=4)
    assert IN_MODEL_ENV_VAR not in os.environ
    with collections_of_young_objects(), pytest_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
        summary = layertap.generate(
            model,
            write_jsonl(tmp_path / "ids.jsonl", rows),
            tmp_path / "out",
            layers="4,0,2",
            capture="in-model",
            max_tokens=3,
            include_output_tokens=True,
            sampling_args={"temperature": 0.0, "ignore_eos": True},
            engine_args={**TINY_ENGINE_ARGS, "dtype": "float32"},
            progress="none",
        )
    assert IN_MODEL_ENV_VAR not in os.environ
    assert summary["complete"] and summary["rows_written"] == 6 and summary["capture"] == "in-model"
    reference = Reference(model)
    with layertap.open(tmp_path / "out") as ds:
        for i, row in enumerate(rows):
            record = ds[str(i)]
            assert record.num_tokens == len(row["input_ids"]) + 2
            assert_hidden_states_match(record, reference, record.token_ids.tolist(), layers=[0, 2, 4])


def test_generate_refuses_capture_in_model_for_an_architecture_without_a_class():
    from layertap.generate import GenerateError
    from layertap.generate.capture import check_capture

    assert check_capture("in-model", ["Qwen2ForCausalLM"]) == "in-model"
    assert check_capture("method", ["GraniteForCausalLM"]) == "method"
    with pytest.raises(GenerateError, match=r"--capture in-model: no in-model class for .*\['GraniteForCausalLM'\]"):
        check_capture("in-model", ["GraniteForCausalLM"])
    with pytest.raises(GenerateError, match="--capture must be one of 'method', 'in-model', not 'eagle'"):
        check_capture("eagle", ["LlamaForCausalLM"])


@pytest.fixture(scope="module")
def registered():
    from layertap.vllm.models import register_in_model

    names = register_in_model()
    assert names == list(IN_MODEL_FAMILIES)
    return names


class ScheduledTokens:
    """Watches an in-process engine's scheduler: the tokens it schedules in each step, and the
    speculative (draft) tokens among them."""

    def __init__(self, llm):
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        schedule = scheduler.schedule
        self.steps: list[dict[str, int]] = []
        self.draft_tokens = 0

        def watched_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            self.steps.append(dict(out.num_scheduled_tokens))
            self.draft_tokens += sum(len(t) for t in out.scheduled_spec_decode_tokens.values())
            return out

        scheduler.schedule = watched_schedule

    @property
    def total(self) -> int:
        return sum(sum(step.values()) for step in self.steps)


@pytest.mark.parametrize("arch", IN_PROCESS_ARCHS)
def test_values_equal_transformers_one_token_per_decode_step(arch, registered, tmp_path):
    model = build_tiny_model(tmp_path / "model", arch)
    out_dir = tmp_path / "hs"
    with running_llm(False, **in_model_engine_args(model, out_dir)) as llm:
        scheduled = ScheduledTokens(llm)
        requests = run_requests(llm)
    # No speculative decoding: each request is scheduled its uncached prompt tokens, then one token
    # per decode step for each generated token but the last (vLLM's method schedules two).
    assert scheduled.draft_tokens == 0
    expected = sum(
        len(out.prompt_token_ids) - out.num_cached_tokens + len(out.outputs[0].token_ids) - 1 for out, _ in requests
    )
    assert scheduled.total == expected
    # The engine ran in this process: its shutdown handed the last requests to the connector.
    reference = Reference(model)
    errors, largest = [], 0.0
    with layertap.open(out_dir) as ds:
        assert len(ds) == len(requests)
        for out, ids in requests:
            record = ds[out.kv_transfer_params["layertap"]["key"]]
            errors.append(assert_hidden_states_match(record, reference, ids, layers=STORED_LAYERS))
            largest = max(largest, support_table.records_largest_value([record]))
    report(arch, "float32", errors, largest)


def test_capture_windows_with_capture_in_model(registered, tiny_model, reference, tmp_path):
    """Windows and reductions (issue 25) are the connector's, whichever way the cache is filled:
    with the model class caching, a window across chunked prefill and a mean over the response
    tokens equal transformers' rows."""
    from vllm import SamplingParams

    prompt = [3 + (7 + 41 * i) % 490 for i in range(150)]
    asks = [{"window": [30, 140]}, {"include_output_tokens": True, "window": [150, None], "reduction": "mean"}]
    with running_llm(False, **in_model_engine_args(tiny_model, tmp_path / "hs")) as llm:
        outputs = llm.generate(
            [{"prompt_token_ids": prompt}] * 2,
            [
                SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, extra_args={"kv_transfer_params": a})
                for a in asks
            ],
            use_tqdm=False,
        )
    ids = prompt + list(outputs[1].outputs[0].token_ids)[:-1]
    full = reference.hidden_states(ids, STORED_LAYERS)
    with layertap.open(tmp_path / "hs") as ds:
        window, mean = (ds[o.kv_transfer_params["layertap"]["key"]] for o in outputs)
    assert window.token_ids.tolist() == prompt[30:140] and window.metadata["window_start"] == "30"
    torch.testing.assert_close(window.hidden_states, full[30:140], rtol=1e-5, atol=1e-5)
    assert mean.hidden_states.shape == (1, len(STORED_LAYERS), 128) and mean.metadata["window_end"] == "155"
    torch.testing.assert_close(mean.hidden_states, full[150:155].mean(0, keepdim=True), rtol=1e-5, atol=1e-5)


def test_a_class_registered_after_the_model_ran_is_the_one_built(registered, tmp_path):
    """vLLM (0.32) caches, per process, the class each model path resolved to; registering the
    in-model classes drops that cache, so a model that already ran here with vLLM's class is
    built with layertap's next time (in the suite's order this failed the test above)."""
    from vllm import ModelRegistry
    from vllm.config import ModelConfig
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    from layertap.vllm.models import register_in_model
    from layertap.vllm.models.in_model import InModelCacheMixin

    model = build_tiny_model(tmp_path / "model", "Qwen2ForCausalLM")
    ModelRegistry.register_model("Qwen2ForCausalLM", Qwen2ForCausalLM)  # vLLM's own, as without the plugin
    try:
        assert get_model_architecture(ModelConfig(model=model))[0] is Qwen2ForCausalLM
    finally:
        register_in_model(["Qwen2ForCausalLM"])
    built = get_model_architecture(ModelConfig(model=model))[0]
    assert issubclass(built, InModelCacheMixin) and issubclass(built, Qwen2ForCausalLM), built.__mro__


def test_in_model_with_a_speculative_config_is_refused(registered, tmp_path):
    from test_config import start_and_fail

    model = build_tiny_model(tmp_path / "model", "Qwen2ForCausalLM")
    args = in_model_engine_args(model, tmp_path / "hs", speculative_config=speculative_config(LAYERS))
    assert 'layertap connector: capture: "in-model" runs without speculative decoding' in start_and_fail(args)


def test_without_the_plugin_the_error_says_what_to_set(tmp_path):
    """The connector asks for capture in the model but the plugin's class is not registered: this
    process's registry holds vLLM's own Llama for the test, as in a process where the plugin is off."""
    from test_config import start_and_fail
    from vllm import ModelRegistry
    from vllm.model_executor.models.llama import LlamaForCausalLM

    model = build_tiny_model(tmp_path / "model", ENTRY_POINT_ARCH)
    registered = ModelRegistry.models.get(ENTRY_POINT_ARCH)
    ModelRegistry.register_model(ENTRY_POINT_ARCH, LlamaForCausalLM)
    try:
        message = start_and_fail(in_model_engine_args(model, tmp_path / "hs"))
    finally:
        if registered is not None:
            ModelRegistry.models[ENTRY_POINT_ARCH] = registered
    assert (
        'layertap connector: capture: "in-model": the model has no hidden-states cache layer: '
        "layertap's plugin did not register its class for ['LlamaForCausalLM'] in the worker process"
    ) in message
    assert "set LAYERTAP_IN_MODEL=1 in the environment of the process that creates the engine" in message
    assert not any(tmp_path.glob("hs/*.lts"))


def test_an_architecture_without_an_in_model_class_is_named(tmp_path):
    """vLLM's alias ``LLaMAForCausalLM`` runs its Llama, for which the plugin has no class."""
    from test_config import start_and_fail

    model = build_tiny_model(tmp_path / "model", ENTRY_POINT_ARCH)
    args = in_model_engine_args(model, tmp_path / "hs", hf_overrides={"architectures": ["LLaMAForCausalLM"]})
    assert "layertap's plugin has no in-model class for ['LLaMAForCausalLM'] (it covers [" in start_and_fail(args)
