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
from layertap._tiny_families import ARCHITECTURES, build_tiny_model
from layertap.vllm import fetch
from layertap.vllm.models import ENV_VAR, FAMILIES

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

#: Requested out of order: the embeddings (0), the first sum of a fused residual-add (1), a middle
#: layer (2) and the last layer's output before the final norm (4 = N).
LAYERS = [4, 0, 1, 2]
STORED_LAYERS = sorted(LAYERS)
#: The family run through the entry point, in its own engine process.
ENTRY_POINT_FAMILY = "Gemma2ForCausalLM"
IN_PROCESS_FAMILIES = [arch for arch in ARCHITECTURES if arch != ENTRY_POINT_FAMILY]
FETCH_TIMEOUT = 60


def prompt_ids(n: int, start: int = 0) -> list[int]:
    return [3 + (start + 37 * i) % 490 for i in range(n)]


def family_engine_args(model: str, output_dir, **overrides):
    return engine_args(
        model, output_dir,
        connector={"writer": "python", "pool_bytes": 8 << 20},
        speculative_config=speculative_config(LAYERS),
        enable_prefix_caching=True,
        max_num_batched_tokens=64,  # longer prompts are prefilled in chunks
        max_num_seqs=8,
        **overrides,
    )


def generate(llm, prompts: list[list[int]], kv_params: list[dict] | None = None, max_tokens: int = 3):
    """Runs ``prompts``; returns ``(output, token ids its record must hold)`` per prompt."""
    from vllm import SamplingParams

    kv_params = kv_params or [{}] * len(prompts)
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                       extra_args={"kv_transfer_params": p} if p else None)
        for p in kv_params
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = []
    for out, p in zip(outputs, kv_params):
        ids = list(out.prompt_token_ids)
        if p.get("include_output_tokens"):
            ids += list(out.outputs[0].token_ids)[:-1]
        result.append((out, ids))
    return result


def run_requests(llm) -> list:
    """The same requests for every family: a shared prefix of three blocks cached by the first
    request and reused by the next; a prompt of five 64-token chunks; one token; generated tokens
    recorded too (decode steps)."""
    prefix = prompt_ids(96, start=11)
    first = generate(llm, [prefix + prompt_ids(10, start=1)])
    rest = generate(
        llm,
        [prefix + prompt_ids(5, start=5), prompt_ids(300, start=3), prompt_ids(1, start=7), prompt_ids(12, start=9)],
        kv_params=[{}, {}, {}, {"include_output_tokens": True}],
        max_tokens=6,
    )
    assert rest[0][0].num_cached_tokens >= 96, rest[0][0].num_cached_tokens
    return first + rest


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
