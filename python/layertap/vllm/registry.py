"""Scheduler halves of this process, by engine id. An in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) is stepped only while it has unfinished requests, so what
finishes in its last step never reaches the worker: the worker half, in the same process, takes
it (and the last counts of requests not saved) from here at shutdown.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

_lock = threading.Lock()
_schedulers: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def register_scheduler(engine_id: str, scheduler_side: Any) -> None:
    with _lock:
        _schedulers[engine_id] = scheduler_side


def take_unsent(engine_id: str) -> Any:
    """The saves that half has not handed over yet; None if it is in another process."""
    with _lock:
        side = _schedulers.get(engine_id)
    return side.take_unsent() if side is not None else None


def not_saved_totals(engine_id: str) -> dict[str, int] | None:
    """That half's requests not saved, by reason; None if it is in another process."""
    with _lock:
        side = _schedulers.get(engine_id)
    return side.stats.not_saved_totals(always=True) if side is not None else None
