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

import threading
import time

import numpy as np

import layertap
from helpers import a_busy_python_thread


def record(i: int) -> tuple:
    return (f"k{i}", {"hidden_states": (np.full(64, i, dtype=np.uint16), "BF16", [1, 64])})


def test_submit_and_submit_many_keep_the_gil_when_the_budget_has_room(tmp_path):
    with layertap.ShardWriter(tmp_path, codec="none") as w:
        w.submit(*record(0))  # the writer's threads started
        w.flush()
        # Batches of 2,000 small records: long enough inside the writer (milliseconds) for the
        # spinning thread to take a released GIL, which it then keeps until the switch interval.
        batches = [[record(10_000 * i + j) for j in range(2000)] for i in range(1, 4)]
        with a_busy_python_thread():
            t0 = time.perf_counter()
            for batch in batches:
                w.submit_many(batch)
            w.submit(*record(9))
            elapsed = time.perf_counter() - t0
    # 4 calls: well under a second unless one released the GIL (then about 1 s each).
    assert elapsed < 0.9, f"4 submissions took {elapsed:.2f} s: a submission released the GIL"
    with layertap.open(tmp_path) as ds:
        assert len(ds) == 6002 and ds.verify().ok


def test_submit_releases_the_gil_while_it_waits_for_budget(tmp_path):
    """The other side: a submission that must wait for room lets other Python threads run."""
    ran = threading.Event()
    with layertap.ShardWriter(tmp_path, codec="none", max_inflight_bytes=1) as w:
        big = [
            (f"b{j}", {"hidden_states": (np.zeros(1 << 20, dtype=np.uint16), "BF16", [1, 1 << 20])}) for j in range(4)
        ]
        other = threading.Thread(target=ran.set)
        other.start()  # runs once the main thread releases the GIL
        w.submit_many(big)  # each record after the first waits for the one before
        other.join()
    assert ran.is_set()
