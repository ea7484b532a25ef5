"""vLLM's ExampleHiddenStatesConnector with its worker-side hooks timed, for the benchmark.

The subclass changes nothing but wrapping each hook that runs on the engine thread in a timer,
so the upstream baseline is measured the same way as layertap's connector (time per engine step
spent in the connector). The timings go to the JSON file named by `BENCH_TIMING_PATH` at exit.
"""

from __future__ import annotations

import atexit
import json
import os
import time

from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)

_WORKER_HOOKS = ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished")


class TimedExampleHiddenStatesConnector(ExampleHiddenStatesConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._bench_step = 0.0
        self._bench_steps: list[float] = []
        self._bench_path = os.environ.get("BENCH_TIMING_PATH") if self.role.name == "WORKER" else None
        if self._bench_path:
            atexit.register(self._bench_dump)

    def _bench_dump(self) -> None:
        # Written every 32 steps too: an engine process may be killed before atexit runs.
        with open(self._bench_path, "w") as f:
            json.dump({"step_seconds": self._bench_steps}, f)


def _timed(name: str):
    inner = getattr(ExampleHiddenStatesConnector, name)

    def hook(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            self._bench_step += time.perf_counter() - t0
            if name == "get_finished":  # the last hook of an engine step
                self._bench_steps.append(self._bench_step)
                self._bench_step = 0.0
                if self._bench_path and len(self._bench_steps) % 32 == 0:
                    self._bench_dump()

    hook.__name__ = name
    return hook


for _name in _WORKER_HOOKS:
    setattr(TimedExampleHiddenStatesConnector, _name, _timed(_name))
