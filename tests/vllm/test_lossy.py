"""The connector with ``lossy="fp8-e4m3"`` (docs/FP8.md) through a real vLLM engine: records
hold e4m3 hidden states and a scale per token, quantized by the writer's threads, and
dequantize to transformers' hidden states within fp8's precision."""

from __future__ import annotations

import pytest
import torch

from layertap import fp8
from layertap.vllm import fetch
from vllm_support import STORED_LAYERS, VLLM_WARNINGS, engine_args, running_llm

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]


def test_records_are_quantized_and_dequantize_to_the_hidden_states(tiny_model, reference, tmp_path):
    from vllm import SamplingParams

    args = engine_args(tiny_model, tmp_path, dtype="bfloat16", connector={"lossy": "fp8-e4m3", "codec": "zstd"})
    prompts = [[3 + (37 * i + n) % 490 for i in range(n)] for n in (9, 40, 77)]
    # In this process (an engine core of its own would import vLLM again, 10 to 20 s of CPU).
    with running_llm(False, **args) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        llm.llm_engine.step()  # hands the requests of the last step to the connector
        records = [fetch(o.kv_transfer_params, timeout=60) for o in outs]
    for prompt, rec in zip(prompts, records):
        assert rec.hidden_states.dtype == torch.float8_e4m3fn
        assert rec.hidden_states.shape == (len(prompt), len(STORED_LAYERS), 128)
        assert rec["hidden_states_scale"].shape == (len(prompt),)
        assert rec.metadata["lossy"] == "fp8-e4m3" and rec.metadata["fp8_source_dtype"] == "bfloat16"
        assert rec.token_ids.tolist() == prompt
        want = reference.hidden_states(prompt, STORED_LAYERS, torch.float32)
        got = fp8.dequantize(rec, dtype=torch.float32)
        rel = ((got - want).norm() / want.norm()).item()
        # fp8's own error (a few percent) plus bf16's against float32.
        assert rel < 0.06, rel
        assert float(rec.metadata["fp8_rms_rel_err"]) < 0.06
