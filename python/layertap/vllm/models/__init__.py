"""The plugin's model classes (docs/CONNECTOR.md, "Models without the EAGLE-3 interface").

``register()``: for each architecture of ``FAMILIES``, a subclass of vLLM's model class with
vLLM's ``SupportsEagle3`` (which ``extract_hidden_states`` needs), reading the residual stream with
forward hooks (``classes.py``). ``register_in_model()``: for each of ``IN_MODEL_FAMILIES``, a class
that can also cache its hidden states itself (``capture="in-model"``, ``in_model.py``).

vLLM calls its general plugins (entry point ``layertap_vllm_plugin``) in every process it starts,
without arguments and before any configuration is known, and the worker half is built only after
the model is loaded: so environment variables (``LAYERTAP_EAGLE3``, ``LAYERTAP_IN_MODEL``), not the
connector's configuration, turn the classes on. Nothing here imports vLLM until they register.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from layertap.vllm.errors import PluginError
from layertap.vllm.models.families import FAMILIES, IN_MODEL_FAMILIES, Family

ENV_VAR = "LAYERTAP_EAGLE3"
IN_MODEL_ENV_VAR = "LAYERTAP_IN_MODEL"


def _names_from_env(var: str, value: str | None, known: dict[str, Family]) -> list[str]:
    """Unset, empty or ``0``: none; ``1``: all of ``known``; else a comma-separated list."""
    value = (os.environ.get(var, "") if value is None else value).strip()
    if value in ("", "0"):
        return []
    if value == "1":
        return list(known)
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise PluginError(
            f"{var}={value!r}: unknown architecture(s) {unknown}; use 1 (all) or names among {sorted(known)}"
        )
    return names


def architectures_from_env(value: str | None = None) -> list[str]:
    return _names_from_env(ENV_VAR, value, FAMILIES)


def in_model_architectures_from_env(value: str | None = None) -> list[str]:
    return _names_from_env(IN_MODEL_ENV_VAR, value, IN_MODEL_FAMILIES)


def register(architectures: Iterable[str] | None = None) -> list[str]:
    """Registers the EAGLE-3 class for ``architectures`` (default: all of ``FAMILIES``) in this
    process's vLLM registry, before the engine is created; returns those registered (a vLLM
    class that has the interface is kept). Imports vLLM's modules of those architectures (a few
    seconds; vLLM's own registry defers that to a subprocess, which costs more the first time)."""
    from vllm import ModelRegistry

    from layertap.vllm.models.classes import with_aux_hidden_states

    names = list(FAMILIES) if architectures is None else list(architectures)
    unknown = [name for name in names if name not in FAMILIES]
    if unknown:
        raise PluginError(f"layertap plugin: unknown architecture(s) {unknown}; known: {sorted(FAMILIES)}")
    registered = []
    for name in names:
        cls = with_aux_hidden_states(name)
        if cls.__module__.startswith("vllm."):
            continue  # vLLM's own class has the interface
        ModelRegistry.register_model(name, cls)
        registered.append(name)
    return registered


def register_in_model(architectures: Iterable[str] | None = None) -> list[str]:
    """Registers the in-model class for ``architectures`` (default: all of ``IN_MODEL_FAMILIES``),
    as ``register()`` does; returns the names registered."""
    from vllm import ModelRegistry

    from layertap.vllm.models.in_model import in_model_class

    names = list(IN_MODEL_FAMILIES) if architectures is None else list(architectures)
    unknown = [name for name in names if name not in IN_MODEL_FAMILIES]
    if unknown:
        raise PluginError(
            f"layertap plugin: no in-model capture for architecture(s) {unknown}; known: {sorted(IN_MODEL_FAMILIES)}"
        )
    for name in names:
        ModelRegistry.register_model(name, in_model_class(name))
    _forget_resolved_classes()
    return names


def _forget_resolved_classes() -> None:
    """Drops vLLM's cache of the class each model resolved to (``_MODEL_ARCH_BY_HASH``, keyed by
    path and architectures, not by the registry): else a model that already ran in this process
    with vLLM's class would be built with it again, without the cache layer."""
    from vllm.model_executor.model_loader import utils

    cache = getattr(utils, "_MODEL_ARCH_BY_HASH", None)
    if isinstance(cache, dict):
        cache.clear()


def missing_cache_layer(architectures: Iterable[str] | None, found: list[str]) -> Exception:
    """The error for ``capture="in-model"`` when the model made no single cache layer (``found``)."""
    from layertap.vllm.config import ConfigError

    archs = list(architectures or [])
    if len(found) > 1:
        return ConfigError("capture", f'"in-model": the model has several cache-only layers {found}; expected one')
    uncovered = [a for a in archs if a not in IN_MODEL_FAMILIES]
    if uncovered:
        why = f"layertap's plugin has no in-model class for {uncovered} (it covers {sorted(IN_MODEL_FAMILIES)})"
    else:
        asked = os.environ.get(IN_MODEL_ENV_VAR)
        why = (
            f"layertap's plugin did not register its class for {archs} in the worker process "
            f"({IN_MODEL_ENV_VAR}={asked!r} there); set {IN_MODEL_ENV_VAR}=1 in the environment of the "
            'process that creates the engine, before it is created (docs/CONNECTOR.md, "Capture in the model")'
        )
    return ConfigError("capture", f'"in-model": the model has no hidden-states cache layer: {why}')


def register_from_env() -> None:
    """The plugin's entry point (an architecture named by both variables gets the in-model class,
    which has the EAGLE-3 interface too)."""
    eagle3 = architectures_from_env()
    in_model = in_model_architectures_from_env()
    if eagle3:
        register(eagle3)
    if in_model:
        register_in_model(in_model)
