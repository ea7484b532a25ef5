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

from layertap._tiny_model import save_random_model, write_tokenizer
from layertap.errors import InvalidInputError

_COMMON = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
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


def build_tiny_model(path: str | os.PathLike, architecture: str, *, dtype: str = "float32", seed: int = 0) -> str:
    """Writes a random transformers model of ``architecture`` (one of ``ARCHITECTURES``) and the
    tiny tokenizer into ``path``; returns the path. Nothing is downloaded; the same arguments
    give the same weights."""
    import transformers

    out = Path(path)
    vocab = write_tokenizer(out)
    configs = _configs(vocab)
    if architecture not in configs:
        raise InvalidInputError(f"no tiny model for {architecture!r}; known: {sorted(configs)}")
    model_class, config_class, kwargs = configs[architecture]
    config = getattr(transformers, config_class)(**kwargs)
    return save_random_model(getattr(transformers, model_class), config, out, dtype=dtype, seed=seed)
