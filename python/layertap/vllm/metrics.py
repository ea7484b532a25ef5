"""The connector's statistics where vLLM shows them, in the API server's process: the payloads of
``stats.py``, merged (``merge_payload``) over a step's TP workers and over an interval's steps,
become the periodic log line's figures (``LayertapConnectorStats.reduce``) and ``/metrics``
(``LayertapPromMetrics``); docs/CONNECTOR.md, "Metrics". vLLM 0.26 to 0.33 all have these classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from layertap.vllm.stats import percentile

#: Prometheus names (every one starts with this; the client adds ``_total`` to counters).
PREFIX = "layertap_"
#: The metrics whose Prometheus name is not ``PREFIX`` and their payload name.
_RENAMED = {"raw_bytes_written": "layertap_written_raw_bytes", "stored_bytes_written": "layertap_written_stored_bytes"}
_COUNTER_HELP = {
    "records_written": "Records (one per saved request) the shard writer reported written.",
    "records_failed": "Records of planned saves that the writer refused (each also logged as an error).",
    "tokens_written": "Tokens in the records written.",
    "raw_bytes_written": "Bytes of the records written before compression (tensors and their header).",
    "stored_bytes_written": "Bytes of the records written as stored in the shards.",
    "pool_stalls": "Engine steps that waited for the writer because the host pool was full.",
    "pool_stall_seconds": "Seconds the engine thread waited for room in the host pool.",
    "writer_blocked_seconds": "Seconds the writer's submit waited because max_inflight_bytes were in flight.",
    "store_records_put": "Records put into Mooncake Store (option mooncake).",
    "store_records_failed": "Records Mooncake Store refused or could not be reached for (they stay in the spool).",
    "store_duplicates_refused": "Records not put because the store already held a record with their key.",
}
_GAUGE_HELP = {
    "pool_used_bytes": "Bytes of the host pool holding records not yet written.",
    "pool_high_water_bytes": "Most bytes of the host pool ever in use.",
    "pool_capacity_bytes": "Size of the host pool.",
    "writer_queue_records": "Records submitted to the writer and not yet written.",
    "writer_inflight_bytes": "Raw bytes submitted to the writer and not yet written.",
}
#: Payload counter -> (Prometheus name without ``_total``, help).
COUNTERS = {key: (_RENAMED.get(key, PREFIX + key), doc) for key, doc in _COUNTER_HELP.items()}
#: Requests whose hidden states were not saved, labelled by ``reason``.
NOT_SAVED = (
    "layertap_requests_not_saved",
    "Finished requests not saved, by reason (not_requested, invalid_request, not_saved).",
)
#: Payload gauge -> (Prometheus name, help).
GAUGES = {key: (PREFIX + key, doc) for key, doc in _GAUGE_HELP.items()}
#: Payload samples -> (Prometheus name, help, buckets in seconds).
HISTOGRAMS: dict[str, tuple[str, str, tuple[float, ...]]] = {
    "engine_thread_seconds": (
        "layertap_engine_thread_seconds",
        "The connector's time on the engine thread per engine step (worker side).",
        (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0),
    ),
    "record_delay_seconds": (
        "layertap_record_delay_seconds",
        "Time from a request's end to its record reported written by the shard writer.",
        (1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
    ),
}


def merge_payload(into: dict[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    """Adds ``other`` to ``into`` (in place, copying) and returns it: counters add up, samples are
    appended, a writer's gauges take ``other``'s values; both of vLLM's aggregations use it."""
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
    """Each gauge summed over the writers of ``payload`` (data-parallel ranks have ``engine`` labels)."""
    totals: dict[str, float] = {}
    for values in payload.get("gauges", {}).values():
        for name, value in values.items():
            totals[name] = totals.get(name, 0) + value
    return totals


def summarize(payload: Mapping[str, Any]) -> dict[str, int | float]:
    """The periodic log line's figures (``KV Transfer metrics: name=value, ...``)."""
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
        out["engine_thread_p50_us"] = round(percentile(steps, 50) * 1e6, 1)
        out["engine_thread_p99_us"] = round(percentile(steps, 99) * 1e6, 1)
        out["engine_thread_max_us"] = round(steps[-1] * 1e6, 1)
    delays = sorted(observations.get("record_delay_seconds", ()))
    if delays:
        out["record_delay_p50_ms"] = round(percentile(delays, 50) * 1e3, 1)
        out["record_delay_max_ms"] = round(delays[-1] * 1e3, 1)
    return out


@dataclass
class LayertapConnectorStats(KVConnectorStats):
    """Payloads as vLLM carries them to the API server and aggregates them over its log interval."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            merge_payload(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return summarize(self.data)

    def is_empty(self) -> bool:
        return not self.data or not any(self.data.get(k) for k in ("counters", "not_saved", "gauges", "observations"))


def stats_from_payload(data: Mapping[str, Any] | None) -> LayertapConnectorStats:
    """What ``build_kv_connector_stats`` returns: a copy, since vLLM hands the same dict to the
    log line (which aggregates into it) and to Prometheus."""
    return LayertapConnectorStats(data=merge_payload({}, data or {}))


def unregister_layertap_metrics() -> None:
    """Removes layertap's metrics from prometheus_client's registry, as vLLM does its own before
    registering them again (another engine in the same process)."""
    from prometheus_client import REGISTRY

    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", "").startswith(PREFIX):
            REGISTRY.unregister(collector)


class LayertapPromMetrics(KVConnectorPromMetrics):
    """Registers the metrics with vLLM's label names and observes each payload vLLM hands over."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        unregister_layertap_metrics()
        counters = {
            key: self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            for key, (name, doc) in COUNTERS.items()
        }
        gauges = {
            key: self._gauge_cls(name=name, documentation=doc, labelnames=labelnames, multiprocess_mode="mostrecent")
            for key, (name, doc) in GAUGES.items()
        }
        histograms = {
            key: self._histogram_cls(name=name, documentation=doc, labelnames=labelnames, buckets=list(buckets))
            for key, (name, doc, buckets) in HISTOGRAMS.items()
        }
        self._not_saved = self._counter_cls(
            name=NOT_SAVED[0], documentation=NOT_SAVED[1], labelnames=[*labelnames, "reason"]
        )
        self._labels = {idx: list(values) for idx, values in per_engine_labelvalues.items()}
        self._bound: dict[int, dict[str, Any]] = {
            idx: {key: metric.labels(*values) for key, metric in {**counters, **gauges, **histograms}.items()}
            for idx, values in self._labels.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        bound = self._bound.get(engine_idx)
        if bound is None or not transfer_stats_data:
            return
        for key, value in transfer_stats_data.get("counters", {}).items():
            if key in COUNTERS and value > 0:
                bound[key].inc(value)
        for reason, count in transfer_stats_data.get("not_saved", {}).items():
            self._not_saved.labels(*self._labels[engine_idx], str(reason)).inc(count)
        if transfer_stats_data.get("gauges"):
            for key, value in gauge_totals(transfer_stats_data).items():
                if key in GAUGES:
                    bound[key].set(value)
        for key, samples in transfer_stats_data.get("observations", {}).items():
            if key in HISTOGRAMS:
                histogram = bound[key]
                for seconds in samples:
                    histogram.observe(seconds)
