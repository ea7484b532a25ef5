"""What the connector reports to vLLM's metrics, counted where it happens.

vLLM asks the connector once per engine step what happened since its last answer
(``get_kv_connector_stats``), on the worker side and on the scheduler side. It carries the answer
to the engine core and on to the API server process, and hands it there to the connector's
``KVConnectorStats`` (the periodic log line) and ``KVConnectorPromMetrics`` (``/metrics``), both
in ``metrics.py``.

On the engine thread this module only counts: an append to a list, an addition. The report (the
*payload*: a dict of plain numbers and lists, which vLLM serializes) is built at most every
``REPORT_INTERVAL`` seconds, and at once when the writer has caught up, so that the last records
of a burst are reported before the engine goes idle. Nothing here imports vLLM.

The payload (every key optional)::

    {"counters": {name: increment, ...},          # since the last report (COUNTER_NAMES)
     "not_saved": {reason: count, ...},          # requests refused (scheduler side)
     "gauges": {writer_id: {name: value, ...}},  # current values, per writer (GAUGE_NAMES)
     "observations": {name: [seconds, ...]}}     # histogram samples since the last report

The scheduler half also reads the worker's reports (``SchedulerCounters.worker_report``): while
records it handed over are still being written, it keeps the engine stepping (vLLM's
``has_pending_push_work``), so that their completion is seen, and counted, when it happens rather
than at the next request.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

logger = logging.getLogger("vllm.layertap")  # under vLLM's logging configuration

#: Least seconds between two worker reports, unless the writer has just caught up.
REPORT_INTERVAL = 0.25
#: Most samples a histogram keeps between two reports; later ones are dropped (vLLM not asking).
MAX_OBSERVATIONS = 1 << 16
#: Seconds the worker may wait for its writer in a step the engine takes only for the writer.
DRAIN_WAIT = 0.005
#: Seconds without a record written after which the scheduler stops stepping the engine for the
#: writer (the counts then catch up at the next request).
STALL_LIMIT = 30.0

#: Counters (increments per report): records, their tokens and bytes, as the writer reports them
#: written; the pool's stalls; the writer's time blocked in ``submit``.
COUNTER_NAMES = (
    "records_written",
    "records_failed",
    "tokens_written",
    "raw_bytes_written",
    "stored_bytes_written",
    "pool_stalls",
    "pool_stall_seconds",
    "writer_blocked_seconds",
)
#: Gauges (values now, per writer).
GAUGE_NAMES = (
    "pool_used_bytes",
    "pool_high_water_bytes",
    "pool_capacity_bytes",
    "writer_queue_records",
    "writer_inflight_bytes",
)
#: Histograms (samples in seconds): the connector's time on the engine thread per step, and
#: the time from a request's end to its record written.
OBSERVATION_NAMES = ("engine_thread_seconds", "record_delay_seconds")


class WorkerCounters:
    """The worker half's counting (TP rank 0): beside ``ConnectorStats``, which holds the
    cumulative counts of the shutdown summary, it keeps what only the metrics need and turns
    both into increments per report.

    ``clock`` (seconds, steady) times the report interval; the tests pass one they move by hand,
    so that what they check does not depend on how long a loaded machine takes between calls."""

    def __init__(self, stats: Any, writer_id: str, clock: Callable[[], float] = time.monotonic):
        self._stats = stats
        self._clock = clock
        self._writer_id = writer_id
        self.store: dict | None = None
        """With the ``mooncake`` option: the forwarder's counts (``mooncake_sink.Forwarder.stats``)."""
        self._engine_thread: list[float] = []
        self._delays: list[float] = []
        self._pending: collections.deque[list] = collections.deque()
        """The records handed to the writer and not reported written, a step's at a time, in
        the order they were handed over (the order both writers write them in):
        ``[tokens of each record, how many of them are written, when their requests ended]``."""
        self.tokens_written = 0
        self._reported: dict[str, float] = {}
        """The cumulative counts at the last report."""
        self._signature: tuple[int, ...] = (0, 0, 0, 0)
        self._last_report = 0.0

    # -- on the engine thread -----------------------------------------------------------------

    def step(self, seconds: float) -> None:
        """One engine step's connector time."""
        if len(self._engine_thread) < MAX_OBSERVATIONS:
            self._engine_thread.append(seconds)

    def submitted(self, saves: Any, refused: Sequence[int] = ()) -> None:
        """A step's records handed to the writer (a ``StepSaves``), but those at the indices
        ``refused``."""
        tokens = saves.num_tokens
        if refused:
            skip = set(refused)
            tokens = [n for i, n in enumerate(tokens) if i not in skip]
        if tokens:
            self._pending.append([tokens, 0, saves.finished_at])

    def written(self, count: int) -> None:
        """The writer reported ``count`` more records written: the oldest ones handed over
        (both writers write records in the order they were handed over)."""
        now = time.time()
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

    # -- the report ---------------------------------------------------------------------------

    def report(self, pool: Any, writer: Any) -> dict | None:
        """The payload since the last report, or None when there is nothing to report or the
        last one is too recent (see the module's docstring)."""
        stats = self._stats
        store = self.store or {}
        store_counts = {k: int(store.get(k, 0)) for k in STORE_COUNTERS}
        signature = (
            stats.records_submitted,
            stats.records_written,
            stats.records_failed,
            stats.pool_stalls,
            *store_counts.values(),
        )
        changed = signature != self._signature
        if not changed and not self._engine_thread:
            return None
        now = self._clock()
        caught_up = stats.records_written == stats.records_submitted
        if now - self._last_report < REPORT_INTERVAL and not (changed and caught_up):
            return None
        self._last_report = now
        self._signature = signature
        writer_stats = writer.stats
        totals = {
            "records_written": stats.records_written,
            "records_failed": stats.records_failed,
            "tokens_written": self.tokens_written,
            # The writer counts a record's bytes when it has written it (both writers' stats).
            "raw_bytes_written": int(writer_stats.get("bytes_in", 0)),
            "stored_bytes_written": int(writer_stats.get("bytes_stored", 0)),
            "pool_stalls": stats.pool_stalls,
            "pool_stall_seconds": stats.pool_stall_seconds,
            "writer_blocked_seconds": float(writer_stats.get("blocked_seconds", 0.0)),
        }
        if self.store is not None:
            totals.update({f"store_{k}": v for k, v in store_counts.items()})
        last = self._reported
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
        counters = {k: v - last.get(k, 0) for k, v in totals.items() if v != last.get(k, 0)}
        if counters:
            payload["counters"] = counters
        self._reported = totals
        observations = {}
        if self._engine_thread:
            observations["engine_thread_seconds"], self._engine_thread = self._engine_thread, []
        if self._delays:
            observations["record_delay_seconds"], self._delays = self._delays, []
        if observations:
            payload["observations"] = observations
        return payload


