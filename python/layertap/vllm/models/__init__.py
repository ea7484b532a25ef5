"""The EAGLE-3 interface for models that lack it, so that ``extract_hidden_states`` serves them.

vLLM's ``extract_hidden_states`` method (which the connector rides on) only runs models that
implement vLLM's ``SupportsEagle3``. ``register()`` registers, for each architecture of
``FAMILIES``, a subclass of vLLM's model class that implements it by reading the residual stream
at the chosen layers with forward hooks (``classes.py``); vLLM's own classes are not changed.

vLLM loads it as a general plugin (entry point ``vllm.general_plugins``, name ``layertap``) in every
process it starts, but the plugin only registers when the environment variable
``LAYERTAP_EAGLE3`` asks for it (see ``architectures_from_env``): plugins are called without
arguments before any configuration is known, and the connector's worker half is built only after
the model is loaded, so the connector's configuration cannot turn it on. The entry point is the
top-level module ``layertap_vllm_plugin``, which imports nothing of layertap unless the variable
is set (docs/CONNECTOR.md, "Models without the EAGLE-3 interface").

``register_in_model()`` registers, for each architecture of ``IN_MODEL_FAMILIES`` (with or without
vLLM's interface), a class that can also cache its hidden states itself, without vLLM's
speculative method, when the connector's configuration asks for it (``capture="in-model"``;
``in_model.py``); the plugin does so when ``LAYERTAP_IN_MODEL`` is set.

Nothing here imports vLLM until ``register()`` or ``register_in_model()`` runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from layertap.vllm.errors import PluginError
from layertap.vllm.models.families import FAMILIES, IN_MODEL_FAMILIES, Family

#: The environment variable that turns the plugin's EAGLE-3 classes on (in every process vLLM starts).
ENV_VAR = "LAYERTAP_EAGLE3"
#: The environment variable that turns the plugin's in-model capture classes on.
IN_MODEL_ENV_VAR = "LAYERTAP_IN_MODEL"


def _names_from_env(var: str, value: str | None, known: dict[str, Family]) -> list[str]:
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
    """The architectures ``LAYERTAP_EAGLE3`` asks for: unset, empty or ``0``: none; ``1``: every
    architecture of ``FAMILIES``; otherwise a comma-separated list of architecture names."""
    return _names_from_env(ENV_VAR, value, FAMILIES)


def in_model_architectures_from_env(value: str | None = None) -> list[str]:
    """The architectures ``LAYERTAP_IN_MODEL`` asks for, as ``architectures_from_env`` reads
    ``LAYERTAP_EAGLE3``, among ``IN_MODEL_FAMILIES``."""
    return _names_from_env(IN_MODEL_ENV_VAR, value, IN_MODEL_FAMILIES)


def register(architectures: Iterable[str] | None = None) -> list[str]:
    """Registers the plugin's model class for ``architectures`` (default: all of ``FAMILIES``) in
    this process's vLLM model registry, and returns the names registered: those whose vLLM class
    lacks the interface (a later vLLM that adds it keeps its own class). Call it before the engine
    is created, in every process that loads the model (the plugin does so when
    ``LAYERTAP_EAGLE3`` is set). It imports vLLM's modules of those architectures (a few seconds
    in a process that has imported no model yet); vLLM's own registry defers that to a
    subprocess per architecture, which costs more the first time (its result is cached)."""
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
    """Registers, for ``architectures`` (default: all of ``IN_MODEL_FAMILIES``), the model class
    that caches its hidden states itself when the connector's configuration says
    ``capture="in-model"`` (and is the class it extends otherwise: vLLM's, with the EAGLE-3
    interface added where vLLM's lacks it), and returns the names registered. Call it where
    ``register()`` would be called; the plugin does so when ``LAYERTAP_IN_MODEL`` is set."""
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
    """Drops vLLM's cache of the class each model resolved to in this process
    (``model_loader.utils._MODEL_ARCH_BY_HASH``, keyed by the model's path and architectures, not
    by the registry): without this, an engine of a model that already ran in this process with
    vLLM's class would be built with it again, without the cache layer. vLLM versions without the
    cache need nothing."""
    try:
        from vllm.model_executor.model_loader import utils
    except ImportError:
        return
    cache = getattr(utils, "_MODEL_ARCH_BY_HASH", None)
    if isinstance(cache, dict):
        cache.clear()


def missing_cache_layer(architectures: Iterable[str] | None, found: list[str]) -> Exception:
    """The error for an engine configured with ``capture="in-model"`` whose model did not make
    its cache layer (``found``: the cache-only layers there are): why, and what to do."""
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
    """What the plugin's entry point does: registers the classes ``LAYERTAP_EAGLE3`` and
    ``LAYERTAP_IN_MODEL`` ask for (an architecture named by both gets the in-model class, which
    has the EAGLE-3 interface too)."""
    eagle3 = architectures_from_env()
    in_model = in_model_architectures_from_env()
    if eagle3:
        register(eagle3)
    if in_model:
        register_in_model(in_model)


__all__ = [
    "ENV_VAR",
    "FAMILIES",
    "IN_MODEL_ENV_VAR",
    "IN_MODEL_FAMILIES",
    "Family",
    "architectures_from_env",
    "in_model_architectures_from_env",
    "missing_cache_layer",
    "register",
    "register_from_env",
    "register_in_model",
]
