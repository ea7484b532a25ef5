"""The connector's statistics, defined once (docs/CONNECTOR.md, "Metrics" and "Statistics").

Each half counts its events into one object (``WorkerStats`` on TP rank 0, ``SchedulerStats``)
holding totals since the start, which the shutdown line, ``stats_path`` and
``connector.layertap_stats()`` show. vLLM asks each half once per step what happened since its
last answer (``get_kv_connector_stats``): ``report`` answers with the increments of the totals,
so that the reports add up to them, plus the gauges now and the samples since. vLLM carries this
*payload* to the API server, where ``metrics.py`` merges it into its log line and ``/metrics``.

On the engine thread this module only adds and appends; the payload is built at most every
``REPORT_INTERVAL`` seconds, and at once when the writer has caught up, so that a burst's last
records are reported before the engine goes idle. Nothing here imports vLLM or torch.

The payload (every key optional)::

    {"counters": {name: increment, ...},          # since the last report
     "not_saved": {reason: count, ...},          # requests refused (scheduler side)
     "gauges": {writer_id: {name: value, ...}},  # current values, per writer
     "observations": {name: [seconds, ...]}}     # histogram samples since the last report

While records it handed over are still being written, the scheduler half keeps the engine
stepping (vLLM's ``has_pending_push_work``, from the worker's reports), so that their completion
is counted when it happens rather than at the next request.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import random
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from layertap._files import write_atomic

logger = logging.getLogger("vllm.layertap")  # under vLLM's logging configuration

#: Hook timings kept exactly up to this many steps; past it, a uniform sample of this size.
MAX_SAMPLES = 1 << 20
#: Least seconds between two worker reports, unless the writer has just caught up.
REPORT_INTERVAL = 0.25
#: Most samples a histogram keeps between two reports; later ones are dropped (vLLM not asking).
MAX_OBSERVATIONS = 1 << 16
#: Seconds the worker may wait for its writer in a step the engine takes only for the writer.
DRAIN_WAIT = 0.005
#: Seconds without a record written after which the scheduler stops stepping the engine for the
#: writer (the counts then catch up at the next request).
STALL_LIMIT = 30.0
#: The forwarder's counts that the payload carries (as ``store_<name>``) with the ``mooncake`` option.
STORE_COUNTERS = ("records_put", "records_failed", "duplicates_refused")


def percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100, nearest rank) of ``ordered``, sorted ascending; 0 if empty."""
    if not ordered:
        return 0.0
    return ordered[max(1, math.ceil(len(ordered) * q / 100)) - 1]


def increments(totals: Mapping[str, Any], last: Mapping[str, Any]) -> dict[str, Any]:
    """What changed in ``totals`` since ``last`` (totals too), as increments; the rest left out."""
    return {name: value - last.get(name, 0) for name, value in totals.items() if value != last.get(name, 0)}


class StepTimes:
    """Durations (seconds) of the hook per engine step: all of the first ``MAX_SAMPLES``, then a
    reservoir sample (Algorithm R), so memory stays bounded and the percentiles unbiased."""

    def __init__(self) -> None:
        self._samples = array("d")
        self.count = 0
        self.total = 0.0
        self.max = 0.0
        self._rng = random.Random(0)

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        self.max = max(self.max, seconds)
        if len(self._samples) < MAX_SAMPLES:
            self._samples.append(seconds)
        else:
            j = self._rng.randrange(self.count)
            if j < MAX_SAMPLES:
                self._samples[j] = seconds

    def summary(self) -> dict[str, float | int]:
        ordered = sorted(self._samples)
        return {
            "steps": self.count,
            "total_s": self.total,
            "mean_us": self.total / self.count * 1e6 if self.count else 0.0,
            "p50_us": percentile(ordered, 50) * 1e6,
            "p99_us": percentile(ordered, 99) * 1e6,
            "max_us": self.max * 1e6,
        }


