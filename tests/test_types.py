"""``ProblemKind`` and the ``ShardBackend`` protocol (``layertap._types``), as both readers give
them."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import layertap
from layertap import Problem, ProblemKind, ShardBackend
from layertap._text import problem_line
from layertap.reader import backend_class


def torn_shard(tmp_path) -> str:
    """A shard of two records whose writer stopped in the second one's frame."""
    with layertap.ShardWriter(str(tmp_path), codec="none", writer_id="w") as w:
        for k in ("a", "b"):
            w.submit(k, {"x": np.arange(64, dtype=np.float32)})
    (path,) = [os.path.join(tmp_path, n) for n in os.listdir(tmp_path) if n.endswith(".lts")]
    with open(path, "rb") as f:
        data = f.read()
    # Keep the header and the first record, and half the second one: no index, a torn tail.
    with layertap.open(path, backend="python") as ds:
        second = ds.backends[0].entries[1].frame_offset
    with open(path, "wb") as f:
        f.write(data[: second + 40])
    return path


@pytest.mark.parametrize("backend", ["rust", "python"])
def test_both_backends_follow_the_protocol_and_give_kinds(tmp_path, backend):
    path = torn_shard(tmp_path)
    shard = backend_class(backend)(path)
    try:
        assert isinstance(shard, ShardBackend)
        assert [p.kind for p in shard.scan_problems] == [ProblemKind.TORN_TAIL]
        assert all(type(p.kind) is ProblemKind for p in shard.scan_problems)
    finally:
        shard.close()


def test_a_kind_prints_and_serializes_as_its_value():
    p = Problem("s.lts", 8, "k", ProblemKind.CORRUPT_RECORD, "checksum mismatch")
    assert p.kind == "corrupt_record" and ProblemKind("corrupt_record") is ProblemKind.CORRUPT_RECORD
    assert f"{p.kind}" == str(p.kind) == "corrupt_record"
    assert json.loads(json.dumps(p._asdict()))["kind"] == "corrupt_record"
    assert problem_line(p).startswith("corrupt_record: ")
