"""What the connector counts for vLLM's metrics (``layertap.vllm.counters``), on the worker's real
hot path (a cache tensor, the host pool, a real writer) and on the scheduler side, without an
engine. The engine, the API server and ``/metrics`` are in test_serve.py."""

from __future__ import annotations

import time

import torch
from test_transfer import BLOCK, BLOCKS, HIDDEN, LAYERS, facts, saves

import layertap
from helpers import HandClock, writer_class
from layertap.vllm.counters import (
    REPORT_INTERVAL,
    STALL_LIMIT,
    SchedulerCounters,
    WorkerCounters,
    copy_payload,
    merge_payload,
    summarize,
)
from layertap.vllm.gather import HiddenStatesCache
from layertap.vllm.pool import HostPool
from layertap.vllm.stats import ConnectorStats, describe
from vllm_support import VLLM_WARNINGS

pytestmark = VLLM_WARNINGS


def step_saves(ended: float, *requests: tuple[str, list[int], int]):
    """A step's saves (``test_transfer.saves``) whose requests ended at ``ended``."""
    out = saves(*requests)
    out.finished_at = ended
    return out


def test_worker_reports_equal_the_records_written(tmp_path):
    from layertap.vllm.transfer import HiddenStatesSaver

    clock = HandClock()
    kv = torch.randn(BLOCKS, BLOCK, LAYERS, HIDDEN).to(torch.bfloat16)
    stats = ConnectorStats()
    counters = WorkerCounters(stats, "w", clock=clock)
    pool = HostPool(1 << 20, pin=False)
    writer = writer_class()(str(tmp_path), codec="bp16-zstd", writer_id="w")
    cache = HiddenStatesCache(kv, LAYERS, HIDDEN, BLOCK)
    saver = HiddenStatesSaver(cache, writer, pool, facts(), stats, "", counters=counters)

    ended = time.time() - 1.0  # the requests ended a second ago
    saver.start(step_saves(ended, ("a", [3, 5], 6), ("b", [0], 4)))
    saver.collect()
    counters.step(2e-4)
    saver.start(step_saves(ended, ("c", [7, 8, 9], 9)))
    while stats.records_written < 3:
        saver.collect(wait=0.05)  # the worker's wait in a step taken only for the writer
    counters.step(3e-4)
    first = counters.report(pool, writer)
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
    assert first["observations"]["engine_thread_seconds"] == [2e-4, 3e-4]
    delays = first["observations"]["record_delay_seconds"]
    assert len(delays) == 3 and all(1.0 <= d < 60 for d in delays)

    # Nothing new: no report. A step only: reported once the interval has passed, as increments.
    assert counters.report(pool, writer) is None
    counters.step(1e-4)
    assert counters.report(pool, writer) is None
    clock.advance(REPORT_INTERVAL * 0.99)
    assert counters.report(pool, writer) is None
    clock.advance(REPORT_INTERVAL * 0.02)
    second = counters.report(pool, writer)
    assert second["observations"] == {"engine_thread_seconds": [1e-4]} and "counters" not in second
    # A refused record counts as failed, reported at once when the writer is caught up.
    saver.start(step_saves(ended, ("a", [1], 2)))  # a key the writer already took
    saver.collect()
    assert counters.report(pool, writer)["counters"] == {"records_failed": 1}
    saver.close()


def test_scheduler_steps_the_engine_while_records_are_being_written(caplog):
    clock = HandClock()
    counters = SchedulerCounters(clock=clock)
    assert not counters.writing()
    for _ in range(3):
        counters.accepted()
    assert counters.writing()
    counters.worker_report({"counters": {"records_written": 2}})
    counters.worker_report(None)  # a step without a report
    assert counters.writing()
    counters.worker_report({"counters": {"records_failed": 1}})
    assert not counters.writing()

    # A writer that makes no progress for more than STALL_LIMIT seconds: the engine stops
    # stepping for it, and starts again when a record is written.
    counters.accepted()
    clock.advance(STALL_LIMIT / 2)
    counters.accepted()  # a record handed over while one is pending: the wait started before
    clock.advance(STALL_LIMIT / 2)
    assert counters.writing()
    clock.advance(STALL_LIMIT / 100)
    with caplog.at_level("WARNING", logger="vllm.layertap"):
        assert not counters.writing()
    assert "2 records not reported written" in caplog.text
    counters.worker_report({"counters": {"records_written": 1}})
    assert counters.writing()
    clock.advance(STALL_LIMIT)  # progress restarted the wait
    assert counters.writing()

    counters.not_saved("invalid_request")
    counters.not_saved("invalid_request")
    counters.not_saved("not_saved")
    assert counters.report() == {"not_saved": {"invalid_request": 2, "not_saved": 1}}
    assert counters.report() is None


def test_payloads_merge_as_vllm_aggregates_them():
    """Over the workers of a step and over the steps of a log interval: counters add up, samples
    are appended, a writer's gauges are its latest; the original payloads stay as they were."""
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
    merged = merge_payload(copy_payload(a), b)
    assert merged["counters"] == {"records_written": 3, "raw_bytes_written": 400, "stored_bytes_written": 200}
    assert merged["gauges"] == {"w": {"pool_used_bytes": 0}, "w2": {"pool_used_bytes": 5}}
    assert merged["observations"] == {"engine_thread_seconds": [1e-4, 3e-4], "record_delay_seconds": [0.5]}
    assert a["counters"]["records_written"] == 2 and a["observations"]["engine_thread_seconds"] == [1e-4]
    line = summarize(merged)
    assert line["records_written"] == 3 and line["ratio"] == 2.0 and line["not_saved_invalid_request"] == 1
    assert line["pool_used_MiB"] == round(5 / 2**20, 2) and line["engine_thread_max_us"] == 300.0
    assert line["record_delay_p50_ms"] == 500.0


def test_requests_not_saved_reach_the_worker_statistics():
    """The scheduler half's counts of requests not saved since the start go to the worker half
    (the step's metadata) only when they changed; the worker's statistics and shutdown line
    report them (test_serve.py and test_request_extras.py through real engines)."""
    counters = SchedulerCounters()
    assert counters.not_saved_totals() is None
    counters.not_saved("not_requested")
    counters.not_saved("not_requested")
    counters.not_saved("invalid_request")
    assert counters.not_saved_totals() == {"not_requested": 2, "invalid_request": 1}
    assert counters.not_saved_totals() is None
    assert counters.not_saved_totals(always=True) == {"not_requested": 2, "invalid_request": 1}
    counters.report()  # the metrics' increments are taken apart from the totals
    counters.not_saved("not_requested")
    assert counters.not_saved_totals() == {"not_requested": 3, "invalid_request": 1}

    stats = ConnectorStats()
    stats.take_not_saved(None)  # unchanged: nothing to take
    assert stats.summary()["requests_not_saved"] == {}
    stats.take_not_saved({"not_requested": 3, "invalid_request": 1})
    summary = stats.summary()
    assert summary["requests_not_saved"] == {"not_requested": 3, "invalid_request": 1}
    assert "; 4 requests not saved (invalid_request 1, not_requested 3)" in describe(summary)
