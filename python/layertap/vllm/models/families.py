"""The architectures the plugin covers, and where each keeps its residual stream.

A layer id means what it means for the models with vLLM's EAGLE-3 interface: id ``k < N`` is the
input of decoder layer ``k`` (transformers' ``output_hidden_states[k]``; ``k = 0``: the scaled
embeddings), id ``N`` the last decoder layer's output before the final norm. Nothing here imports
vLLM or torch.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The decoder layer returns ``(hidden_states, residual)`` and the residual stream is their sum:
#: vLLM's fused residual-add norms defer each addition to the next norm (the next layer's input
#: norm, or the model's final norm). The layer's ``residual`` argument is None for the first layer,
#: whose ``hidden_states`` argument is the whole stream (the embeddings).
FUSED = "fused"
#: The decoder layer takes and returns the whole residual stream as ``hidden_states`` (the first
#: element when it returns a tuple).
PLAIN = "plain"


@dataclass(frozen=True)
class Family:
    """How to reach one architecture's decoder layers and read its residual stream there."""

    module: str
    """vLLM's module under ``vllm.model_executor.models`` that defines the architecture's class."""
    class_name: str
    layers: str
    """Attribute path from the model to its ``ModuleList`` of decoder layers."""
    stream: str
    """``FUSED`` or ``PLAIN``."""


def _family(module: str, stream: str = FUSED, *, layers: str = "model.layers", cls: str | None = None):
    return lambda arch: Family(module, cls or arch, layers, stream)


# Architecture -> family. Each entry was read in vLLM 0.26 and 0.32: the model's forward feeds
# its layers in order from ``layers``, the first one the embeddings (scaled as transformers
# scales them), and hands the last layer's output to the final norm with nothing in between. Each
# is checked against transformers by tests/vllm/test_plugin_values.py (a tiny model of every one
# is in tests/vllm/tiny_families.py).
_FAMILIES = {
    # Embeddings times sqrt(hidden); Gemma 2 and 3 add sandwich norms (the post-attention and
    # post-feedforward norms apply to the branch output before it joins the stream).
    "GemmaForCausalLM": _family("gemma"),
    "Gemma2ForCausalLM": _family("gemma2"),
    "Gemma3ForCausalLM": _family("gemma3"),
    # Mixture of experts in place of the MLP; the stream is unchanged.
    "MixtralForCausalLM": _family("mixtral"),
    "Qwen2MoeForCausalLM": _family("qwen2_moe"),
    "OlmoeForCausalLM": _family("olmoe"),
    # Sandwich norms (post-attention and post-MLP norms on the branch outputs).
    "Glm4ForCausalLM": _family("glm4"),
    # GLM-4.5 (issue 36): routed and shared experts after dense first layers, no sandwich norms.
    "Glm4MoeForCausalLM": _family("glm4_moe"),
    # Layers that take and return the whole stream.
    "GPT2LMHeadModel": _family("gpt2", PLAIN, layers="transformer.h"),
    # Hybrids (issue 36, read in 0.32 only). Jamba: Mamba-1 layers and attention layers, both with the fused
    # residual-add norms. Falcon-H1: every layer runs attention and Mamba-2 side by side and
    # returns the whole stream; the embeddings are scaled by embedding_multiplier before layer 0.
    "JambaForCausalLM": _family("jamba"),
    "FalconH1ForCausalLM": _family("falcon_h1", PLAIN),
}

#: Every architecture the plugin gives the EAGLE-3 interface, with its family.
FAMILIES: dict[str, Family] = {arch: make(arch) for arch, make in _FAMILIES.items()}

# Architectures whose vLLM class has the EAGLE-3 interface itself (in 0.26 and 0.32), read the same
# way as those above: with capture in the model (``in_model.py``) their own aux hidden states are
# not used, the hooks are. Each is checked against transformers by tests/vllm/test_in_model.py.
_WITH_INTERFACE = {
    "LlamaForCausalLM": _family("llama"),
    # vLLM's MistralForCausalLM and Phi3ForCausalLM are Llama's model with other weight names.
    "MistralForCausalLM": _family("mistral"),
    "Phi3ForCausalLM": _family("phi3"),
    "Qwen2ForCausalLM": _family("qwen2"),
    # Query/key norms in the attention; the stream is Llama's.
    "Qwen3ForCausalLM": _family("qwen3"),
    "Qwen3MoeForCausalLM": _family("qwen3_moe"),
    # Issue 36 (read in 0.32). GPT-OSS: attention sinks and sliding-window layers, experts in
    # place of the MLP. Llama 4's text model: vLLM's Llama model with Llama 4's layers (MoE every
    # other layer). Mistral 3's text model (Ministral 3), which vLLM runs with its Mistral class.
    "GptOssForCausalLM": _family("gpt_oss"),
    "Llama4ForCausalLM": _family("llama4"),
    "Ministral3ForCausalLM": _family("mistral", cls="MistralForCausalLM"),
    # DeepSeek-V2/V3 (and Kimi-K2, V3's class): multi-head latent attention, dense first layers
    # then routed and shared experts; vLLM's own capture cannot record id 0 (0.32), the hooks can.
    # In float16 vLLM scales the stream by 1 / routed_scaling_factor (an overflow guard), so
    # float16 records are scaled; float32 and bfloat16 are not. MiniMax-M2: experts in place of
    # the MLP, query/key norms.
    "DeepseekV2ForCausalLM": _family("deepseek_v2"),
    "DeepseekV3ForCausalLM": _family("deepseek_v2"),
    "MiniMaxM2ForCausalLM": _family("minimax_m2"),
    # Hybrids (issue 36, read in 0.32): gated delta-net layers among gated attention layers
    # (Qwen3-Next), Mamba-2, MLP and attention layers, one mixer each (Nemotron-H); both with the
    # fused residual-add norms.
    "Qwen3NextForCausalLM": _family("qwen3_next"),
    "NemotronHForCausalLM": _family("nemotron_h"),
}

#: Every architecture whose model class can cache the hidden states itself (``capture="in-model"``):
#: those of ``FAMILIES`` and those whose vLLM class has the EAGLE-3 interface.
IN_MODEL_FAMILIES: dict[str, Family] = {
    **{arch: make(arch) for arch, make in _WITH_INTERFACE.items()},
    **FAMILIES,
}
