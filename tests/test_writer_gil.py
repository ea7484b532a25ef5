"""Submitting keeps the GIL when nothing waits (``ShardWriter::admits_now``).

Releasing the GIL around a call that returns at once hands it to any other runnable Python
thread (vLLM's engine core runs two beside its engine loop), and taking it back costs up to the
interpreter's switch interval, on every call: 5 ms by default, measured on the H200 host as most
of the connector's 3-4 ms per step with short requests (benches/RESULTS.md, 2026-12-02).
The connector's native sink submits through the same function of the bindings
(``submit_many_holding_gil``); its own path cannot be checked this way on the CPU, where every
torch call of the gather releases the GIL too.

Both tests watch with ``helpers.python_runs_during``: a Python thread that runs only when the
calls let the GIL go, counted without a clock, so that neither a slow nor a loaded machine
changes what they see.
"""

from __future__ import annotations

import numpy as np

import layertap
from helpers import BUSY_WRITER, busy_record, python_runs_during


def record(i: int) -> tuple:
    return (f"k{i}", {"hidden_states": (np.full(64, i, dtype=np.uint16), "BF16", [1, 64])})


def submissions(w, first: int) -> None:
    """Three batches of 2,000 small records and one record alone: milliseconds inside the
    writer per batch, long enough for the waiting probe thread to take a released GIL."""
    for i in range(1, 4):
        w.submit_many([record(first + 10_000 * i + j) for j in range(2000)])
    w.submit(*record(first))


def test_submit_and_submit_many_keep_the_gil_when_the_budget_has_room(tmp_path):
    with layertap.ShardWriter(tmp_path, codec="none") as w:
        w.submit(*record(0))  # the writer's threads started
        w.flush()
        ran = python_runs_during(lambda: submissions(w, 1))
        assert ran == 0, f"another Python thread ran {ran} times during the submissions: one released the GIL"
    with layertap.open(tmp_path) as ds:
        assert len(ds) == 2 + 6000 and ds.verify().ok


def test_submit_releases_the_gil_while_it_waits_for_budget(tmp_path):
    """The other side: a submission that must wait for room lets other Python threads run.
    The second record waits for the first, which keeps the writer's one compression thread
    busy for about a second (``BUSY_WRITER``); both go in one call, so the wait is inside it
    however the test's thread is scheduled."""
    # Made first, and as numpy: os.urandom and torch's methods (the writer's view of a tensor)
    # let the GIL go by themselves.
    busy = {"x": busy_record()["x"].numpy()}
    with layertap.ShardWriter(tmp_path, max_inflight_bytes=1, **BUSY_WRITER) as w:
        ran = python_runs_during(lambda: w.submit_many([("busy", busy), record(1)]))
        blocked = w.stats["blocked_seconds"]
    assert blocked > 0, "the second record did not wait for the budget: the test saw no wait"
    assert ran > 0, "no other Python thread ran while the submission waited for budget: it kept the GIL"
