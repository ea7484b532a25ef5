"""Whether vLLM can record the chosen layers of this model the chosen way, checked before vLLM is
imported: what vLLM would otherwise refuse only after its engine has started (a traceback, then
"Model does not support EAGLE3 interface", or a ``KeyError: -1`` for layer 0 in its Transformers
backend), which no rerun fixes. Each refusal names the fix (docs/CONNECTOR.md, "Models without the
EAGLE-3 interface"; docs/GENERATE.md, "Bad input")."""

from __future__ import annotations

from typing import Any

from layertap._checks import one_of
from layertap._choices import CAPTURE_MODES
from layertap._install import INSTALL_VLLM
from layertap.generate import vllm_source
from layertap.generate.errors import GenerateError
from layertap.vllm.models import ENV_VAR, FAMILIES, IN_MODEL_FAMILIES, architectures_from_env


def require_vllm() -> None:
    """vLLM must be installed (found without importing it)."""
    if vllm_source.package_dir() is None:
        raise GenerateError(f"layertap generate needs vLLM, which is not installed here: {INSTALL_VLLM}")


def check_capture(capture: Any, architectures: list[str]) -> str:
    """``--capture``; with ``in-model``, the model's architecture must be one the plugin covers."""
    one_of("--capture", capture, CAPTURE_MODES, GenerateError)
    if capture == "in-model":
        uncovered = [a for a in architectures if a not in IN_MODEL_FAMILIES] or (not architectures and ["?"])
        if uncovered:
            raise GenerateError(
                f"--capture in-model: no in-model class for the model's architecture {architectures}; "
                f"covered: {', '.join(sorted(IN_MODEL_FAMILIES))} (use --capture method)"
            )
    return capture


def _plugin_architectures() -> list[str]:
    """The architectures ``LAYERTAP_EAGLE3`` turns the plugin on for (in the engine's processes)."""
    try:
        return architectures_from_env()
    except ValueError as e:  # an unknown name would stop vLLM at start-up
        raise GenerateError(f"{ENV_VAR}: {e}") from None


def check_served(
    architectures: list[str],
    capture: str,
    layer_ids: list[int],
    num_layers: int,
    layers_given: bool,
    engine_args: dict,
) -> None:
    """Refuses, before anything starts, a model whose layers ``--capture method`` cannot record: a
    class without the EAGLE-3 interface that layertap's plugin does not give it, or layer id 0
    where vLLM runs it through its Transformers backend (which records decoder layers' outputs
    only) or where vLLM's own capture fails on it. Nothing where vLLM's source does not say."""
    plugin = _plugin_architectures()
    if capture != "method":
        return
    found = vllm_source.model_class(architectures, str(engine_args.get("model_impl", "auto")))
    if found is None:
        return
    arch = found.architecture
    if found.transformers_backend:
        if 0 in layer_ids:
            default = "" if layers_given else " (the default layers of a model this small include 0)"
            raise GenerateError(
                f"layer id 0 (the embeddings) cannot be recorded from {arch}: vLLM runs it through its "
                f"Transformers backend, which records the outputs of decoder layers only (ids 1 to "
                f"{num_layers}){default}; pass --layers without 0"
            )
        return
    if 0 in layer_ids and vllm_source.cannot_record_layer_zero(arch):
        default = "" if layers_given else " (the default layers of a model this small include 0)"
        raise GenerateError(
            f"layer id 0 (the embeddings) cannot be recorded from {arch} with --capture method: vLLM's own "
            f"capture in its model adds a residual that does not exist yet before the first layer{default}; "
            "pass --layers without 0, or --capture in-model (layertap's class records it)"
        )
    if found.eagle3 is not False or arch in plugin:
        return
    lacks = (
        f"vLLM's {found.class_name} ({arch}) lacks the EAGLE-3 interface that --capture method "
        "(vLLM's extract_hidden_states) needs"
    )
    if arch in FAMILIES:
        raise GenerateError(
            f"{lacks}; set {ENV_VAR}=1 (layertap's plugin adds the interface to it) or pass --capture in-model"
        )
    if arch in IN_MODEL_FAMILIES:
        raise GenerateError(f"{lacks}; pass --capture in-model (layertap's class for it)")
    raise GenerateError(
        f"{lacks}, and layertap's plugin has no class for it (docs/CONNECTOR.md lists those it covers): "
        "this vLLM cannot record its hidden states"
    )


__all__ = ["check_capture", "check_served", "require_vllm"]
