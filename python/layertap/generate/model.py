"""What a run needs to know about the model before the engine starts: that it loads at all, its
number of layers, vocabulary and context length, and which layer ids to record.

``read_config`` reads ``config.json`` as JSON in well under a second, so that a missing
configuration or layer ids out of range are reported before anything heavy is imported;
``load_model_info`` then loads the configuration and tokenizer with transformers, as vLLM will.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from layertap.generate.errors import GenerateError, first_line

#: Where configurations keep the number of decoder layers (transformers maps these names onto
#: ``num_hidden_layers``: GPT-2's ``n_layer``, DBRX's ``n_layers``, ChatGLM's ``num_layers``).
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
#: Per-layer lists (or a string of one character a layer) that give the count where no key
#: above does: Nemotron-H's block types (``hybrid_override_pattern`` in its older configs).
_LAYER_LIST_KEYS = ("layers_block_type", "hybrid_override_pattern", "layer_types")
#: Sub-configurations of multimodal models that hold the language model's (transformers'
#: ``get_text_config``).
_TEXT_CONFIG_KEYS = ("text_config", "llm_config", "language_config")


@dataclass
class ModelInfo:
    name: str
    revision: str
    num_layers: int
    vocab_size: int
    max_positions: int | None
    tokenizer: Any
    architectures: list[str] = field(default_factory=list)
    """The configuration's ``architectures`` (vLLM picks its model class by them)."""
    hidden_size: int = 0
    kv_elements_per_token: int = 0
    """Keys and values a token holds in the KV cache, over all layers (0: unknown)."""
    dtype: str = ""
    """The configuration's dtype (``torch_dtype``), as written there ("" when it gives none)."""


def read_config(model: str, engine_args: dict) -> dict | None:
    """The model's ``config.json``, read without transformers; None where only transformers knows
    how to find it (a GGUF file, Mistral's ``params.json``, ModelScope)."""
    source = engine_args.get("hf_config_path") or model
    if engine_args.get("config_format") not in (None, "auto", "hf") or os.environ.get("VLLM_USE_MODELSCOPE"):
        return None
    if os.path.isdir(source):
        path = os.path.join(source, "config.json")
        if not os.path.isfile(path):
            raise GenerateError(f"cannot load model {model!r}: {source} has no config.json")
    elif os.path.exists(source):
        return None
    elif source.startswith((".", "/", "~")):
        raise GenerateError(f"cannot load model {model!r}: {source}: no such directory")
    else:
        from huggingface_hub import hf_hub_download

        try:
            path = hf_hub_download(source, "config.json", revision=engine_args.get("revision"))
        except Exception as e:  # huggingface_hub's errors: not found, offline, gated, bad name...
            raise GenerateError(f"cannot load model {model!r}: {first_line(e)}") from None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise GenerateError(f"cannot load model {model!r}: {path}: {first_line(e)}") from None
    if not isinstance(config, dict):
        raise GenerateError(f"cannot load model {model!r}: {path} does not hold a JSON object")
    return config


#: The configuration keys vLLM takes the model's context length from, the smallest present
#: (vLLM 0.32's ``derive_max_model_len_and_key``; ``model_max_length``, which may raise it, is
#: left out: a configuration with it is not checked early).
_POSITION_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


def _text_config(config: dict) -> dict:
    """The language model's part of a raw configuration (transformers' ``get_text_config``)."""
    for key in _TEXT_CONFIG_KEYS:
        part = config.get(key)
        if isinstance(part, dict):
            return part
    return config


def _scales_rope(part: Any) -> bool:
    """Whether a configuration's RoPE settings hold a scaling ``factor`` (vLLM multiplies the
    context length by some kinds of it), at any depth."""
    if isinstance(part, dict):
        return "factor" in part or any(_scales_rope(v) for v in part.values())
    return False


