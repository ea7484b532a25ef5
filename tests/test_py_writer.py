"""Behaviour of the pure-Python writer alone (docs/API.md, "Writers"): its fsyncs, its in-flight
bound, its statistics, what it refuses. What both writers do alike is in test_writers.py."""

from __future__ import annotations

import os

import numpy as np
import pytest

import layertap
from helpers import make_tensors
from layertap import PyShardWriter
from layertap.errors import OptionError


def fsyncs_under(root, monkeypatch) -> list[str]:
    """The paths ``os.fsync`` is called on from now on, those under ``root`` only: a writer
    left open by an earlier test of this process may be closed (and fsync) by the collector
    meanwhile."""
    calls: list[str] = []
    real = os.fsync
    root = os.path.realpath(root)

    def counting_fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path == root or path.startswith(root + os.sep):
            calls.append(path)
        return real(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    return calls


@pytest.mark.parametrize("durability, at_least, at_most", [("none", 0, 0), ("close", 2, 4), (600, 6, 100)])
def test_durability_policies_fsync(tmp_path, monkeypatch, durability, at_least, at_most):
    calls = fsyncs_under(tmp_path, monkeypatch)
    with PyShardWriter(tmp_path, codec="none", durability=durability, batch_bytes=1) as w:
        for i in range(8):
            w.submit(f"k{i}", make_tensors(i))
    # "close": the directory after creating the shard, the shard at close; N bytes: every ~N.
    assert at_least <= len(calls) <= at_most, calls


def test_flush_fsyncs_unless_none(tmp_path, monkeypatch):
    calls = fsyncs_under(tmp_path, monkeypatch)
    with PyShardWriter(tmp_path, codec="none", durability="close") as w:
        w.submit("a", make_tensors(0))
        before = len(calls)
        w.flush()
        assert len(calls) == before + 1


def test_submit_waits_at_max_inflight_bytes(tmp_path):
    big = {"x": np.random.default_rng(0).integers(0, 255, 4 << 20, dtype=np.uint8)}
    with PyShardWriter(tmp_path, codec="zstd", level=3, max_inflight_bytes=6 << 20) as w:
        seen = []
        for i in range(6):
            w.submit(f"k{i}", big)
            seen.append(w.stats["inflight_bytes"])
        w.flush()
        stats = w.stats
    # One 4 MiB record fits, a second would pass 6 MiB: every submit after the first waited.
    assert max(seen) <= 6 << 20
    assert stats["blocked_seconds"] > 0
    assert stats["records_written"] == 6 and stats["inflight_bytes"] == 0 and stats["queue_depth"] == 0


def test_a_record_larger_than_the_budget_is_still_taken(tmp_path):
    with PyShardWriter(tmp_path, codec="none", max_inflight_bytes=1) as w:
        for i in range(3):
            w.submit(f"k{i}", make_tensors(i))
    with layertap.open(tmp_path, backend="python") as ds:
        assert len(ds) == 3


def test_stats(tmp_path):
    with PyShardWriter(tmp_path, codec="bp16-zstd") as w:
        for i in range(4):
            w.submit(f"k{i}", make_tensors(i, tokens=64, hidden=64))
        w.flush()
        s = w.stats
        done = w.poll()
    assert s["records_submitted"] == s["records_written"] == 4
    assert s["bytes_in"] == sum(c.raw_len for c in done)
    assert s["bytes_stored"] == sum(c.stored_len for c in done)
    assert s["ratio"] == pytest.approx(s["bytes_in"] / s["bytes_stored"]) and s["ratio"] > 1
    assert s["backend"] == "python" and s["shards_closed"] == 0
    assert s["threads"] == 1 and s["encode_seconds"] > 0


@pytest.mark.parametrize(
    "options, option, match",
    [
        ({"io": "uring"}, "io", "io must be 'auto' or 'pwrite': the Python writer has no io_uring"),
        ({"io": "io_uring"}, "io", "the Python writer has no io_uring"),
        ({"direct": True}, "direct", "direct must be False: the Python writer writes through the page cache"),
    ],
)
def test_what_the_python_writer_cannot_do_is_refused(tmp_path, options, option, match):
    with pytest.raises(OptionError, match=match) as info:
        PyShardWriter(tmp_path / "ds", **options)
    assert info.value.option == option
    assert not (tmp_path / "ds").exists()


def test_io_pwrite_and_auto_are_taken(tmp_path):
    for io in ("pwrite", "auto"):
        with PyShardWriter(tmp_path / io, io=io) as w:
            w.submit("k", make_tensors(0))
            assert w.backend == "python"
