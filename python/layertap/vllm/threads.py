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
    run on (vLLM's engine and front end need the others), at least 4 where there are 4, at most 16.

    On the H200 machine (16 CPUs, benches/RESULTS.md, 2026-12-02): 4 threads left the writer
    behind in prefill; 8 and 14 were alike, and the engine thread waited for a core with neither.
    bp16-zstd compresses about 0.3 GB/s a thread there, so an engine handing over more than
    ``0.3 x threads`` GB/s (a 1B prefill: about 2.5) needs more (``encode_seconds`` tells)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return min(MAX_DEFAULT_WRITER_THREADS, max(min(4, cpus), cpus // 2))


#: The writer's compression threads run at this ``nice`` above the engine's (Linux), so that
#: they take the CPUs vLLM leaves idle and yield the ones it needs.
ENCODER_NICE = 5


def lower_encoder_priority(thread_ids: Iterable[int], nice: int = ENCODER_NICE) -> int:
    """Raises the ``nice`` of a writer's own compression threads (not every ``layertap-zstd-N`` of
    the process: a second writer's would be lowered twice); returns how many changed (best effort)."""
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
    """Names the calling thread where the OS shows it (``top -H``, py-spy): before Python 3.14 it
    keeps its process's name (``VLLM::EngineCor``), its CPU time not told from the engine's."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name[:15])
        return True
    except OSError:
        return False