def local_max_positions(model: str, config: dict | None, engine_args: dict) -> tuple[int, str] | None:
    """The context length vLLM will derive for a model in a local directory, with the key that
    gives it; None where it cannot be told without vLLM and transformers (a hub name,
    ``hf_overrides``, RoPE scaling, ``model_max_length``, ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``)."""
    source = engine_args.get("hf_config_path") or model
    if config is None or not os.path.isdir(source) or engine_args.get("hf_overrides"):
        return None
    if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "").strip().lower() not in ("", "0", "false"):
        return None
    text = _text_config(config)
    if any("model_max_length" in part for part in (text, config)):
        return None
    if any(_scales_rope(part.get(k)) for part in (text, config) for k in ("rope_scaling", "rope_parameters")):
        return None
    found = [(n, k) for k in _POSITION_KEYS if isinstance(n := text.get(k), int) and not isinstance(n, bool) and n > 0]
    return min(found) if found else None


def config_num_layers(config: dict) -> int | None:
    """The number of decoder layers a raw configuration gives: a count, or the length of a
    per-layer list where a hybrid gives only that (Nemotron-H's ``layers_block_type``)."""
    for part in [config.get(k) for k in _TEXT_CONFIG_KEYS] + [config]:
        if isinstance(part, dict):
            for key in _LAYER_COUNT_KEYS:
                n = part.get(key)
                if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                    return n
            for key in _LAYER_LIST_KEYS:
                pattern = part.get(key)
                if isinstance(pattern, (list, str)) and pattern:
                    return len(pattern)
    return None


def load_model_info(model: str, engine_args: dict, need_tokenizer: bool = True) -> ModelInfo:
    """Loads the model's configuration and, when rows must be tokenized, its tokenizer, the way
    vLLM will (same revision, tokenizer and trust_remote_code)."""
    from transformers import AutoConfig, AutoTokenizer

    revision = engine_args.get("revision")
    trust = bool(engine_args.get("trust_remote_code", False))
    try:
        config = AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust)
    except Exception as e:  # transformers raises OSError, ValueError, and others per model type
        raise GenerateError(f"cannot load model {model!r}: {first_line(e)}") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(num_layers, int) or num_layers < 1:
        raise GenerateError(f"model {model!r}: its configuration gives no number of decoder layers (num_hidden_layers)")
    tokenizer = None
    if need_tokenizer:
        tok_name = engine_args.get("tokenizer") or model
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                tok_name, revision=engine_args.get("tokenizer_revision", revision), trust_remote_code=trust
            )
        except Exception as e:
            raise GenerateError(f"cannot load the tokenizer of {tok_name!r}: {first_line(e)}") from None
    vocab = max(int(getattr(text, "vocab_size", 0) or 0), len(tokenizer) if tokenizer is not None else 0)
    return ModelInfo(
        name=model,
        revision=revision or "",
        num_layers=num_layers,
        vocab_size=vocab,
        max_positions=getattr(text, "max_position_embeddings", None),
        tokenizer=tokenizer,
        architectures=list(getattr(config, "architectures", None) or []),
        hidden_size=int(getattr(text, "hidden_size", 0) or 0),
        kv_elements_per_token=_kv_elements_per_token(text, num_layers),
        dtype=str(getattr(text, "dtype", None) or getattr(text, "torch_dtype", None) or "").removeprefix("torch."),
    )


def _kv_elements_per_token(text: Any, num_layers: int) -> int:
    """Keys and values per token over all layers (0 when the configuration does not say)."""
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None)
    hidden = getattr(text, "hidden_size", None)
    if not head_dim and heads and hidden:
        head_dim = hidden // heads
    if not (isinstance(kv_heads, int) and isinstance(head_dim, int)):
        return 0
    return num_layers * 2 * kv_heads * head_dim


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's layers in vLLM numbering, ``[2, N//2, N-3, N]`` (the distinct ones in range)."""
    n = num_layers
    return sorted({i for i in (2, n // 2, n - 3, n) if 0 <= i <= n})


def parse_layers(layers: list[int] | None, num_layers: int) -> list[int]:
    """Layer ids checked against the model (None: the EAGLE-3 default), ascending as stored."""
    if layers is None:
        return default_layers(num_layers)
    bad = [i for i in layers if not 0 <= i <= num_layers]
    if bad:
        raise GenerateError(
            f"layer ids {bad} are out of range for a model of {num_layers} layers: 0 (the embeddings) to "
            f"{num_layers} (the last layer's output), in vLLM numbering"
        )
    return sorted(layers)
