"""Tiny random hybrid models (attention layers among Mamba or linear-attention layers), built on
the spot with transformers, for the vLLM tests of issue 36 (tests/vllm/test_hybrid_values.py).

Each has the tiny Llama's hidden size (128), attention heads of 64 (which vLLM's CPU attention
supports), the tiny tokenizer, and its family's real layer pattern at a small scale: the
attention layer or layers sit among the recurrent ones, and the MoE families have several
experts. Nothing is downloaded; the same ``seed`` builds the same weights.
"""

from __future__ import annotations

import os

from tiny_families import build_from_configs


def _configs(vocab: dict[str, int]) -> dict:
    """Architecture -> (transformers model class name, config class name, config arguments)."""
    ids = dict(vocab_size=len(vocab), bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], pad_token_id=0)
    attention = dict(
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        **ids,
    )
    return {
        # Gated delta-net (linear attention) layers, three to one gated full-attention layer, each
        # with a MoE of routed experts and a shared one (Qwen3-Next-80B-A3B's pattern).
        "Qwen3NextForCausalLM": (
            "Qwen3NextForCausalLM",
            "Qwen3NextConfig",
            dict(
                attention,
                head_dim=64,
                intermediate_size=256,
                num_hidden_layers=4,
                layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                # vLLM's CPU gated delta rule takes head size 128 only (Qwen3-Next's).
                linear_num_key_heads=1,
                linear_num_value_heads=2,
                linear_key_head_dim=128,
                linear_value_head_dim=128,
                linear_conv_kernel_dim=4,
                # Every expert of the four routed: vLLM's CPU gated delta rule runs in bfloat16 only,
                # where a near tie between the second and third expert may pick another expert
                # than transformers does (a one-token difference of order one, seen in a top-2
                # model); with all four the router only weighs them.
                num_experts=4,
                num_experts_per_tok=4,
                moe_intermediate_size=128,
                shared_expert_intermediate_size=128,
            ),
        ),
        # One mixer per layer: Mamba-2 layers, MLP layers and one attention layer (Nemotron-H
        # 8B's "M-M-M*-" kind of pattern; transformers 5 names Mamba "linear_attention"). No MoE
        # layer ("E", Nemotron 3): vLLM's CPU build refuses its non-gated experts
        # (benches/gpu/README.md, "Issue 36").
        "NemotronHForCausalLM": (
            "NemotronHForCausalLM",
            "NemotronHConfig",
            dict(
                attention,
                head_dim=64,
                intermediate_size=256,
                layers_block_type=[
                    "linear_attention",
                    "mlp",
                    "linear_attention",
                    "full_attention",
                    "mlp",
                    "linear_attention",
                ],
                mamba_num_heads=8,
                mamba_head_dim=32,
                ssm_state_size=16,
                n_groups=2,
                conv_kernel=4,
                expand=2,
                chunk_size=64,
            ),
        ),
        # Mamba-1 layers with one attention layer (Jamba's attention period at a small scale),
        # a MoE in every other layer.
        "JambaForCausalLM": (
            "JambaForCausalLM",
            "JambaConfig",
            dict(
                attention,
                intermediate_size=256,
                num_hidden_layers=4,
                attn_layer_period=4,
                attn_layer_offset=2,
                expert_layer_period=2,
                expert_layer_offset=1,
                num_experts=4,
                num_experts_per_tok=2,
                mamba_d_state=16,
                mamba_d_conv=4,
                mamba_expand=2,
                mamba_dt_rank=8,
            ),
        ),
        # Every layer runs attention and a Mamba-2 mixer side by side on the same input, then an
        # MLP; the embeddings are scaled (embedding_multiplier), as are the branches.
        "FalconH1ForCausalLM": (
            "FalconH1ForCausalLM",
            "FalconH1Config",
            dict(
                attention,
                head_dim=64,
                intermediate_size=256,
                num_hidden_layers=4,
                mamba_d_ssm=256,
                mamba_n_heads=8,
                mamba_d_head=32,
                mamba_n_groups=1,
                mamba_d_state=16,
                mamba_d_conv=4,
                mamba_expand=2,
                mamba_chunk_size=64,
                embedding_multiplier=2.0,
                attention_out_multiplier=0.5,
                ssm_out_multiplier=0.75,
            ),
        ),
    }


#: Architectures ``build_tiny_hybrid`` builds.
ARCHITECTURES = tuple(_configs({"<s>": 1, "</s>": 2}))


def build_tiny_hybrid(path: str | os.PathLike, architecture: str, *, dtype: str = "float32", seed: int = 0) -> str:
    """Writes a random transformers model of ``architecture`` (one of ``ARCHITECTURES``) and the
    tiny tokenizer into ``path``; returns the path."""
    return build_from_configs(_configs, path, architecture, dtype=dtype, seed=seed)


__all__ = ["ARCHITECTURES", "build_tiny_hybrid"]
