"""What a run needs to know about the model before the engine starts: that it loads at all
(configuration and tokenizer), its number of decoder layers, vocabulary and context length, and
which layer ids to record."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from layertap.generate.errors import GenerateError


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


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def load_model_info(model: str, engine_args: dict, need_tokenizer: bool = True) -> ModelInfo:
    """Loads the model's configuration and, when rows must be tokenized (``need_tokenizer``),
    its tokenizer, the way vLLM will (same revision, tokenizer and trust_remote_code). Raises
    GenerateError (one line) when either fails. Token-id data needs no tokenizer (a model
    directory with only ``config.json`` and ``load_format="dummy"`` works)."""
    from transformers import AutoConfig, AutoTokenizer

    revision = engine_args.get("revision")
    trust = bool(engine_args.get("trust_remote_code", False))
    try:
        config = AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust)
    except Exception as e:  # transformers raises OSError, ValueError, and others per model type
        raise GenerateError(f"cannot load model {model!r}: {_first_line(e)}") from None
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
            raise GenerateError(f"cannot load the tokenizer of {tok_name!r}: {_first_line(e)}") from None
    vocab = max(int(getattr(text, "vocab_size", 0) or 0), len(tokenizer) if tokenizer is not None else 0)
    return ModelInfo(
        name=model,
        revision=revision or "",
        num_layers=num_layers,
        vocab_size=vocab,
        max_positions=getattr(text, "max_position_embeddings", None),
        tokenizer=tokenizer,
        architectures=list(getattr(config, "architectures", None) or []),
    )


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's layers in vLLM numbering, ``[2, N//2, N-3, N]``: three auxiliary layers and the
    last decoder layer's output (before the final norm). On models too small for four distinct
    ids, the distinct ones in range."""
    n = num_layers
    return sorted({i for i in (2, n // 2, n - 3, n) if 0 <= i <= n})


def parse_layers(layers: Any, num_layers: int) -> list[int]:
    """Layer ids from ``--layers`` ("2,16,29,32" or a list), checked against the model;
    None: the EAGLE-3 default. Returned ascending (the order the records store)."""
    if layers is None:
        return default_layers(num_layers)
    if isinstance(layers, str):
        try:
            layers = [int(p) for p in layers.replace(" ", "").split(",") if p]
        except ValueError:
            raise GenerateError(f"--layers must be comma-separated integers, got {layers!r}") from None
    if (
        not isinstance(layers, (list, tuple))
        or not layers
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
    ):
        raise GenerateError(f"layers must be a non-empty list of integers, got {layers!r}")
    if len(set(layers)) != len(layers):
        raise GenerateError(f"layers {list(layers)} repeat an id; give each once")
    bad = [i for i in layers if not 0 <= i <= num_layers]
    if bad:
        raise GenerateError(
            f"layer ids {bad} are out of range for a model of {num_layers} layers: 0 (the embeddings) to "
            f"{num_layers} (the last layer's output), in vLLM numbering"
        )
    return sorted(layers)
