"""layertap's vLLM general plugin (entry point ``vllm.general_plugins``: ``layertap``).

vLLM calls ``register`` in every process it starts whenever layertap is installed. It does
nothing, and imports nothing of layertap, unless ``LAYERTAP_EAGLE3`` is set: then it registers
layertap's model classes with the EAGLE-3 interface (``layertap.vllm.models``). This module lies
outside the ``layertap`` package so that an engine that does not ask for it loads no layertap code.
"""

import os


def register() -> None:
    if os.environ.get("LAYERTAP_EAGLE3", "").strip() in ("", "0"):
        return
    from layertap.vllm.models import architectures_from_env
    from layertap.vllm.models import register as register_models

    register_models(architectures_from_env())
