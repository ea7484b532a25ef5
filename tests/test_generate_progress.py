"""``layertap generate``'s progress readers without vLLM: ``ShardFollower`` counts a writer's
records across shards as they are written, listing the directory only when the writer has left
its shard; ``EngineTotals`` sums engines' cumulative reports into increments."""

from __future__ import annotations

import os

import layertap
from helpers import make_tensors
from layertap.generate.progress import EngineTotals, ShardFollower


def test_follower_counts_across_shards_and_lists_once_per_shard(tmp_path, monkeypatch):
    listed, polling = [], []
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path: (polling and listed.append(path)) or real(path))
    follower = ShardFollower(str(tmp_path), "gen-0")

    def poll():
        polling.append(1)
        follower.poll()
        polling.clear()

    with layertap.PyShardWriter(tmp_path, writer_id="gen-0", codec="none", shard_size=1200) as w:
        with layertap.PyShardWriter(tmp_path, writer_id="gen-1", codec="none") as other:
            other.submit("x", make_tensors(0))  # another run's shard: not counted
        for i in range(12):
            w.submit(str(i), make_tensors(i))
            w.flush()
            poll()
            assert follower.records == i + 1
    poll()
    shards = sorted(n for n in real(tmp_path) if n.startswith("gen-0-"))
    assert len(shards) >= 3 and follower.records == 12
    assert follower.raw_bytes > 0 and follower.stored_bytes >= follower.raw_bytes
    # One listing per shard the writer started (and the first), not one per poll.
    assert len(listed) <= len(shards) + 1 < 12
    follower.close()


def test_engine_totals_turn_reports_into_increments():
    t = EngineTotals()
    assert t.take(0, {"rows": 3, "tokens": 30, "bad": 0, "raw_bytes": 100, "stored_bytes": 50}) == {
        "rows": 3,
        "tokens": 30,
        "bad": 0,
    }
    assert t.take(1, {"rows": 2, "tokens": 10, "bad": 1, "raw_bytes": 60, "stored_bytes": 30})["rows"] == 2
    assert t.take(0, {"rows": 3, "tokens": 30, "bad": 0}) == {"rows": 0, "tokens": 0, "bad": 0}  # repeated
    assert t.take(0, {"rows": 5, "tokens": 44}) == {"rows": 2, "tokens": 14, "bad": 0}
    assert (t.raw_bytes, t.stored_bytes, t.ratio) == (160, 80, 2.0)
