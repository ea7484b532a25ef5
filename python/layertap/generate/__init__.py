"""``layertap generate``: a hidden-states dataset from a prompt dataset (docs/GENERATE.md).

``layertap.generate(model, data, out, ...)`` runs it and returns the summary. The package itself
is callable, so that this name can be both the function and the package of its modules:
``layertap.generate(...)`` and ``from layertap.generate import generate`` are the same call.

The modules (docs/ARCHITECTURE.md) import one way: ``parallel`` (a run of many engines), then
``local`` and ``ray_engines`` (their processes, ``worker`` being one, or Ray tasks), then ``run``
(one engine's run), then what a run is made of. vLLM and transformers are imported only when a
run starts, after the checks that need neither.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

from layertap.generate.errors import GenerateError
from layertap.generate.options import GenerateOptions
from layertap.generate.parallel import generate_parallel, wants_parallel
from layertap.generate.resume import check_output_directory
from layertap.generate.run import check_options, run_one
from layertap.generate.store import settle_store_run, store_output
from layertap.generate.summary import Summary
from layertap.mooncake.address import is_store_address


def generate(*args: Any, **options: Any) -> Summary:
    """Writes the hidden states of every row of ``data`` into ``out`` and returns the summary
    (``layertap.generate.summary.Summary``; docs/GENERATE.md lists its fields). Takes
    ``GenerateOptions``' fields (``model``, ``data``, ``out``, then keyword arguments), or one
    ``GenerateOptions``. Raises GenerateError, before the engine starts, for bad input. Rerunning
    with the same ``out`` resumes: rows whose records exist (and pass their checks) are skipped.

    ``data_parallel_size`` runs that many engines, each writing a part of ``out`` (docs/SCALE.md);
    ``ray_address`` runs them on a Ray cluster. An ``out`` that holds such parts is resumed as a
    whole, whatever the number of engines.

    ``out`` may be a dataset in Mooncake Store, ``mooncake://MASTER_HOST:PORT/PREFIX``
    (docs/MOONCAKE.md): the run writes shards into ``also_dir`` (kept; resumable) or a temporary
    directory, and each record is put into the store as soon as it is written. The run is
    complete only once the store lists every record of the spool; a spool whose records the
    store lacks is kept (``also_dir`` in the summary) and a rerun with it as ``also_dir`` puts
    them.

    ``out`` must not be a file, nor a directory that holds files no layertap dataset holds
    unless ``allow_other_files`` (``--allow-other-files``): GenerateError, before anything else."""
    _refuse_in_a_spawned_import()
    given = args[0] if len(args) == 1 and not options else None
    return _generate(given if isinstance(given, GenerateOptions) else GenerateOptions(*args, **options))


# help() and editors show the options' names and defaults, as if written out here.
__signature__ = generate.__signature__ = inspect.signature(GenerateOptions).replace(return_annotation="Summary")  # type: ignore[attr-defined]


#: multiprocessing.spawn's functions that import the parent's main module in a child, and the
#: name of their argument that names it.
_SPAWN_IMPORTS = {"_fixup_main_from_path": "main_path", "_fixup_main_from_name": "mod_name"}


def _refuse_in_a_spawned_import() -> None:
    """A script that calls generate at its top level, without ``if __name__ == "__main__":``,
    calls it again in vLLM's engine process, which spawn starts by importing the script: that
    call would fail on the first one's lock, and the first with "Engine core initialization
    failed", neither naming the cause. Only during that import: a process of the user's own,
    spawned, may call generate from its target."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        argument = _SPAWN_IMPORTS.get(code.co_name)  # the script's path, or its module (python -m)
        if argument is not None and code.co_filename.endswith("spawn.py"):
            script = frame.f_locals.get(argument, "the script")
            raise GenerateError(
                "layertap.generate was called while a process that multiprocessing started (vLLM's engine) "
                f'imported {script} again: call it under `if __name__ == "__main__":`'
            )
        frame = frame.f_back


def _generate(o: GenerateOptions) -> Summary:
    # Before anything is imported or written: an --out that cannot be a dataset directory.
    if not is_store_address(o.out):
        check_output_directory(o.out, "--out", o.allow_other_files)
        return generate_parallel(o) if wants_parallel(o) else run_one(check_options(o))
    if o.also_dir is not None:
        check_output_directory(o.also_dir, "--also-dir", o.allow_other_files)
    with store_output(o.out, o.also_dir, o.connector_args) as (spool, args):
        # The spool: --also-dir, checked above, or a new directory.
        spool_run = o.replace(out=spool.path, also_dir=None, connector_args=args, allow_other_files=True)
        return settle_store_run(_generate(spool_run), o.out, spool)


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return generate(*args, **kwargs)

    __call__.__doc__ = generate.__doc__


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["GenerateError", "GenerateOptions", "generate"]
