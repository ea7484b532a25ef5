"""layertap's vLLM general plugin (entry point ``vllm.general_plugins``: ``layertap``).

vLLM calls ``register`` in every process it starts whenever layertap is installed. It does
nothing, and imports nothing of layertap, unless ``LAYERTAP_EAGLE3`` or ``LAYERTAP_IN_MODEL`` is
set: then it registers layertap's model classes (``layertap.vllm.models``): with the EAGLE-3
interface, or able to cache their hidden states themselves (connector option
``capture="in-model"``). This module lies outside the ``layertap`` package so that an engine that
does not ask for it loads no layertap code.
"""

import os

#: The variables that turn the plugin on (``layertap.vllm.models``: ``ENV_VAR``, ``IN_MODEL_ENV_VAR``).
SWITCHES = ("LAYERTAP_EAGLE3", "LAYERTAP_IN_MODEL")


def register() -> None:
    if all(os.environ.get(var, "").strip() in ("", "0") for var in SWITCHES):
        return
    from layertap.vllm.models import register_from_env

    register_from_env()
