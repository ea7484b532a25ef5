"""Stops vLLM's engine-core process when the process that started it dies.

vLLM 0.32's engine core does not watch its parent (vllm-project/vllm#55510): after ``kill -9`` (or
the OOM killer) of its parent, it and its workers went on holding their open shards, and the same
command run again stopped on "a live writer holds this shard". The scheduler half starts this
watch in the engine core: SIGTERM, vLLM's clean shutdown, once the parent is gone.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from multiprocessing.connection import wait

#: The names vLLM gives its engine-core processes (``EngineCore``, ``EngineCore_DP0``...).
ENGINE_CORE_PREFIX = "EngineCore"

_watching = False  # one watch a process, however many connectors it builds


def watch_parent() -> threading.Thread | None:
    """In an engine-core process started by multiprocessing: a daemon thread waiting on the
    parent's sentinel (no polling). Elsewhere (in-process engine, Ray actor) nothing."""
    global _watching
    parent = multiprocessing.parent_process()
    if _watching or parent is None or parent.sentinel is None:
        return None
    if not multiprocessing.current_process().name.startswith(ENGINE_CORE_PREFIX):
        return None
    thread = threading.Thread(
        target=_stop_when_gone, args=(parent.sentinel,), name="layertap-parent-watch", daemon=True
    )
    thread.start()
    _watching = True
    return thread


def _stop_when_gone(sentinel: int) -> None:
    wait([sentinel])
    os.kill(os.getpid(), signal.SIGTERM)
