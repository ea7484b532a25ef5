"""The engines of ``layertap generate --ray ADDRESS``: one Ray task per engine, each asking for
its GPUs (one CPU on a cluster without GPUs), running ``run.run_engine`` and reporting its totals
to a small actor that this process reads twice a second.

The tasks write into ``--out``'s parts by path: every node must mount it at the same path. A task
is not retried: a retry elsewhere could not tell which rows the dead engine wrote; the next run
resumes them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from layertap._install import pip_install_keeping_torch
from layertap.generate import vllm_log
from layertap.generate.engine import gpus_per_engine
from layertap.generate.errors import GenerateError, first_line
from layertap.generate.options import GenerateOptions
from layertap.generate.run import run_engine

#: Seconds between two reads of the engines' reports.
POLL_SECONDS = 0.5

_connected_here = False
"""Whether ``connect`` initialised Ray in this process (so that the run disconnects after)."""


def _ray():
    try:
        import ray  # here: an optional dependency (pip install ray), needed by --ray only
    except ImportError as e:
        raise GenerateError(f"--ray needs the 'ray' package ({e}): {pip_install_keeping_torch('ray')}") from None
    return ray


def connect(address: str) -> None:
    """Connects this process to the Ray cluster at ``address``, unless it is connected already."""
    global _connected_here
    ray = _ray()
    if ray.is_initialized():
        return
    try:
        ray.init(address=address, logging_level="WARNING", log_to_driver=True)
    except Exception as e:  # ConnectionError, ValueError and Ray's own kinds
        first = str(e).strip().splitlines()
        raise GenerateError(f"--ray {address}: cannot connect to a Ray cluster: {first[0] if first else e}") from None
    _connected_here = True


def disconnect() -> None:
    global _connected_here
    if _connected_here:
        _ray().shutdown()
        _connected_here = False


def default_engines(engine_args: dict) -> int:
    """As many engines as the cluster's GPUs hold; a cluster without GPUs needs the number."""
    gpus = int(_ray().cluster_resources().get("GPU", 0))
    if not gpus:
        raise GenerateError("--ray: the cluster has no GPUs; give the number of engines with --data-parallel-size")
    engines = gpus // gpus_per_engine(engine_args)
    if engines < 1:
        raise GenerateError(f"--ray: an engine needs {gpus_per_engine(engine_args)} GPUs; the cluster has {gpus}")
    return engines


class _Board:
    """The engines' latest reports (a Ray actor)."""

    def __init__(self) -> None:
        self.latest: dict[int, dict] = {}

    def report(self, engine: int, totals: dict) -> None:
        self.latest[engine] = totals

    def read(self) -> dict[int, dict]:
        return self.latest


def _engine_task(engine: int, options: GenerateOptions, first_run: int, rows: np.ndarray, board) -> tuple[str, object]:
    vllm_log.localize()  # before vLLM is imported here
    return run_engine(options, first_run, rows, lambda totals: board.report.remote(engine, totals))


def ray_events(specs: list[tuple[int, GenerateOptions, int, np.ndarray]], engine_args: dict) -> Iterator[tuple]:
    """Starts a Ray task per ``(index, options, first run number, row indices)``; yields their
    events until every task has ended."""
    ray = _ray()
    pending: list = []
    try:
        gpus = gpus_per_engine(engine_args) if ray.cluster_resources().get("GPU", 0) else 0
        env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
        if gpus > 1 and "distributed_executor_backend" not in engine_args:
            # Inside a Ray task vLLM would place its tensor-parallel workers with Ray too; the
            # task already holds its GPUs, so they are this task's processes.
            mp = {"distributed_executor_backend": "mp"}
            specs = [(i, o.replace(engine_args={**o.engine_args, **mp}), r, a) for i, o, r, a in specs]
        board = ray.remote(_Board).options(num_cpus=0).remote()
        task = ray.remote(_engine_task).options(
            num_cpus=0 if gpus else 1, num_gpus=gpus, max_retries=0, runtime_env={"env_vars": env}
        )
        refs = {task.remote(i, o, r, rows, board): i for i, o, r, rows in specs}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_SECONDS)
            for engine, totals in ray.get(board.read.remote()).items():
                yield "report", engine, totals  # (unchanged totals count nothing)
            for ref in done:
                try:
                    kind, value = ray.get(ref)
                except Exception as e:  # the task's worker died (ray.exceptions.RayError kinds)
                    kind, value = "error", ("failed", first_line(e))
                yield kind, refs[ref], value
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)  # interrupted: no engine keeps writing
        disconnect()


__all__ = ["connect", "default_engines", "disconnect", "ray_events"]
