"""Scheduler halves living in this process, by engine id, so that a worker half in the same
process can take over the requests the scheduler could not hand over before shutdown.

vLLM hands a finished request to the worker at the step after it finished. An engine in the
caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) is only stepped while it has unfinished
requests, so the requests that finish in its last step would never reach the worker; its
executor shuts the workers down before the scheduler. Both halves of such an engine live in one
process: the worker half picks them up here at shutdown, and the scheduler's count of requests
not saved in the last step. Engines in their own process keep stepping while the connector holds
blocks, and drain before they shut down.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

_lock = threading.Lock()
_schedulers: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def register_scheduler(engine_id: str, scheduler_side: Any) -> None:
    """Records the scheduler half of engine ``engine_id`` (held weakly)."""
    with _lock:
        _schedulers[engine_id] = scheduler_side


def take_unsent(engine_id: str) -> Any:
    """The saves (``StepSaves``) the scheduler half of ``engine_id`` in this process has not
    handed to a worker yet (and forgets them there); None if that half is elsewhere."""
    with _lock:
        side = _schedulers.get(engine_id)
    return side.take_unsent() if side is not None else None


def not_saved_totals(engine_id: str) -> dict[str, int] | None:
    """The requests the scheduler half of ``engine_id`` in this process did not save, by reason
    (``SchedulerStats.not_saved_totals``); None if that half is elsewhere."""
    with _lock:
        side = _schedulers.get(engine_id)
    return side.stats.not_saved_totals(always=True) if side is not None else None