#: The forwarder's counts that the payload carries (as ``store_<name>``) with the ``mooncake`` option.
STORE_COUNTERS = ("records_put", "records_failed", "duplicates_refused")


class SchedulerCounters:
    """The scheduler half's counting: requests refused, and whether the records it handed over
    are written yet (from the worker's reports).

    ``clock`` (seconds, steady) times the stall limit; the tests pass one they move by hand
    rather than sleep past the limit."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._not_saved: dict[str, int] = {}
        """Requests not saved since the last report, by reason."""
        self._not_saved_totals: dict[str, int] = {}
        """Since the start, for the worker's statistics (``not_saved_totals``)."""
        self._totals_changed = False
        self._accepted = 0
        self._done = 0
        """Records the worker reported written or failed."""
        self._progress_at = 0.0
        self._stalled = False

    def not_saved(self, reason: str) -> None:
        self._not_saved[reason] = self._not_saved.get(reason, 0) + 1
        self._not_saved_totals[reason] = self._not_saved_totals.get(reason, 0) + 1
        self._totals_changed = True

    def not_saved_totals(self, always: bool = False) -> dict[str, int] | None:
        """The requests not saved since the start, by reason, when they changed since the last
        call (or ``always``), else None: a copy for the worker half's statistics."""
        if always:
            return dict(self._not_saved_totals)
        if not self._totals_changed:
            return None
        self._totals_changed = False
        return dict(self._not_saved_totals)

    def accepted(self) -> None:
        """A request's record was planned (the worker will write it or count it failed)."""
        if self._accepted == self._done:
            self._progress_at = self._clock()  # the wait for the writer starts now
        self._accepted += 1

    def worker_report(self, payload: Mapping[str, Any] | None) -> None:
        """Reads a report of the worker half (aggregated over the TP ranks, of which only rank 0
        reports); None or another connector's payload is ignored."""
        counters = payload.get("counters") if isinstance(payload, Mapping) else None
        if not counters:
            return
        done = int(counters.get("records_written", 0)) + int(counters.get("records_failed", 0))
        if done:
            self._done += done
            self._progress_at = self._clock()
            self._stalled = False

    def writing(self) -> bool:
        """Whether records handed over are still being written, and the writer is making
        progress: then the engine keeps stepping (``has_pending_push_work``)."""
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
        """The scheduler half's payload since the last report, or None."""
        if not self._not_saved:
            return None
        payload = {"not_saved": self._not_saved}
        self._not_saved = {}
        return payload


