"""``layertap.follow``: a dataset read while it is written, by real writers in this process and in
other processes (one of them killed), with damage in shards whose writer has left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import layertap
from helpers import cut_footer, flip_bit, make_tensors, payload_offset, shard_files, subprocess_env, write_records
from layertap._tensors import tensor_maker
from layertap.errors import CorruptRecordError, InvalidInputError
from layertap.follow import DatasetTail, Follow


def _writer(path, **options):
    return layertap.ShardWriter(os.fspath(path), **options)


def _expected(i: int, tokens: int = 3) -> dict:
    return make_tensors(i, tokens=tokens)


def test_records_already_there_then_new_ones_across_shards(tmp_path):
    write_records(tmp_path, 3, writer_id="old", prefix="old")  # a complete shard
    got: list[layertap.Record] = []
    had_one = threading.Semaphore(0)
    with _writer(tmp_path, writer_id="w", codec="bp16-zstd", shard_size=2000, durability="none") as w:

        def produce():
            # Each record once the follower has had the one before: every new one comes while
            # the follower waits for it, however the two threads are scheduled.
            for i in range(12):
                w.submit(f"k{i}", _expected(i, tokens=8))
                w.flush()
                if not had_one.acquire(timeout=120):  # the follower stopped: the test fails on what it got
                    return

        producer = threading.Thread(target=produce)
        # The test stops it; the idle timeout only ends a follower that missed a record (each
        # comes milliseconds after the one before), so that it fails rather than hangs.
        with layertap.follow(tmp_path, timeout=60) as records:
            producer.start()
            for rec in records:
                got.append(rec)
                if rec.key.startswith("k"):
                    had_one.release()
                if len(got) == 15:
                    break
        producer.join()
    keys = ["old0", "old1", "old2"] + [f"k{i}" for i in range(12)]
    assert [r.key for r in got] == keys
    assert len(shard_files(tmp_path)) > 3  # the writer moved through several shards meanwhile
    for rec in got[3:]:
        i = int(rec.key[1:])
        assert torch.equal(rec.hidden_states, _expected(i, tokens=8)["hidden_states"])
        assert rec.token_ids.tolist() == _expected(i, tokens=8)["token_ids"].tolist() and rec.num_tokens == 8
    assert records.skipped == 0
    # With an idle timeout, a follower stops once no new record has come for that long.
    t0 = time.monotonic()
    with layertap.follow(tmp_path, timeout=0.5) as records:
        assert [r.key for r in records] == keys
    assert time.monotonic() - t0 >= 0.5  # it waited for the idle timeout, then stopped


def test_a_follower_keeps_only_the_shards_it_still_reads(tmp_path):
    """A trainer follows a generating run for days: the shards whose records it has all had are
    dropped (their names kept, so they are not read again), and every record still comes once."""
    tail = DatasetTail(tmp_path)
    held: list[int] = []
    with _writer(tmp_path, writer_id="w", codec="none", shard_size=1500, durability="none") as w:

        def produce():
            for i in range(120):
                w.submit(f"k{i}", _expected(i))
                w.flush()

        producer = threading.Thread(target=produce)
        with Follow(tail, 3, tensor_maker("auto"), False) as records:
            producer.start()
            got = []
            for rec in records:
                got.append(rec.key)
                held.append(len(tail.shards()))
                if len(got) == 120:
                    break
            producer.join()
            # the last shard is complete once the writer is closed; one more look drops it
            w.close()
            assert list(records) == []
            after = tail.shards()
    assert got == [f"k{i}" for i in range(120)]
    assert len(shard_files(tmp_path)) >= 30  # many shards, each read once
    assert after == []
    # while records came, only the shards not yet read to their end were held (at most a few,
    # where without forgetting it was every shard so far)
    assert held[-1] <= 3, held


def test_a_writer_in_another_process_killed_midway(tmp_path):
    """Records come as another process writes them; after it is killed, every record it
    finished is there, to the same follower and to a new one, which then stops."""
    code = f"""
