"""The connector's statistics (``layertap.vllm.stats``: the events each half counts, their totals
and the reports of their increments) on the worker's real hot path (a cache tensor, the host
pool, a real writer) and on the scheduler side, without an engine; and what the API server
makes of the reports (``layertap.vllm.metrics``: the merge, the log line's figures, the
Prometheus metrics). The engine, the API server and ``/metrics`` over HTTP are in test_serve.py."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from test_transfer import BLOCK, BLOCKS, HIDDEN, LAYERS, facts, saves

import layertap
from helpers import HandClock, writer_class
from layertap.vllm.gather import HiddenStatesCache
from layertap.vllm.pool import HostPool
from layertap.vllm.stats import (
    REPORT_INTERVAL,
    STALL_LIMIT,
    STORE_COUNTERS,
    SchedulerStats,
    WorkerStats,
    describe,
    percentile,
)
from vllm_support import VLLM_WARNINGS

pytestmark = VLLM_WARNINGS


def step_saves(ended: float, *requests: tuple[str, list[int], int]):
    """A step's saves (``test_transfer.saves``) whose requests ended at ``ended``."""
    out = saves(*requests)
    out.finished_at = ended
    return out


def test_worker_reports_equal_the_records_written(tmp_path):
    from layertap.vllm.hidden_states_saver import HiddenStatesSaver

    clock, wall = HandClock(), HandClock(5000.0)
    kv = torch.randn(BLOCKS, BLOCK, LAYERS, HIDDEN).to(torch.bfloat16)
    stats = WorkerStats("w", clock=clock, wall=wall)
    pool = HostPool(1 << 20, pin=False)
    writer = writer_class()(str(tmp_path), codec="bp16-zstd", writer_id="w")
    cache = HiddenStatesCache(kv, LAYERS, HIDDEN, BLOCK)
    saver = HiddenStatesSaver(cache, writer, pool, facts(), stats, "")

    ended = wall() - 1.0  # the requests ended a second ago
    saver.start(step_saves(ended, ("a", [3, 5], 6), ("b", [0], 4)))
    saver.collect()
    stats.step(2e-4)
    saver.start(step_saves(ended, ("c", [7, 8, 9], 9)))
    while stats.records_written < 3:
        saver.collect(wait=0.05)  # the worker's wait in a step taken only for the writer
    stats.step(3e-4)
    first = stats.report(pool, writer)
    with layertap.open(str(tmp_path)) as ds:
        [shard] = ds.shards
    assert first["counters"] == {
        "records_written": 3,
        "tokens_written": shard.tokens,
        "raw_bytes_written": shard.raw_bytes,
        "stored_bytes_written": shard.stored_bytes,
    }
    assert shard.records == 3 and shard.tokens == 19
    assert first["gauges"] == {
        "w": {
            "pool_used_bytes": 0,
            "pool_high_water_bytes": pool.high_water,
            "pool_capacity_bytes": pool.nbytes,
            "writer_queue_records": 0,
            "writer_inflight_bytes": 0,
        }
    }
    assert first["observations"] == {"engine_thread_seconds": [2e-4, 3e-4], "record_delay_seconds": [1.0] * 3}

    # Nothing new: no report. A step only: reported once the interval has passed, as increments.
    assert stats.report(pool, writer) is None
    stats.step(1e-4)
    assert stats.report(pool, writer) is None
    clock.advance(REPORT_INTERVAL * 0.99)
    assert stats.report(pool, writer) is None
    clock.advance(REPORT_INTERVAL * 0.02)
    second = stats.report(pool, writer)
    assert second["observations"] == {"engine_thread_seconds": [1e-4]} and "counters" not in second
    # A refused record counts as failed, reported at once when the writer is caught up.
    saver.start(step_saves(ended, ("a", [1], 2)))  # a key the writer already took
    saver.collect()
    assert stats.report(pool, writer)["counters"] == {"records_failed": 1}
    saver.close()


