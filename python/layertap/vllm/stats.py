"""What the connector measures: time its hooks take on the engine thread, pool stalls, bytes and
records. Kept in memory, logged at shutdown and written as JSON when ``stats_path`` is set."""

from __future__ import annotations

import json
import math
import os
import random
import time
from array import array
from typing import Any

from layertap._files import write_atomic

#: Hook timings kept exactly up to this many steps; past it, a uniform sample of this size.
MAX_SAMPLES = 1 << 20


class StepTimes:
    """Durations (seconds) of one hook call per engine step; percentiles over the run.

    Up to ``MAX_SAMPLES`` steps every duration is kept; after that a reservoir sample of that
    size (Algorithm R), so memory stays bounded on long runs and the percentiles stay unbiased."""

    def __init__(self) -> None:
        self._samples = array("d")
        self.count = 0
        self.total = 0.0
        self.max = 0.0
        self._rng = random.Random(0)

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        if seconds > self.max:
            self.max = seconds
        if len(self._samples) < MAX_SAMPLES:
            self._samples.append(seconds)
        else:
            j = self._rng.randrange(self.count)
            if j < MAX_SAMPLES:
                self._samples[j] = seconds

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0..100, nearest rank) of the kept durations; 0 if none."""
        if not self._samples:
            return 0.0
        ordered = sorted(self._samples)
        rank = max(1, math.ceil(q / 100 * len(ordered)))
        return ordered[rank - 1]

    def summary(self) -> dict[str, float | int]:
        return {
            "steps": self.count,
            "total_s": self.total,
            "mean_us": self.total / self.count * 1e6 if self.count else 0.0,
            "p50_us": self.percentile(50) * 1e6,
            "p99_us": self.percentile(99) * 1e6,
            "max_us": self.max * 1e6,
        }


class ConnectorStats:
    """Counters of the worker half (TP rank 0)."""

    def __init__(self) -> None:
        self.started = time.time()
        self.hook = StepTimes()
        self.hook_parts = {"launch": 0.0, "submit": 0.0, "reap": 0.0}
        """Seconds of the hook spent in each part (the gathers' launch with the records' ids
        and index, handing records to the writer, taking regions back), so that a run says
        where the hook's time goes (benches/gpu attributes the engine's time by phase)."""
        self.records_submitted = 0
        self.records_written = 0
        self.records_failed = 0
        self.tokens = 0
        self.bytes_submitted = 0
        """Raw tensor bytes handed to the writer (hidden states and token ids)."""
        self.gathers = 0
        """Device gathers (one per engine step that finished requests, more on pool stalls)."""
        self.pool_stalls = 0
        """Times the engine thread waited for room in the pool (an engine in the caller's
        process, or shutdown)."""
        self.pool_stall_seconds = 0.0
        self.pool_deferrals = 0
        """Steps that left requests waiting for room in the pool, with their KV blocks held,
        instead of waiting (an engine in its own process)."""
        self.encoder_threads_lowered = 0
        """Compression threads whose priority the worker lowered (``lower_encoder_priority``)."""
        self.saved_at_shutdown = 0
        """Finished requests that an in-process engine had not handed over before shutdown."""
        self.requests_not_saved: dict[str, int] = {}
        """Finished requests the scheduler half did not save, by reason (``not_requested``,
        ``invalid_request``, ``not_saved``), as it last told this half (``take_not_saved``)."""

    def take_not_saved(self, totals: dict[str, int] | None) -> None:
        """The scheduler half's counts of requests not saved since the start (None: unchanged)."""
        if totals is not None:
            self.requests_not_saved = dict(totals)

    def summary(self, *, pool: Any = None, writer: Any = None, extra: dict | None = None) -> dict:
        """Everything as a JSON-able dict; ``pool`` and ``writer`` add their own figures."""
        out: dict[str, Any] = {
            "wall_seconds": time.time() - self.started,
            "hook": self.hook.summary(),
            "hook_parts_s": dict(self.hook_parts),
            "records_submitted": self.records_submitted,
            "records_written": self.records_written,
            "records_failed": self.records_failed,
            "tokens": self.tokens,
            "bytes_submitted": self.bytes_submitted,
            "gathers": self.gathers,
            "pool_stalls": self.pool_stalls,
            "pool_stall_seconds": self.pool_stall_seconds,
            "pool_deferrals": self.pool_deferrals,
            "saved_at_shutdown": self.saved_at_shutdown,
            "requests_not_saved": dict(self.requests_not_saved),
            "encoder_threads_lowered": self.encoder_threads_lowered,
        }
        if pool is not None:
            out["pool"] = {
                "bytes": pool.nbytes,
                "pinned": pool.pinned,
                "high_water_bytes": pool.high_water,
                "in_use_bytes": pool.in_use,
                "live_regions": pool.live_regions,
            }
        if writer is not None:
            out["writer"] = dict(writer.stats)
        if extra:
            out.update(extra)
        return out


def write_json(path: str, summary: dict) -> None:
    """Writes ``summary`` to ``path`` (parent directories created), atomically."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_atomic(path, json.dumps(summary, indent=2, sort_keys=True) + "\n")


def describe(summary: dict) -> str:
    """A one-paragraph human summary for the shutdown log line."""
    hook = summary["hook"]
    text = (
        f"{summary['records_written']}/{summary['records_submitted']} records written "
        f"({summary['tokens']} tokens, {summary['bytes_submitted'] / 2**20:.1f} MiB raw) in "
        f"{summary['gathers']} gathers; engine-thread hook time p50 {hook['p50_us']:.0f} us, "
        f"p99 {hook['p99_us']:.0f} us, max {hook['max_us']:.0f} us over {hook['steps']} steps; "
        f"pool stalls {summary['pool_stalls']} ({summary['pool_stall_seconds']:.3f} s), "
        f"deferrals {summary.get('pool_deferrals', 0)}"
    )
    writer = summary.get("writer")
    if writer:
        text += (
            f"; writer {writer.get('backend')}: ratio {writer.get('ratio', 0):.2f}, "
            f"blocked {writer.get('blocked_seconds', 0):.3f} s"
        )
    not_saved = summary.get("requests_not_saved")
    if not_saved:
        reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(not_saved.items()))
        text += f"; {sum(not_saved.values())} requests not saved ({reasons})"
    if summary["records_failed"]:
        text += f"; {summary['records_failed']} records FAILED"
    return text