import sys, time, torch
sys.path.insert(0, {os.path.join(os.path.dirname(__file__))!r})
import layertap
from helpers import make_tensors
w = layertap.ShardWriter(sys.argv[1], writer_id="p", codec="zstd", shard_size=3000, durability="none")
for i in range(1000):
    w.submit(f"k{{i}}", make_tensors(i, tokens=8))
    w.flush()
    print(i, flush=True)
    time.sleep(0.01)
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=subprocess_env()
    )
    try:
        assert proc.stdout.readline().strip() == "0"  # the first record is written
        got = []
        with layertap.follow(tmp_path, timeout=60) as records:  # the test stops it (see above)
            for rec in records:
                got.append(rec.key)
                if len(got) == 20:
                    break
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            written = [line.strip() for line in proc.stdout]
            last = max([19] + [int(line) for line in written])  # 20 read, and those it said were flushed
            # The same follower reads on into the dead writer's shard, up to the last record
            # the writer said it had flushed (no wait for an idle timeout that a slow writer
            # could reach before the kill).
            while len(got) <= last and (rec := next(records, None)) is not None:
                got.append(rec.key)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    # Everything the writer had flushed when it died was handed out, in order, once; a fresh
    # follower finds those and whatever else it had written, then stops.
    assert got == [f"k{i}" for i in range(last + 1)]
    with layertap.follow(tmp_path, timeout=0) as records:
        again = [r.key for r in records]
    assert again == [f"k{i}" for i in range(len(again))] and len(again) >= last + 1


def test_corrupt_records_raise_or_are_skipped(tmp_path):
    write_records(tmp_path, 6, codec="none", shard_size=1000)
    paths = shard_files(tmp_path)
    at, n, key = payload_offset(paths[1], 0)
    flip_bit(paths[1], at + n // 2)
    with layertap.follow(tmp_path, timeout=0) as records:
        with pytest.raises(CorruptRecordError) as info:
            list(records)
    assert info.value.key == key and info.value.path == paths[1]
    with layertap.follow(tmp_path, timeout=0, errors="skip") as records:
        keys = [rec.key for rec in records]
    assert keys == [f"k{i}" for i in range(6) if f"k{i}" != key]
    assert records.skipped == 1 and records.problems[0].key == key and records.problems[0].kind == "corrupt_record"


def test_damage_in_a_shard_its_writer_left(tmp_path):
    """An open shard whose writer is gone and which a newer shard of the same writer follows:
    a corrupt payload is skipped, and a damaged frame header is passed by resynchronising (the
    shard backend's scan), so the records after it still come."""
    write_records(tmp_path, 8, codec="none", shard_size=2000)
    paths = shard_files(tmp_path)
    assert len(paths) >= 2
    with layertap.open(paths[0], backend="python") as ds:
        first = ds.keys()
    assert len(first) >= 4
    at, n, bad_payload = payload_offset(paths[0], 1)
    header_at = payload_offset(paths[0], 2)[0] - 56  # the magic of record 2's frame header
    cut_footer(paths[0])  # as if the writer died before closing it
    flip_bit(paths[0], at + n // 2)
    flip_bit(paths[0], header_at)
    with layertap.follow(tmp_path, timeout=0, errors="skip") as records:
        keys = [rec.key for rec in records]
    with layertap.open(tmp_path, backend="python") as ds:
        readable = [k for k in ds.keys() if k != bad_payload]
    assert keys == readable and first[2] not in keys and first[3] in keys
    assert records.skipped == 1 and records.problems[0].key == bad_payload


def test_only_one_writers_shards(tmp_path):
    write_records(tmp_path, 2, writer_id="a", prefix="a")
    write_records(tmp_path, 3, writer_id="b", prefix="b")
    with layertap.follow(tmp_path, timeout=0, writer_id="b", tensors="numpy") as records:
        got = list(records)
    assert [r.key for r in got] == ["b0", "b1", "b2"]
    assert got[0].token_ids.tolist() == make_tensors(0)["token_ids"].tolist()


def test_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError):
        layertap.follow(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidInputError, match="not a directory"):
        layertap.follow(tmp_path / "file")
    with pytest.raises(InvalidInputError, match="errors must be"):
        layertap.follow(tmp_path, errors="ignore")
    with pytest.raises(InvalidInputError, match="timeout must be"):
        layertap.follow(tmp_path, timeout=-1)
    with pytest.raises(InvalidInputError, match="backend must be"):
        layertap.follow(tmp_path, backend="c")
