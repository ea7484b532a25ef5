"""``layertap generate``: a hidden-states dataset from a prompt dataset (docs/GENERATE.md).

``layertap.generate(model, data, out, ...)`` runs it and returns the summary. The package itself
is callable, so that this name can be both the function and the package of its modules:
``layertap.generate(...)`` and ``from layertap.generate import generate`` are the same call.

Modules: ``data`` (reading rows), ``render`` (rows to token ids), ``model`` (the model's facts
and layer ids), ``capture`` (what vLLM can record of the model, checked before it is imported;
``vllm_source`` reads vLLM's model classes from its source), ``resume`` (what the output
directory holds), ``engine`` (the vLLM loop), ``progress``, ``summary``, ``vllm_log`` (where vLLM's
log goes), and ``run`` (the whole run); the command line is ``layertap.cli.generate``. vLLM and transformers are imported only when a run starts,
after the checks that need neither.
"""

from __future__ import annotations

import sys
import types

from layertap.generate.errors import GenerateError
from layertap.generate.run import generate


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return generate(*args, **kwargs)

    __call__.__doc__ = generate.__doc__


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["GenerateError", "generate"]
