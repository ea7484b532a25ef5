"""Stops vLLM's engine-core process when the process that started it dies.

vLLM 0.32's engine core does not watch its parent (vllm-project/vllm#55510): after ``kill -9`` of
``layertap generate``, ``vllm serve`` or a script of the user's (the kernel's OOM killer does the
same), the engine core and its workers went on, holding the shard their writer had open, so that
the same command, run again, stopped on "a live writer holds this shard" until the user found and
killed them. The scheduler half of the connector, which runs in the engine core, starts this
watch there: once the parent is gone it sends its own process SIGTERM, vLLM's clean shutdown
(its handler stops the engine loop and the workers), so the workers' writers complete their
shards as on any stop.
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
    """In vLLM's engine-core process, started by multiprocessing: a daemon thread that waits,
    without polling, for the parent's end (multiprocessing's sentinel of the parent, readable
    once the parent has exited, however it ended), then sends this process SIGTERM. Elsewhere
    (an engine in the caller's own process, a Ray actor) nothing: the process is not one the
    caller would leave behind. Returns the thread, or None."""
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