# -- payloads, for metrics.py (the API server's side) ---------------------------------------


def copy_payload(data: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy that ``merge_payload`` may change without touching ``data`` (vLLM hands the same
    dict to the log line and to Prometheus)."""
    if not data:
        return {}
    out: dict[str, Any] = {}
    for section, values in data.items():
        if section == "gauges":
            out[section] = {w: dict(g) for w, g in values.items()}
        elif section == "observations":
            out[section] = {k: list(v) for k, v in values.items()}
        elif isinstance(values, Mapping):
            out[section] = dict(values)
    return out


def merge_payload(into: dict[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    """Adds ``other`` to ``into`` (in place) and returns it: counters add up, samples are
    appended, gauges of a writer take ``other``'s values. The same rule serves both ways vLLM
    aggregates: over the TP workers of one step and over the steps of one log interval."""
    for section in ("counters", "not_saved"):
        if section in other:
            mine = into.setdefault(section, {})
            for name, value in other[section].items():
                mine[name] = mine.get(name, 0) + value
    if "observations" in other:
        mine = into.setdefault("observations", {})
        for name, samples in other["observations"].items():
            mine.setdefault(name, []).extend(samples)
    if "gauges" in other:
        mine = into.setdefault("gauges", {})
        for writer_id, values in other["gauges"].items():
            mine[writer_id] = dict(values)
    return into


def gauge_totals(payload: Mapping[str, Any]) -> dict[str, float]:
    """Each gauge summed over the writers of ``payload`` (one per engine with TP; the engine's
    data-parallel ranks report to separate ``engine`` labels)."""
    totals: dict[str, float] = {}
    for values in payload.get("gauges", {}).values():
        for name, value in values.items():
            totals[name] = totals.get(name, 0) + value
    return totals


def _percentile(sorted_samples: list[float], q: float) -> float:
    rank = max(1, -(-len(sorted_samples) * q // 100))
    return sorted_samples[int(rank) - 1]


def summarize(payload: Mapping[str, Any]) -> dict[str, int | float]:
    """The periodic log line's figures for one interval's payload (vLLM prints them as
    ``KV Transfer metrics: name=value, ...``)."""
    counters = payload.get("counters", {})
    out: dict[str, int | float] = {}
    if counters:
        raw, stored = counters.get("raw_bytes_written", 0), counters.get("stored_bytes_written", 0)
        out["records_written"] = counters.get("records_written", 0)
        out["tokens_written"] = counters.get("tokens_written", 0)
        out["raw_MiB"] = round(raw / 2**20, 2)
        out["ratio"] = round(raw / stored, 2) if stored else 0.0
        for name in ("records_failed", "pool_stalls"):
            if counters.get(name):
                out[name] = counters[name]
        for name in ("pool_stall_seconds", "writer_blocked_seconds"):
            if counters.get(name):
                out[name.replace("_seconds", "_s")] = round(counters[name], 3)
    for reason, count in sorted(payload.get("not_saved", {}).items()):
        out[f"not_saved_{reason}"] = count
    gauges = gauge_totals(payload)
    if gauges:
        out["pool_used_MiB"] = round(gauges.get("pool_used_bytes", 0) / 2**20, 2)
        out["pool_high_water_MiB"] = round(gauges.get("pool_high_water_bytes", 0) / 2**20, 2)
        out["writer_queue"] = int(gauges.get("writer_queue_records", 0))
    observations = payload.get("observations", {})
    steps = sorted(observations.get("engine_thread_seconds", ()))
    if steps:
        out["engine_thread_p50_us"] = round(_percentile(steps, 50) * 1e6, 1)
        out["engine_thread_p99_us"] = round(_percentile(steps, 99) * 1e6, 1)
        out["engine_thread_max_us"] = round(steps[-1] * 1e6, 1)
    delays = sorted(observations.get("record_delay_seconds", ()))
    if delays:
        out["record_delay_p50_ms"] = round(_percentile(delays, 50) * 1e3, 1)
        out["record_delay_max_ms"] = round(delays[-1] * 1e3, 1)
    return out


def payload_is_empty(payload: Mapping[str, Any] | None) -> bool:
    return not payload or not any(payload.get(k) for k in ("counters", "not_saved", "gauges", "observations"))
