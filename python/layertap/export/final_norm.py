"""The verifier's final norm, for exports whose trainer wants the last hidden state *after* it
(SpecForge's EAGLE-3 ``hidden_state``, Model-Optimizer's ``hidden_states``), while layertap stores vLLM's layer id N, the last decoder
layer's output *before* it.

The norm is transformers' own module of the model's family (``LlamaRMSNorm``,
``Qwen3RMSNorm``, ``Gemma3RMSNorm`` with its ``1 + weight``...), built from the model's config on
the meta device (no weights are loaded but the norm's) and given the norm's weights from the
model's safetensors checkpoint. It runs in float32 on the stored states and its result is
rounded once to the export's dtype. A model whose transformers class has no final norm where
decoder models keep it (``model.get_decoder().norm``), or whose checkpoint lacks its weights,
is refused with a message saying so.
"""

from __future__ import annotations

import json
import os
from typing import Any

from layertap.errors import InvalidInputError


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def model_dims(model_dir: str) -> tuple[int, int]:
    """(N, hidden size) of the model in ``model_dir`` (its text model's): N its decoder layers."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise InvalidInputError(f"--model {model_dir}: cannot read the model's config: {e}") from None
    text = _text_config(config)
    return int(text.num_hidden_layers), int(text.hidden_size)


def _checkpoint_files(model_dir: str) -> dict[str, str]:
    """Weight name -> safetensors file holding it, from the checkpoint's index or its one file."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        return {k: os.path.join(model_dir, v) for k, v in weight_map.items()}
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise InvalidInputError(
        f"--model {model_dir}: no safetensors checkpoint (model.safetensors or "
        "model.safetensors.index.json) to read the final norm's weights from"
    )


class FinalNorm:
    """Applies a model's final norm: ``norm(states)`` for states ``[..., hidden]``."""

    def __init__(self, model_dir: str):
        import torch
        from safetensors import safe_open
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            config = AutoConfig.from_pretrained(model_dir)
        except (OSError, ValueError) as e:
            raise InvalidInputError(f"--model {model_dir}: cannot read the model's config: {e}") from None
        family = getattr(config, "model_type", "?")
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        except (ValueError, KeyError, ImportError) as e:
            raise InvalidInputError(
                f"--model {model_dir}: transformers cannot build a {family!r} causal LM to find its final "
                f"norm ({e}); this model family is not supported"
            ) from None
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        norm = getattr(decoder, "norm", None)
        if not isinstance(norm, torch.nn.Module) or not list(norm.parameters()):
            raise InvalidInputError(
                f"--model {model_dir}: the {family!r} model ({type(model).__name__}) has no final norm at "
                "model.get_decoder().norm; this model family is not supported by the export"
            )
        prefix = next(name for name, module in model.named_modules() if module is norm)
        files = _checkpoint_files(model_dir)
        state = {}
        for pname, _ in norm.named_parameters():
            key = f"{prefix}.{pname}"
            if key not in files:
                raise InvalidInputError(
                    f"--model {model_dir}: the checkpoint has no {key!r}, the final norm's {pname} "
                    f"({type(norm).__name__})"
                )
            with safe_open(files[key], framework="pt") as f:
                state[pname] = f.get_tensor(key)
        norm = norm.to_empty(device="cpu")
        norm.load_state_dict(state)
        self.module = norm.float().eval()
        self.family = family
        self.kind = type(norm).__name__
        self.hidden_size = int(_text_config(config).hidden_size)
        self.num_hidden_layers = int(_text_config(config).num_hidden_layers)

    def __call__(self, states: Any, dtype: Any) -> Any:
        """``norm(states)`` computed in float32, returned in ``dtype``."""
        import torch

        with torch.no_grad():
            return self.module(states.float()).to(dtype)


__all__ = ["FinalNorm", "model_dims"]