def test_reports_add_up_to_the_totals_and_to_the_prometheus_metrics(tmp_path):
    """Steps of a seeded run (a refused record, pool stalls, requests not saved, the store's
    counts) with reports taken at random steps: merged as the API server merges them, the
    reports equal the totals that the shutdown summary shows and the dataset holds; observed
    as vLLM observes them, every Prometheus metric equals its total; and the log line's
    engine-thread percentiles equal the summary's hook percentiles (one percentile)."""
    from layertap.vllm import metrics
    from layertap.vllm.hidden_states_saver import HiddenStatesSaver, region_bytes

    seed = 7
    rng = random.Random(seed)
    clock, wall = HandClock(), HandClock(5000.0)
    kv = torch.randn(BLOCKS, BLOCK, LAYERS, HIDDEN).to(torch.bfloat16)
    cache = HiddenStatesCache(kv, LAYERS, HIDDEN, BLOCK)
    stats, scheduler = WorkerStats("w", clock=clock, wall=wall), SchedulerStats(clock=clock)
    stats.store = dict.fromkeys(STORE_COUNTERS, 0)  # the forwarder's counts (option mooncake)
    pool = HostPool(2 * region_bytes(2 * BLOCK, cache), pin=False)  # room for two long requests
    writer = writer_class()(str(tmp_path), codec="bp16-zstd", writer_id="w")
    saver = HiddenStatesSaver(cache, writer, pool, facts(), stats, "")
    reports: list[dict] = []

    def report() -> None:
        clock.advance(REPORT_INTERVAL)
        reports.extend(p for p in (stats.report(pool, writer), scheduler.report()) if p is not None)

    steps = []
    for step in range(10):
        requests = [(f"k{step}-{i}", [2 * i, 2 * i + 1], rng.randint(1, 2 * BLOCK)) for i in range(rng.randint(1, 4))]
        if step == 3:
            requests.append(("k0-0", [9], 2))  # a key the writer already took: refused
        if step == 5:  # more than the pool holds: the engine thread waits for the writer
            requests = [(f"k5-{i}", [2 * i, 2 * i + 1], 2 * BLOCK) for i in range(6)]
        saver.start(step_saves(wall() - 0.5, *requests))
        saver.collect()
        steps.append(rng.uniform(1e-5, 1e-3))
        stats.step(steps[-1])
        scheduler.not_saved(rng.choice(["not_requested", "invalid_request"]))
        stats.store[rng.choice(STORE_COUNTERS)] += 1
        if rng.random() < 0.4:
            report()
    while stats.records_written < stats.records_submitted:
        saver.collect(wait=0.05)
    report()

    totals = stats.counter_totals(writer)
    summary = stats.summary(pool=pool, writer=writer)
    merged: dict = {}
    for payload in reports:
        metrics.merge_payload(merged, payload)
    # (The seconds add up as floats do: exact for the counts, to rounding for the seconds.)
    assert merged["counters"] == pytest.approx({name: value for name, value in totals.items() if value}, rel=1e-9)
    assert merged["not_saved"] == scheduler.requests_not_saved and sum(scheduler.requests_not_saved.values()) == 10
    with layertap.open(str(tmp_path)) as ds:
        records, tokens = len(ds), sum(s.tokens for s in ds.shards)
        raw, stored = sum(s.raw_bytes for s in ds.shards), sum(s.stored_bytes for s in ds.shards)
    assert totals["records_written"] == summary["records_written"] == summary["records_submitted"] == records
    assert totals["records_failed"] == summary["records_failed"] == 1
    assert totals["tokens_written"] == summary["tokens"] == tokens
    assert (totals["raw_bytes_written"], totals["stored_bytes_written"]) == (raw, stored)
    assert totals["pool_stalls"] == summary["pool_stalls"] > 0, "the run should have filled the pool"
    assert {k: totals[f"store_{k}"] for k in STORE_COUNTERS} == stats.store
    observations = merged["observations"]
    assert observations == {"engine_thread_seconds": steps, "record_delay_seconds": [0.5] * records}
    hook, line = summary["hook"], metrics.summarize(merged)
    assert line["engine_thread_p50_us"] == round(hook["p50_us"], 1) == round(percentile(sorted(steps), 50) * 1e6, 1)
    assert line["engine_thread_p99_us"] == round(hook["p99_us"], 1) and line["records_written"] == records

    # Every figure a report carries has its metric; observed, each metric equals its total.
    assert set(totals) <= set(metrics.COUNTERS) and set(merged["gauges"]["w"]) == set(metrics.GAUGES)
    assert set(observations) == set(metrics.HISTOGRAMS)
    prom = metrics.LayertapPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
        ["model_name", "engine"],
        {0: ["tiny", "0"]},
    )
    try:
        for payload in reports:
            prom.observe(metrics.stats_from_payload(payload).data, 0)
        labels = {"model_name": "tiny", "engine": "0"}
        for key, (name, _) in metrics.COUNTERS.items():
            assert REGISTRY.get_sample_value(f"{name}_total", labels) == pytest.approx(totals.get(key, 0), rel=1e-9)
        for reason, count in scheduler.requests_not_saved.items():
            assert REGISTRY.get_sample_value(f"{metrics.NOT_SAVED[0]}_total", {**labels, "reason": reason}) == count
        for key, (name, _) in metrics.GAUGES.items():
            assert REGISTRY.get_sample_value(name, labels) == merged["gauges"]["w"][key], name
        for key, (name, _, _) in metrics.HISTOGRAMS.items():
            assert REGISTRY.get_sample_value(f"{name}_count", labels) == len(observations[key]), name
    finally:
        metrics.unregister_layertap_metrics()
    saver.close()


def test_one_percentile_nearest_rank():
    assert percentile([], 50) == 0.0
    assert [percentile([1.0, 2.0, 3.0], q) for q in (0, 33, 34, 50, 99, 100)] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    ordered = [float(i) for i in range(1, 101)]
    assert (percentile(ordered, 50), percentile(ordered, 99), percentile(ordered, 99.5)) == (50.0, 99.0, 100.0)


