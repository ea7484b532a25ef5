"""Submitting keeps the GIL when nothing waits (``ShardWriter::admits_now``).

Releasing the GIL around a call that returns at once hands it to any other runnable Python
thread (vLLM's engine core runs two beside its engine loop), and taking it back costs up to the
interpreter's switch interval, on every call: 5 ms by default, measured on the H200 host as most
of the connector's 3-4 ms per step with short requests (benches/RESULTS.md, 2026-12-02). With
the switch interval at 1 s and a thread spinning in Python, each release would cost a second.
The connector's native sink submits through the same function of the bindings
(``submit_many_holding_gil``); its own path cannot be timed this way on the CPU, where every
torch call of the gather releases the GIL too.
"""

from __future__ import annotations

import gc
import time

import numpy as np

import layertap
from helpers import BUSY_WRITER, a_busy_python_thread, busy_record, loops_while


def record(i: int) -> tuple:
    return (f"k{i}", {"hidden_states": (np.full(64, i, dtype=np.uint16), "BF16", [1, 64])})


def test_submit_and_submit_many_keep_the_gil_when_the_budget_has_room(tmp_path):
    with layertap.ShardWriter(tmp_path, codec="none") as w:
        w.submit(*record(0))  # the writer's threads started
        w.flush()
        # Batches of 2,000 small records: long enough inside the writer (milliseconds) for the
        # spinning thread to take a released GIL, which it then keeps until the switch interval.
        # A call that released the GIL takes a second, every time; a slow machine (a descheduled
        # thread) can make one call slow once: the best of three tries is what counts.
        tries = []
        for attempt in range(3):
            batches = [[record(10_000 * (3 * attempt + i) + j) for j in range(2000)] for i in range(1, 4)]
            calls = [lambda b=b: w.submit_many(b) for b in batches]
            calls.append(lambda a=attempt: w.submit(*record(a + 1)))
            gc.disable()  # a collection in the timed block is not the writer's doing
            try:
                with a_busy_python_thread():
                    took = []
                    for call in calls:
                        t0 = time.perf_counter()
                        call()
                        took.append(time.perf_counter() - t0)
            finally:
                gc.enable()
            tries.append(max(took))
            if tries[-1] < 0.9:
                break
    assert min(tries) < 0.9, f"the slowest of 4 submissions took {tries} s in each try: a submission released the GIL"
    with layertap.open(tmp_path) as ds:
        assert len(ds) == 1 + 6001 * len(tries) and ds.verify().ok


def test_submit_releases_the_gil_while_it_waits_for_budget(tmp_path):
    """The other side: a submission that must wait for room lets other Python threads run."""
    with layertap.ShardWriter(tmp_path, max_inflight_bytes=1, **BUSY_WRITER) as w:
        # the second record waits for the first, which keeps the writer busy for about a second
        # (two records of codec none were written in milliseconds: too short a window for the
        # counting thread to be scheduled on a loaded machine)
        during, elapsed = loops_while(lambda: w.submit_many([("busy", busy_record()), record(1)]))
    assert during > 10_000, f"another thread ran only {during} loops during a {elapsed:.2f} s wait"
