"""The engines of ``--data-parallel-size N`` on this machine: one process each
(``python -m layertap.generate.worker``), given its GPUs (``CUDA_VISIBLE_DEVICES``), its options
and rows on its standard input, and a pipe for its reports.

Each engine process leads a process group of its own, and kills it when its standard input closes:
when this process dies, however it dies, no engine outlives it writing into a part that the next
run resumes.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import numpy as np

from layertap.generate import vllm_log
from layertap.generate.engine import gpus_per_engine
from layertap.generate.errors import GenerateError
from layertap.generate.options import GenerateOptions

#: Seconds an engine is given to stop after SIGTERM before it is killed (when this run is
#: interrupted).
STOP_SECONDS = 20.0


def _visible_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` names them."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    try:
        import torch  # here: seconds to import, and only asked where CUDA_VISIBLE_DEVICES is not set

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a torch without CUDA, or no driver
        count = 0
    return [str(i) for i in range(count)]


def device_slices(engines: int, engine_args: dict) -> list[dict[str, str]]:
    """The environment each engine adds to this one: its share of the GPUs (none without GPUs: a
    CPU build of vLLM's engines share the cores)."""
    per_engine = gpus_per_engine(engine_args)
    gpus = _visible_gpus()
    if not gpus:
        return [{} for _ in range(engines)]
    if len(gpus) < engines * per_engine:
        raise GenerateError(
            f"--data-parallel-size {engines} engines of {per_engine} GPU(s) each need {engines * per_engine} GPUs; "
            f"{len(gpus)} are visible"
        )
    return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * per_engine : (i + 1) * per_engine])} for i in range(engines)]


class _Engine:
    """One engine process and the thread that reads its reports."""

    def __init__(
        self, index: int, options: GenerateOptions, first_run: int, rows: np.ndarray, env: dict, events: queue.Queue
    ):
        self.index = index
        self.events = events
        read_fd, write_fd = os.pipe()
        data = np.ascontiguousarray(rows, dtype="<i8").tobytes()
        spec = {"options": options.as_json(), "first_run": first_run, "rows": len(rows), "fd": write_fd}
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "layertap.generate.worker"],
                stdin=subprocess.PIPE,
                stdout=sys.stderr.fileno(),  # stdout is the run's summary; an engine's prints go with its logs
                # Its vLLM log goes into its part, once it has locked it (not into this run's file).
                env={k: v for k, v in {**os.environ, **env}.items() if k != vllm_log.PATH_ENV},
                pass_fds=(write_fd,),
                start_new_session=True,
            )
        finally:
            os.close(write_fd)
        self._reports = os.fdopen(read_fd, "rb")
        try:
            self.proc.stdin.write(json.dumps(spec).encode() + b"\n" + data)  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except BaseException:
            self._reports.close()
            self.stop()
            raise
        # stdin stays open: the engine reads its closing as this process's death.
        self.thread = threading.Thread(target=self._read, name=f"layertap-engine-{index}", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        result = None
        with self._reports:
            for line in self._reports:  # the worker's [kind, value] lines
                try:
                    kind, value = json.loads(line)
                except (ValueError, TypeError):
                    continue
                if kind == "report":
                    self.events.put((kind, self.index, value))
                else:
                    result = (kind, self.index, value)
        rc = self.proc.wait()
        if result is None:
            why = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
            result = ("error", self.index, ("failed", f"the engine process ended without a result ({why})"))
        self.events.put(result)

    def stop(self) -> None:
        """SIGTERM to the engine's group, SIGKILL if it has not ended in ``STOP_SECONDS``."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(STOP_SECONDS)
                return
            except subprocess.TimeoutExpired:
                continue

    def close(self) -> None:
        self.thread.join()
        if self.proc.stdin is not None:
            self.proc.stdin.close()


def local_events(
    specs: list[tuple[int, GenerateOptions, int, np.ndarray]], envs: list[dict[str, str]]
) -> Iterator[tuple]:
    """Starts an engine process per ``(index, options, first run number, row indices)``; yields
    their events until every engine has ended."""
    events: queue.Queue = queue.Queue()
    engines: list[_Engine] = []
    try:
        for index, options, first_run, rows in specs:
            engines.append(_Engine(index, options, first_run, rows, envs[index], events))
        left = len(engines)
        while left:
            event = events.get()
            if event[0] != "report":
                left -= 1
            yield event
    finally:
        for e in engines:
            if e.proc.poll() is None:  # interrupted, or a failure here: stop the others
                e.stop()
        for e in engines:
            e.close()


__all__ = ["device_slices", "local_events"]
