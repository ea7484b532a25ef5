"""``ShardCursor`` (``layertap._cursor``): the frames of a shard as a writer appends them, the
walk that ``follow``, generate's progress and the reference scan share."""

from __future__ import annotations

import os

import numpy as np

import layertap
from layertap._cursor import ShardCursor
from layertap._spec.format import FormatProblem


def complete_shard(tmp_path, n: int = 3) -> bytes:
    with layertap.ShardWriter(str(tmp_path), codec="zstd", writer_id="w") as w:
        for i in range(n):
            w.submit(f"k{i}", {"x": np.arange(10 * (i + 1), dtype=np.float32)})
    (name,) = [n for n in os.listdir(tmp_path) if n.endswith(".lts")]
    with open(tmp_path / name, "rb") as f:
        return f.read()


def test_records_appear_once_complete_and_the_index_ends_the_walk(tmp_path):
    data = complete_shard(tmp_path)
    with layertap.open(str(tmp_path), backend="python") as ds:
        want = [(e.frame_offset, e.key) for e in ds.backends[0].entries]
    cursor = ShardCursor(lambda offset, n: data[offset : offset + n])
    seen: list[tuple[int, str]] = []
    # The file as a writer grows it, 7 bytes at a time: every record once, in order, as soon
    # as its whole frame is there, and nothing is read twice.
    for size in range(0, len(data) + 7, 7):
        size = min(size, len(data))
        seen += [(at, h.key) for at, h in cursor.records(size)]
        assert len(seen) <= len(want) and seen == want[: len(seen)]
        if len(seen) < len(want):
            assert not cursor.at_index  # the index comes after the last record
    assert seen == want and cursor.at_index
    assert list(cursor.records(len(data))) == []


def test_peek_says_why_a_frame_cannot_be_read(tmp_path):
    data = complete_shard(tmp_path, 1)
    cursor = ShardCursor(lambda offset, n: data[offset : offset + n])
    assert not cursor.find_start(20) and cursor.pos is None  # the header is not all there
    assert cursor.find_start(len(data)) and cursor.pos is not None
    first = cursor.pos
    try:
        cursor.peek(first + 10)
    except FormatProblem as e:
        assert type(e).__name__ == "Truncated"
    else:
        raise AssertionError("a frame cut off by the end of the file was read")
    h = cursor.peek(len(data))
    assert cursor.step(h) == first and cursor.pos == first + h.frame_len