def test_scheduler_steps_the_engine_while_records_are_being_written(caplog):
    clock = HandClock()
    stats = SchedulerStats(clock=clock)
    assert not stats.writing()
    for _ in range(3):
        stats.accepted()
    assert stats.writing()
    stats.worker_report({"counters": {"records_written": 2}})
    stats.worker_report(None)  # a step without a report
    assert stats.writing()
    stats.worker_report({"counters": {"records_failed": 1}})
    assert not stats.writing()

    # A writer that makes no progress for more than STALL_LIMIT seconds: the engine stops
    # stepping for it, and starts again when a record is written.
    stats.accepted()
    clock.advance(STALL_LIMIT / 2)
    stats.accepted()  # a record handed over while one is pending: the wait started before
    clock.advance(STALL_LIMIT / 2)
    assert stats.writing()
    clock.advance(STALL_LIMIT / 100)
    with caplog.at_level("WARNING", logger="vllm.layertap"):
        assert not stats.writing()
    assert "2 records not reported written" in caplog.text
    stats.worker_report({"counters": {"records_written": 1}})
    assert stats.writing()
    clock.advance(STALL_LIMIT)  # progress restarted the wait
    assert stats.writing()

    stats.not_saved("invalid_request")
    stats.not_saved("invalid_request")
    stats.not_saved("not_saved")
    assert stats.report() == {"not_saved": {"invalid_request": 2, "not_saved": 1}}
    assert stats.report() is None
    stats.not_saved("not_saved")
    assert stats.report() == {"not_saved": {"not_saved": 1}}


def test_payloads_merge_as_vllm_aggregates_them():
    """Over the workers of a step and over the steps of a log interval: counters add up, samples
    are appended, a writer's gauges are its latest; the original payloads stay as they were."""
    from layertap.vllm.metrics import stats_from_payload  # imports vLLM (under the tests' filters)

    a = {
        "counters": {"records_written": 2, "raw_bytes_written": 300, "stored_bytes_written": 100},
        "gauges": {"w": {"pool_used_bytes": 10}},
        "observations": {"engine_thread_seconds": [1e-4]},
    }
    b = {
        "counters": {"records_written": 1, "raw_bytes_written": 100, "stored_bytes_written": 100},
        "not_saved": {"invalid_request": 1},
        "gauges": {"w": {"pool_used_bytes": 0}, "w2": {"pool_used_bytes": 5}},
        "observations": {"engine_thread_seconds": [3e-4], "record_delay_seconds": [0.5]},
    }
    interval = stats_from_payload(a)  # what build_kv_connector_stats returns: a copy
    assert not interval.is_empty() and stats_from_payload(None).is_empty()
    merged = interval.aggregate(stats_from_payload(b)).data
    assert merged["counters"] == {"records_written": 3, "raw_bytes_written": 400, "stored_bytes_written": 200}
    assert merged["gauges"] == {"w": {"pool_used_bytes": 0}, "w2": {"pool_used_bytes": 5}}
    assert merged["observations"] == {"engine_thread_seconds": [1e-4, 3e-4], "record_delay_seconds": [0.5]}
    assert a["counters"]["records_written"] == 2 and a["observations"]["engine_thread_seconds"] == [1e-4]
    assert a["gauges"]["w"] == {"pool_used_bytes": 10}
    line = interval.reduce()
    assert line["records_written"] == 3 and line["ratio"] == 2.0 and line["not_saved_invalid_request"] == 1
    assert line["pool_used_MiB"] == round(5 / 2**20, 2) and line["engine_thread_max_us"] == 300.0
    assert line["record_delay_p50_ms"] == 500.0


def test_requests_not_saved_reach_the_worker_statistics():
    """The scheduler half's counts of requests not saved since the start go to the worker half
    (the step's metadata) only when they changed; the worker's statistics and shutdown line
    report them (test_serve.py and test_request_extras.py through real engines)."""
    scheduler = SchedulerStats()
    assert scheduler.not_saved_totals() is None
    scheduler.not_saved("not_requested")
    scheduler.not_saved("not_requested")
    scheduler.not_saved("invalid_request")
    assert scheduler.not_saved_totals() == {"not_requested": 2, "invalid_request": 1}
    assert scheduler.not_saved_totals() is None
    assert scheduler.not_saved_totals(always=True) == {"not_requested": 2, "invalid_request": 1}
    scheduler.report()  # the metrics' increments are taken apart from what the worker was given
    scheduler.not_saved("not_requested")
    assert scheduler.not_saved_totals() == {"not_requested": 3, "invalid_request": 1}

    stats = WorkerStats()
    stats.take_not_saved(None)  # unchanged: nothing to take
    assert stats.summary()["requests_not_saved"] == {}
    stats.take_not_saved({"not_requested": 3, "invalid_request": 1})
    summary = stats.summary()
    assert summary["requests_not_saved"] == {"not_requested": 3, "invalid_request": 1}
    assert "; 4 requests not saved (invalid_request 1, not_requested 3)" in describe(summary)
