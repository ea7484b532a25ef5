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

Nothing here imports vLLM until ``register()`` runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from layertap.vllm.models.families import FAMILIES, Family

#: The environment variable that turns the plugin on (in every process vLLM starts).
ENV_VAR = "LAYERTAP_EAGLE3"


def architectures_from_env(value: str | None = None) -> list[str]:
    """The architectures ``LAYERTAP_EAGLE3`` asks for: unset, empty or ``0``: none; ``1``: every
    architecture of ``FAMILIES``; otherwise a comma-separated list of architecture names."""
    value = (os.environ.get(ENV_VAR, "") if value is None else value).strip()
    if value in ("", "0"):
        return []
    if value == "1":
        return list(FAMILIES)
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in FAMILIES]
    if unknown:
        raise ValueError(
            f"{ENV_VAR}={value!r}: unknown architecture(s) {unknown}; use 1 (all) or names among {sorted(FAMILIES)}"
        )
    return names


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
        raise ValueError(f"layertap plugin: unknown architecture(s) {unknown}; known: {sorted(FAMILIES)}")
    registered = []
    for name in names:
        cls = with_aux_hidden_states(name)
        if cls.__module__.startswith("vllm."):
            continue  # vLLM's own class has the interface
        ModelRegistry.register_model(name, cls)
        registered.append(name)
    return registered


__all__ = ["ENV_VAR", "FAMILIES", "Family", "architectures_from_env", "register"]
