"""``submit_many``: several records in one call, all or none (docs/API.md).
The vLLM connector submits each engine step's records this way."""

from __future__ import annotations

import os

import pytest
import torch

import layertap
from helpers import make_tensors, shard_files, writer_class
from layertap.errors import DuplicateKeyError, InvalidInputError, WriterClosedError


@pytest.fixture
def Writer():
    cls = writer_class()
    return lambda path, **options: cls(os.fspath(path), **options)


def read_all(path) -> dict:
    with layertap.open(os.fspath(path), backend="python") as ds:
        assert ds.verify().ok
        return {rec.key: {name: t.clone() for name, t in rec.tensors.items()} | {"_meta": rec.metadata} for rec in ds}


def test_records_get_consecutive_seqs_and_read_back(tmp_path, Writer):
    records = [(f"k{i}", make_tensors(i, tokens=5 + i)) for i in range(6)]
    records[2] = (*records[2], {"source": "two"})
    with Writer(tmp_path, codec="bp16-zstd") as w:
        assert w.submit("first", make_tensors(99)) == 0
        assert w.submit_many(records) == [1, 2, 3, 4, 5, 6]
        assert w.submit_many([]) == []
        w.flush()
        done = w.poll()
    assert [c.seq for c in done] == list(range(7)) and [c.key for c in done][1:] == [k for k, *_ in records]
    back = read_all(tmp_path)
    for key, tensors, *_meta in records:
        for name, t in tensors.items():
            assert torch.equal(back[key][name], t), (key, name)
    assert back["k2"]["_meta"]["source"] == "two"


def test_same_bytes_as_one_by_one(tmp_path, Writer):
    records = [(f"k{i}", make_tensors(i, tokens=7)) for i in range(5)]
    with Writer(tmp_path / "many", codec="none", writer_id="w") as w:
        w.submit_many(records)
    with Writer(tmp_path / "one", codec="none", writer_id="w") as w:
        for key, tensors in records:
            w.submit(key, tensors)
    # Everything but the file headers (shard id, creation time) and the 32-byte trailers.
    (many,), (one,) = shard_files(tmp_path / "many"), shard_files(tmp_path / "one")
    with open(many, "rb") as f, open(one, "rb") as g:
        a, b = f.read(), g.read()
    header_len = lambda data: (36 + int.from_bytes(data[12:16], "little") + 7) // 8 * 8
    assert a[header_len(a) : -32] == b[header_len(b) : -32] and len(a) - header_len(a) > 5 * 7 * 8


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        (("k1", make_tensors(1)), DuplicateKeyError, "duplicate key .k1."),  # twice in the batch
        (("k0", make_tensors(1)), DuplicateKeyError, "duplicate key .k0."),  # written before
        (("k9", {"x": torch.zeros(3).t()[::2]}), InvalidInputError, "not contiguous"),
        (("k9", {"x": torch.zeros(2)}, {"key": "no"}), InvalidInputError, "may not set 'key'"),
        (("k9",), InvalidInputError, "each record must be a tuple"),
        ((7, {"x": torch.zeros(2)}), InvalidInputError, "record key must be a str"),
        (("", {"x": torch.zeros(2)}), InvalidInputError, "key"),
    ],
    ids=["dup-in-batch", "dup-earlier", "non-contiguous", "reserved-meta", "short-tuple", "int-key", "empty-key"],
)
def test_one_bad_record_refuses_them_all(tmp_path, Writer, bad, error, message):
    with Writer(tmp_path, codec="zstd") as w:
        w.submit("k0", make_tensors(0))
        with pytest.raises(error, match=message):
            w.submit_many([("k1", make_tensors(1)), ("k2", make_tensors(2)), bad])
        assert w.stats["records_submitted"] == 1  # nothing of the batch was queued
        assert w.submit_many([("k1", make_tensors(1)), ("k2", make_tensors(2))]) == [1, 2]
    assert sorted(read_all(tmp_path)) == ["k0", "k1", "k2"]


def test_closed_writer_refuses(tmp_path, Writer):
    w = Writer(tmp_path)
    w.close()
    with pytest.raises(WriterClosedError):
        w.submit_many([("k", make_tensors(0))])


def test_submit_buffers_is_checked_alike_by_both_writers(tmp_path, Writer):
    """``submit_buffers`` (the ``RecordSink`` method the vLLM connector calls) takes records as
    byte buffers, without torch or numpy; both writers check them and refuse all or none."""
    data = memoryview(bytearray(12))
    ids = memoryview(bytearray(16))
    good = ("k", [("x", data, "F32", [3]), ("token_ids", ids, "I64", [2])], {"m": "1"}, 2)
    bad = [
        (("k", [("x", data, "F32", [4])], None, 0), "tensor .x."),  # 12 bytes are not 4 F32
        (("k", [("x", data, "Q4", [3])], None, 0), "dtype"),
        (("k", [("x", data, "F32", [3])], {"key": "y"}, 0), "key"),
        (("k", [("x", data, "F32", [3])], {"a": 1}, 0), "metadata"),
        (("k", [("x", data, "F32", [3])], None, -1), "num_tokens|each record must be a tuple"),
        (("k", [("x", data, "F32", [3])], None), "tuple"),
        (("a/b", [("x", data, "F32", [3])], None, 0), "a/b"),
        (("k", [("x", memoryview(bytearray(8))[::2], "U8", [4])], None, 0), "C-contiguous"),
    ]
    with Writer(tmp_path) as w:
        assert isinstance(w, layertap.RecordSink)
        for record, match in bad:
            with pytest.raises(InvalidInputError, match=match):
                w.submit_buffers([good, record])
        assert w.stats["records_submitted"] == 0
        assert w.submit_buffers([good]) == [0]
        assert w.submit_buffers([]) == []
    with layertap.open(os.fspath(tmp_path)) as ds:
        rec = ds["k"]
        assert rec["x"].tolist() == [0.0, 0.0, 0.0] and rec.num_tokens == 2
        assert rec.metadata == {"key": "k", "m": "1"}
    with pytest.raises(WriterClosedError):
        w.submit_buffers([("k2", [("x", data, "F32", [3])], None, 0)])
