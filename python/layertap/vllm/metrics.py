"""The connector's statistics in vLLM's places for them: the periodic log line
(``LayertapConnectorStats``, a ``KVConnectorStats``) and ``/metrics`` (``LayertapPromMetrics``, a
``KVConnectorPromMetrics``). Both run in the process that serves the API, on the payloads that
``counters.py`` builds in the engine (docs/CONNECTOR.md, "Metrics").

vLLM 0.26 to 0.33 all have these classes and the connector hooks that return them
(``get_kv_connector_stats``, ``build_kv_connector_stats``, ``build_prom_metrics``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from layertap.vllm.counters import copy_payload, gauge_totals, merge_payload, payload_is_empty, summarize

#: Prometheus names (every one starts with this; the client adds ``_total`` to counters).
PREFIX = "layertap_"

#: Payload counter -> (Prometheus name without ``_total``, help).
COUNTERS: dict[str, tuple[str, str]] = {
    "records_written": (
        "layertap_records_written",
        "Records (one per saved request) the shard writer reported written.",
    ),
    "records_failed": (
        "layertap_records_failed",
        "Records of planned saves that the writer refused (each also logged as an error).",
    ),
    "tokens_written": ("layertap_tokens_written", "Tokens in the records written."),
    "raw_bytes_written": (
        "layertap_written_raw_bytes",
        "Bytes of the records written before compression (tensors and their header).",
    ),
    "stored_bytes_written": ("layertap_written_stored_bytes", "Bytes of the records written as stored in the shards."),
    "pool_stalls": (
        "layertap_pool_stalls",
        "Engine steps that waited for the writer because the host pool was full.",
    ),
    "pool_stall_seconds": (
        "layertap_pool_stall_seconds",
        "Seconds the engine thread waited for room in the host pool.",
    ),
    "writer_blocked_seconds": (
        "layertap_writer_blocked_seconds",
        "Seconds the writer's submit waited because max_inflight_bytes were in flight.",
    ),
    "store_records_put": ("layertap_store_records_put", "Records put into Mooncake Store (option mooncake)."),
    "store_records_failed": (
        "layertap_store_records_failed",
        "Records Mooncake Store refused or could not be reached for (they stay in the spool).",
    ),
    "store_duplicates_refused": (
        "layertap_store_duplicates_refused",
        "Records not put because the store already held a record with their key.",
    ),
}
#: Requests whose hidden states were not saved, labelled by ``reason``.
NOT_SAVED = (
    "layertap_requests_not_saved",
    "Finished requests not saved, by reason (not_requested, invalid_request, not_saved).",
)
#: Payload gauge -> (Prometheus name, help).
GAUGES: dict[str, tuple[str, str]] = {
    "pool_used_bytes": ("layertap_pool_used_bytes", "Bytes of the host pool holding records not yet written."),
    "pool_high_water_bytes": ("layertap_pool_high_water_bytes", "Most bytes of the host pool ever in use."),
    "pool_capacity_bytes": ("layertap_pool_capacity_bytes", "Size of the host pool."),
    "writer_queue_records": ("layertap_writer_queue_records", "Records submitted to the writer and not yet written."),
    "writer_inflight_bytes": (
        "layertap_writer_inflight_bytes",
        "Raw bytes submitted to the writer and not yet written.",
    ),
}
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


@dataclass
class LayertapConnectorStats(KVConnectorStats):
    """One or more payloads (``counters.py``) of the connector, as vLLM carries them from the
    engine to the API server and aggregates them there over an interval of its log line."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            merge_payload(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return summarize(self.data)

    def is_empty(self) -> bool:
        return payload_is_empty(self.data)


def stats_from_payload(data: dict[str, Any] | None) -> LayertapConnectorStats:
    """What ``build_kv_connector_stats`` returns: a copy, since vLLM hands the same dict to the
    log line (which aggregates into it) and to Prometheus."""
    return LayertapConnectorStats(data=copy_payload(data))


def unregister_layertap_metrics() -> None:
    """Removes layertap's metrics from prometheus_client's default registry (vLLM does the same
    for its own before it registers them again: another engine in the same process, tests)."""
    try:
        from prometheus_client import REGISTRY
    except ImportError:  # pragma: no cover - vLLM depends on it
        return
    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", "").startswith(PREFIX):
            REGISTRY.unregister(collector)


class LayertapPromMetrics(KVConnectorPromMetrics):
    """Registers the metrics (with vLLM's label names, ``model_name`` and ``engine``) and
    observes each payload vLLM hands over for an engine."""

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
