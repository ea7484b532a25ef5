"""Models without vLLM's EAGLE-3 interface, through layertap's plugin (layertap.vllm.models): the
recorded hidden states equal transformers' at every requested layer, for each covered family.

One engine per family, with prefix caching and prompts longer than a step (chunked prefill). Most
run in this process after ``register()`` (quicker to start); Gemma 2 runs the way users run it:
the engine in its own process, which loads the plugin through its entry point because
``LAYERTAP_EAGLE3`` is set, and records read with ``fetch`` while it runs. That test comes first,
before this process registers anything, so that it cannot pass on registrations inherited by a
forked engine process.
"""

from __future__ import annotations

import pytest
import torch

import layertap
from layertap._tiny_families import build_tiny_model
from layertap.vllm import fetch
from layertap.vllm.models import ENV_VAR, FAMILIES
from plugin_support import LAYERS, STORED_LAYERS, run_requests
from vllm_support import (
    VLLM_WARNINGS,
    Reference,
    assert_hidden_states_match,
    engine_args,
    pytest_env,
    running_llm,
    speculative_config,
)

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

#: The family run through the entry point, in its own engine process.
ENTRY_POINT_FAMILY = "Gemma2ForCausalLM"
IN_PROCESS_FAMILIES = [arch for arch in FAMILIES if arch != ENTRY_POINT_FAMILY]
FETCH_TIMEOUT = 60


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
    args = family_engine_args(model, tmp_path / "hs", dtype="bfloat16")
    with pytest_env({ENV_VAR: ENTRY_POINT_FAMILY}), running_llm(True, **args) as llm:
        requests = run_requests(llm)
        records = [fetch(out.kv_transfer_params, timeout=FETCH_TIMEOUT) for out, _ in requests]
    reference = Reference(model)
    for record, (_, ids) in zip(records, requests):
        assert record.hidden_states.dtype == torch.bfloat16
        assert_hidden_states_match(record, reference, ids, layers=STORED_LAYERS)


@pytest.fixture(scope="module")
def registered():
    from layertap.vllm.models import register

    names = register()
    # vLLM 0.32 lacks the interface in every covered architecture.
    assert names == list(FAMILIES)
    return names


@pytest.mark.parametrize("arch", IN_PROCESS_FAMILIES)
def test_values_equal_transformers(arch, registered, tmp_path):
    assert arch in registered
    model = build_tiny_model(tmp_path / "model", arch)
    out_dir = tmp_path / "hs"
    with running_llm(False, **family_engine_args(model, out_dir)) as llm:
        requests = run_requests(llm)
    # The engine ran in this process: its shutdown handed the last requests to the connector.
    reference = Reference(model)
    with layertap.open(out_dir) as ds:
        assert len(ds) == len(requests)
        for out, ids in requests:
            record = ds[out.kv_transfer_params["layertap"]["key"]]
            assert_hidden_states_match(record, reference, ids, layers=STORED_LAYERS)
