"""The writer's threads beside the engine: how many compression threads a connector starts by
default, and the lower priority they run at (Linux's per-thread ``nice``, through ``/proc``).

benches/RESULTS.md (2026-12-02) measured both on the H200 machine: no engine thread waited for a
core with 8 or 14 compression threads at nice +5, and 4 threads were too few for a 1B prefill.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

#: At most this many compression threads by default.
MAX_DEFAULT_WRITER_THREADS = 16


def default_writer_threads() -> int:
    """Compression threads when ``writer_threads`` is not given: half the CPUs this process may
    run on (vLLM's engine, its front end and their helper threads need the others), at least 4
    where there are 4, at most 16.

    Measured on the H200 machine (16 CPUs, benches/RESULTS.md, 2026-12-02, one run): 4 threads
    leave the writer behind in prefill (durable at 0.58-0.61x of no extraction, the pool
    deferring requests); 8 and 14 are within the run's noise of each other, spend the same
    compression seconds (17.8-19.4 and 19.5 thread-seconds for the 1B case's 9.4 GB), and the
    engine thread waits for a core with none of them (run-queue wait 0.000-0.13 s per 3-17 s window; it
    was a guess that 14 threads took the engine's cores). bp16-zstd compresses a trained model's
    activations (about 1.5x) at about 0.3 GB/s a thread there, so an engine that hands over more
    than ``0.3 x threads`` GB/s of them (a 1B prefill: about 2.5 GB/s) needs ``writer_threads``
    set higher; ``encode_seconds`` against ``threads`` in the
    statistics tells. The threads run at a lower priority (``lower_encoder_priority``)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return min(MAX_DEFAULT_WRITER_THREADS, max(min(4, cpus), cpus // 2))


#: The writer's compression threads run at this ``nice`` above the engine's (Linux), so that
#: they take the CPUs vLLM leaves idle and yield the ones it needs.
ENCODER_NICE = 5


def lower_encoder_priority(thread_ids: Iterable[int], nice: int = ENCODER_NICE) -> int:
    """Raises the ``nice`` value of the threads ``thread_ids`` (a writer's compression threads,
    ``ShardWriter.encoder_thread_ids``) by ``nice``; returns how many were changed (0 where
    Linux's per-thread priorities are not there). The writer gives its own threads' ids, not
    every ``layertap-zstd-N`` thread of the process: a second writer's threads would be lowered
    again. Best effort: a thread that cannot be changed keeps its priority."""
    changed = 0
    for tid in thread_ids:
        try:
            current = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(19, current + nice))
            changed += 1
        except (OSError, AttributeError):
            continue
    return changed


#: The OS name of the GPU path's compressing thread (``gpu_compress``; Linux keeps 15 bytes).
GPU_COMPRESS_THREAD = "layertap-gpu"


def name_this_thread(name: str) -> bool:
    """Gives the calling thread ``name`` where the OS shows it (``/proc/self/task/TID/comm``:
    ``top -H``, py-spy, benches/gpu/threads.py). Before Python 3.14 a thread started from Python
    keeps its process's name (``VLLM::EngineCor`` in vLLM's engine), so its CPU time could not be
    told from the engine's. Linux only, best effort: returns whether it was named."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name[:15])
        return True
    except OSError:
        return False