class WorkerStats:
    """The worker half's statistics (TP rank 0): the events ``step``, ``submitted`` and
    ``written``, and plain counts the hot path adds to; every attribute is a total.

    ``clock`` (steady) times the report interval, ``wall`` (epoch, as the scheduler stamps a
    request's end) the record delays; tests pass clocks they move by hand, independent of load."""

    def __init__(
        self, writer_id: str = "", clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time
    ):
        self._writer_id, self._clock, self._wall = writer_id, clock, wall
        self.started = wall()
        self.hook = StepTimes()
        self.hook_parts = {"launch": 0.0, "submit": 0.0, "reap": 0.0}
        """Seconds of the hook per part, so that a run says where its time goes (benches/gpu)."""
        self.records_submitted = 0
        self.records_written = 0
        self.records_failed = 0
        self.tokens = 0
        self.tokens_written = 0
        self.bytes_submitted = 0
        """Raw tensor bytes handed to the writer (hidden states and token ids)."""
        self.gathers = 0
        self.pool_stalls = 0
        """Times the engine thread waited for room in the pool (in-process engine, shutdown)."""
        self.pool_stall_seconds = 0.0
        self.pool_deferrals = 0
        """Steps that left requests waiting for room, blocks held, instead of waiting."""
        self.encoder_threads_lowered = 0
        self.saved_at_shutdown = 0
        """Finished requests an in-process engine had not handed over before shutdown."""
        self.requests_not_saved: dict[str, int] = {}
        """The scheduler half's counts by reason, as it last told this half (``take_not_saved``)."""
        self.store: dict | None = None
        """With the ``mooncake`` option: the forwarder's counts."""
        self._engine_thread: list[float] = []
        self._delays: list[float] = []
        self._pending: collections.deque[list] = collections.deque()
        """Per step handed over, in the order the writer writes them: ``[tokens of each record,
        how many are written, when their requests ended]``."""
        self._reported: dict[str, float] = {}
        self._signature: tuple[int, ...] = (0, 0, 0, 0)
        self._last_report = -math.inf

    # -- events, on the engine thread ---------------------------------------------------------

    def step(self, seconds: float) -> None:
        self.hook.add(seconds)
        if len(self._engine_thread) < MAX_OBSERVATIONS:
            self._engine_thread.append(seconds)

    def submitted(self, saves: Any, refused: Sequence[int] = (), row_bytes: int = 0) -> None:
        """A step's records handed to the writer, but those at ``refused`` (failed)."""
        tokens = saves.num_tokens
        if refused:
            skip = set(refused)
            tokens = [n for i, n in enumerate(tokens) if i not in skip]
        self.records_failed += len(refused)
        self.records_submitted += len(tokens)
        total = sum(tokens)
        self.tokens += total
        self.bytes_submitted += total * (row_bytes + 8)
        if tokens:
            self._pending.append([tokens, 0, saves.finished_at])

    def written(self, count: int) -> None:
        """The writer reported ``count`` more records written: the oldest ones handed over."""
        if not count:
            return
        self.records_written += count
        now = self._wall()
        pending, delays = self._pending, self._delays
        while count and pending:
            entry = pending[0]
            tokens, done, finished_at = entry
            n = min(count, len(tokens) - done)
            self.tokens_written += sum(tokens) if n == len(tokens) else sum(tokens[done : done + n])
            if finished_at:
                delays.extend([max(0.0, now - finished_at)] * min(n, MAX_OBSERVATIONS - len(delays)))
            count -= n
            if done + n == len(tokens):
                pending.popleft()
            else:
                entry[1] = done + n

    def take_not_saved(self, totals: dict[str, int] | None) -> None:
        if totals is not None:
            self.requests_not_saved = dict(totals)

    # -- the totals and their increments ------------------------------------------------------

    def counter_totals(self, writer: Any) -> dict[str, float]:
        writer_stats = writer.stats
        totals = {
            "records_written": self.records_written,
            "records_failed": self.records_failed,
            "tokens_written": self.tokens_written,
            # The writer counts a record's bytes when it has written it.
            "raw_bytes_written": int(writer_stats.get("bytes_in", 0)),
            "stored_bytes_written": int(writer_stats.get("bytes_stored", 0)),
            "pool_stalls": self.pool_stalls,
            "pool_stall_seconds": self.pool_stall_seconds,
            "writer_blocked_seconds": float(writer_stats.get("blocked_seconds", 0.0)),
        }
        if self.store is not None:
            totals.update({f"store_{k}": int(self.store.get(k, 0)) for k in STORE_COUNTERS})
        return totals

    def report(self, pool: Any, writer: Any) -> dict | None:
        """The payload since the last report; None if nothing is new or the last is too recent."""
        store = self.store or {}
        signature = (
            self.records_submitted,
            self.records_written,
            self.records_failed,
            self.pool_stalls,
            *(int(store.get(k, 0)) for k in STORE_COUNTERS),
        )
        changed = signature != self._signature
        if not changed and not self._engine_thread:
            return None
        now = self._clock()
        caught_up = self.records_written == self.records_submitted
        if now - self._last_report < REPORT_INTERVAL and not (changed and caught_up):
            return None
        self._last_report, self._signature = now, signature
        writer_stats = writer.stats
        payload: dict[str, Any] = {
            "gauges": {
                self._writer_id: {
                    "pool_used_bytes": pool.in_use,
                    "pool_high_water_bytes": pool.high_water,
                    "pool_capacity_bytes": pool.nbytes,
                    "writer_queue_records": int(writer_stats.get("queue_depth", 0)),
                    "writer_inflight_bytes": int(writer_stats.get("inflight_bytes", 0)),
                }
            }
        }
        totals = self.counter_totals(writer)
        counters = increments(totals, self._reported)
        self._reported = totals
        if counters:
            payload["counters"] = counters
        observations = {}
        if self._engine_thread:
            observations["engine_thread_seconds"], self._engine_thread = self._engine_thread, []
        if self._delays:
            observations["record_delay_seconds"], self._delays = self._delays, []
        if observations:
            payload["observations"] = observations
        return payload

    def summary(self, *, pool: Any = None, writer: Any = None, extra: dict | None = None) -> dict:
        """The totals as a JSON-able dict; ``pool`` and ``writer`` add their own figures."""
        out: dict[str, Any] = {
            "wall_seconds": self._wall() - self.started,
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


class SchedulerStats:
    """The scheduler half's statistics: requests not saved, by reason, and whether the records it
    handed over are written yet (from the worker's reports). ``clock`` times the stall limit
    (tests move one by hand)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.requests_not_saved: dict[str, int] = {}
        self._reported: dict[str, int] = {}
        self._handed: dict[str, int] = {}
        """The totals the worker half was last given (``not_saved_totals``)."""
        self._accepted = 0
        self._done = 0
        """Records the worker reported written or failed."""
        self._progress_at = 0.0
        self._stalled = False

    def not_saved(self, reason: str) -> None:
        self.requests_not_saved[reason] = self.requests_not_saved.get(reason, 0) + 1

    def not_saved_totals(self, always: bool = False) -> dict[str, int] | None:
        """A copy of the totals for the worker half when they changed since the last call (or
        ``always``), else None."""
        if not always:
            if self.requests_not_saved == self._handed:
                return None
            self._handed = dict(self.requests_not_saved)
        return dict(self.requests_not_saved)

    def accepted(self) -> None:
        if self._accepted == self._done:
            self._progress_at = self._clock()  # the wait for the writer starts now
        self._accepted += 1

    def worker_report(self, payload: Mapping[str, Any] | None) -> None:
        """Reads a report of the worker half (only TP rank 0 reports); anything else is ignored."""
        counters = payload.get("counters") if isinstance(payload, Mapping) else None
        if not counters:
            return
        done = int(counters.get("records_written", 0)) + int(counters.get("records_failed", 0))
        if done:
            self._done += done
            self._progress_at = self._clock()
            self._stalled = False

    def writing(self) -> bool:
        """Whether records handed over are being written, with progress: the engine keeps stepping."""
        if self._accepted <= self._done or self._stalled:
            return False
        if self._clock() - self._progress_at > STALL_LIMIT:
            self._stalled = True
            logger.warning(
                "layertap: %d records not reported written for %.0f s; the engine no longer steps "
                "for them (their counts reach /metrics at the next request)",
                self._accepted - self._done,
                STALL_LIMIT,
            )
            return False
        return True

    def report(self) -> dict | None:
        not_saved = increments(self.requests_not_saved, self._reported)
        if not not_saved:
            return None
        self._reported = dict(self.requests_not_saved)
        return {"not_saved": not_saved}


def write_json(path: str, summary: dict) -> None:
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
