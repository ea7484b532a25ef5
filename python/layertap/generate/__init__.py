"""``layertap generate``: a hidden-states dataset from a prompt dataset (docs/GENERATE.md).

``layertap.generate(model, data, out, ...)`` runs it and returns the summary. The package itself
is callable, so that this name can be both the function and the package of its modules:
``layertap.generate(...)`` and ``from layertap.generate import generate`` are the same call.

Modules, each importing only those after it: ``parallel`` (a run of many engines: their parts of
``out``, the rows dealt out, one progress and one summary), ``local`` and ``ray_engines`` (the
engines' processes on this machine, ``worker`` being one, or Ray tasks), ``run`` (one engine's run:
every input checked, then the engine over the rows not done); and what a run is made of: ``data``
(reading rows), ``render`` (rows to token ids), ``model`` (the model's facts and layer ids),
``capture`` (what vLLM can record of the model, checked before it is imported; ``vllm_source``
reads vLLM's model classes from its source), ``resume`` (what the output directory holds; ``repair``, its damaged records),
``engine`` (the vLLM loop), ``progress``, ``summary``, ``vllm_log`` (where vLLM's log goes). The
command line is ``layertap.cli.generate``. vLLM and transformers are imported only when a run
starts, after the checks that need neither.
"""

from __future__ import annotations

import os
import sys
import types

from layertap._choices import DEFAULT_CAPTURE
from layertap.generate.errors import GenerateError
from layertap.generate.parallel import generate_parallel, wants_parallel
from layertap.generate.resume import check_output_directory
from layertap.generate.run import check_options, run_one
from layertap.generate.store import is_store_address, settle_store_run, store_output
from layertap.generate.summary import Summary


def generate(
    model: str,
    data: str | os.PathLike,
    out: str | os.PathLike,
    *,
    layers: str | list[int] | None = None,
    max_tokens: int = 1,
    include_output_tokens: bool = False,
    window: list | str | None = None,
    reduction: str | None = None,
    max_len: int | None = None,
    limit: int | None = None,
    engine_args: dict | str | None = None,
    sampling_args: dict | str | None = None,
    connector_args: dict | str | None = None,
    progress: str = "auto",
    progress_interval: float = 10.0,
    data_parallel_size: int | None = None,
    ray_address: str | None = None,
    capture: str = DEFAULT_CAPTURE,
    also_dir: str | os.PathLike | None = None,
    loss_mask: str = "auto",
    allow_other_files: bool = False,
) -> Summary:
    """Writes the hidden states of every row of ``data`` into ``out`` and returns the summary
    (a ``layertap.generate.summary.Summary``; docs/GENERATE.md lists its fields). Raises GenerateError, before the engine starts, for bad
    input. Rerunning with the same ``out`` resumes: rows whose records exist (and pass their
    checks) are skipped.

    ``data_parallel_size`` runs that many engines, each writing a part of ``out`` (docs/SCALE.md);
    ``ray_address`` runs them on a Ray cluster. An ``out`` that holds such parts is resumed as a
    whole, whatever the number of engines.

    ``out`` may be a dataset in Mooncake Store, ``mooncake://MASTER_HOST:PORT/PREFIX``
    (docs/MOONCAKE.md): the run writes shards into ``also_dir`` (kept; resumable) or a temporary
    directory, and each record is put into the store as soon as it is written. The run is
    complete only once the store lists every record of the spool; a spool whose records the
    store lacks is kept (``also_dir`` in the summary) and a rerun with it as ``also_dir`` puts
    them.

    ``loss_mask`` (``--loss-mask``): ``"auto"`` stores the data's ``loss_mask`` column when it has
    one, else, for chats whose template has ``{% generation %}`` markers, the assistant mask
    (transformers' ``return_assistant_tokens_mask``); ``"assistant"`` that mask (refused without
    the markers); ``"none"`` no mask.

    ``out`` must not be a file, nor a directory that holds files no layertap dataset holds
    unless ``allow_other_files`` (``--allow-other-files``): GenerateError, before anything else."""
    # Before anything is imported or written: an --out that cannot be a dataset directory.
    if not is_store_address(os.fspath(out)):
        check_output_directory(os.fspath(out), "--out", allow_other_files)
    elif also_dir is not None:
        check_output_directory(os.fspath(also_dir), "--also-dir", allow_other_files)
    if is_store_address(os.fspath(out)):
        with store_output(os.fspath(out), also_dir, connector_args) as (spool, args):
            summary = generate(
                model,
                data,
                spool.path,
                layers=layers,
                max_tokens=max_tokens,
                include_output_tokens=include_output_tokens,
                window=window,
                reduction=reduction,
                max_len=max_len,
                limit=limit,
                engine_args=engine_args,
                sampling_args=sampling_args,
                connector_args=args,
                progress=progress,
                progress_interval=progress_interval,
                data_parallel_size=data_parallel_size,
                ray_address=ray_address,
                capture=capture,
                loss_mask=loss_mask,
                allow_other_files=True,  # the spool: --also-dir, checked above, or a new directory
            )
            return settle_store_run(summary, os.fspath(out), spool)
    if also_dir is not None:
        raise GenerateError("--also-dir goes with --out mooncake://...: a run to a directory writes there")
    options = {
        "model": model,
        "data": os.fspath(data),
        "out": os.fspath(out),
        "layers": layers,
        "max_tokens": max_tokens,
        "include_output_tokens": include_output_tokens,
        "window": window,
        "reduction": reduction,
        "max_len": max_len,
        "limit": limit,
        "engine_args": engine_args,
        "sampling_args": sampling_args,
        "connector_args": connector_args,
        "progress": progress,
        "progress_interval": progress_interval,
        "capture": capture,
        "loss_mask": loss_mask,
    }
    if wants_parallel(options["out"], data_parallel_size, ray_address):
        return generate_parallel(options, data_parallel_size, ray_address)
    return run_one(check_options(options))


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return generate(*args, **kwargs)

    __call__.__doc__ = generate.__doc__


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["GenerateError", "generate"]
