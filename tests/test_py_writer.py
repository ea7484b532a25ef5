"""Behaviour of the pure-Python writer (docs/API.md, "Writers"), on real files."""

from __future__ import annotations

import errno
import gc
import os
import textwrap

import numpy as np
import pytest
import torch

import layertap
from helpers import make_tensors, run_python, shard_files, write_records
from layertap import PyShardWriter
from layertap._py.reader import PyShardReader
from layertap.errors import (
    DuplicateKeyError,
    InvalidInputError,
    WriterClosedError,
    WriterIOError,
)


def _reader(path):
    return PyShardReader(path, probe_lock=False)


def test_records_are_written_in_order_with_completions(tmp_path):
    with PyShardWriter(tmp_path, codec="zstd", writer_id="w") as w:
        seqs = [w.submit(f"k{i}", make_tensors(i)) for i in range(5)]
        w.flush()
        done = w.poll()
        assert w.poll() == []
        assert w.backend == "python" and w.writer_id == "w" and w.path == str(tmp_path)
    assert seqs == [0, 1, 2, 3, 4]
    assert [c.seq for c in done] == seqs and [c.key for c in done] == [f"k{i}" for i in range(5)]
    (path,) = shard_files(tmp_path)
    with _reader(path) as r:
        assert r.complete and not r.scan_problems
        assert [(e.key, e.frame_offset, e.stored_len, e.raw_len) for e in r.entries] == [
            (c.key, c.offset, c.stored_len, c.raw_len) for c in done
        ]
        assert all(c.shard == path for c in done)
        assert [e.num_tokens for e in r.entries] == [3] * 5
        meta = r.meta
    assert meta["writer_id"] == "w" and meta["shard_index"] == 0 and meta["user"] == {}
    assert meta["writer"].startswith("layertap-python ")


def test_inputs_torch_numpy_and_buffers(tmp_path):
    h = torch.randn(2, 3, 4).to(torch.bfloat16)
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    raw = np.arange(4, dtype=np.int16).tobytes()
    with PyShardWriter(tmp_path, codec="bp16-zstd", metadata={"model": "m"}) as w:
        w.submit("a", {"hidden_states": h, "arr": arr, "raw": (raw, "I16", (4,)), "token_ids": torch.arange(2)})
    with layertap.open(tmp_path, backend="python") as ds:
        rec = ds["a"]
        assert torch.equal(rec.hidden_states, h)
        assert rec["arr"].numpy().tolist() == arr.tolist()
        assert rec["raw"].tolist() == [0, 1, 2, 3]
        assert list(rec.tensors) == ["hidden_states", "arr", "raw", "token_ids"]
        assert rec.num_tokens == 2
        assert ds.shards[0].meta["user"] == {"model": "m"}


def test_rotation_at_shard_size(tmp_path):
    with PyShardWriter(tmp_path, codec="none", shard_size=1000, writer_id="r") as w:
        for i in range(12):
            w.submit(f"k{i}", make_tensors(i))  # ~360 bytes a frame
        w.flush()
        closed_before_close = w.stats["shards_closed"]
    names = [os.path.basename(p) for p in shard_files(tmp_path)]
    assert names == [f"r-{n:06}.lts" for n in range(len(names))] and len(names) >= 3
    assert closed_before_close in (len(names) - 1, len(names))  # the last may have filled up too
    keys = []
    for n, p in enumerate(shard_files(tmp_path)):
        with _reader(p) as r:
            assert r.complete and r.meta["shard_index"] == n
            # A record that would take a shard past shard_size starts the next one.
            assert r.data_end <= 1000 or len(r.entries) == 1
            keys += [e.key for e in r.entries]
    assert keys == [f"k{i}" for i in range(12)]


def test_writer_id_continues_after_existing_shards(tmp_path):
    write_records(tmp_path, 1, writer_id="rank0")
    write_records(tmp_path, 1, writer_id="rank0", prefix="second")
    (tmp_path / "rank0-000007.lts").write_bytes(b"not looked at")
    with PyShardWriter(tmp_path, writer_id="rank0") as w:
        w.submit("third", make_tensors(0))
    names = sorted(os.listdir(tmp_path))
    assert names == ["rank0-000000.lts", "rank0-000001.lts", "rank0-000007.lts", "rank0-000008.lts"]
    assert (tmp_path / "rank0-000007.lts").read_bytes() == b"not looked at"


def test_same_writer_id_at_once_fails_instead_of_mixing(tmp_path):
    a = PyShardWriter(tmp_path, writer_id="x", shard_size=100, codec="none")  # creates x-000000
    b = PyShardWriter(tmp_path, writer_id="x", codec="none")  # continues with x-000001
    a.submit("a0", make_tensors(0))  # past shard_size: x-000000 is closed
    with pytest.raises(WriterIOError) as info:
        a.submit("a1", make_tensors(1))  # needs x-000001, which b holds
        a.flush()
    assert info.value.errno == errno.EEXIST
    assert info.value.filename == os.path.join(str(tmp_path), "x-000001.lts")
    with pytest.raises(WriterClosedError):
        a.submit("a2", make_tensors(2))
    assert [c.key for c in a.poll()] == ["a0"]
    a.close()
    b.submit("b0", make_tensors(0))
    b.close()
    with layertap.open(tmp_path, backend="python") as ds:
        assert ds.keys() == ["a0", "b0"] and ds.verify().ok


@pytest.mark.parametrize("durability, at_least, at_most", [("none", 0, 0), ("close", 2, 4), (600, 6, 100)])
def test_durability_policies_fsync(tmp_path, monkeypatch, durability, at_least, at_most):
    calls = []
    real = os.fsync

    def counting_fsync(fd):
        calls.append(fd)
        return real(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    with PyShardWriter(tmp_path, codec="none", durability=durability, batch_bytes=1) as w:
        for i in range(8):
            w.submit(f"k{i}", make_tensors(i))
    # "close": the directory after creating the shard, the shard at close; N bytes: every ~N.
    assert at_least <= len(calls) <= at_most, calls


def test_flush_fsyncs_unless_none(tmp_path, monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
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
    "key",
    ["", "a/b", "a\\b", "line\nbreak", "tab\t", "del\x7f", "k" * 1025, "\ud800", 7, None],
)
def test_bad_keys_are_refused_before_queuing(tmp_path, key):
    with PyShardWriter(tmp_path) as w:
        with pytest.raises(InvalidInputError):
            w.submit(key, make_tensors(0))
        assert w.stats["records_submitted"] == 0
        assert w.submit("good", make_tensors(0)) == 0


def test_duplicate_key(tmp_path):
    with PyShardWriter(tmp_path) as w:
        w.submit("k", make_tensors(0))
        with pytest.raises(DuplicateKeyError) as info:
            w.submit("k", make_tensors(1))
        assert info.value.key == "k" and isinstance(info.value, InvalidInputError)
        assert w.submit("k2", make_tensors(1)) == 1
    with layertap.open(tmp_path, backend="python") as ds:
        assert ds.keys() == ["k", "k2"]
        assert torch.equal(ds["k"].hidden_states, make_tensors(0)["hidden_states"])


@pytest.mark.parametrize(
    "tensors, match",
    [
        ({}, "at least one tensor"),
        ([("x", torch.zeros(2))], "mapping"),
        ({"x": torch.zeros(4, 4).t()}, "not contiguous"),
        ({"x": torch.zeros(0, 3)}, "empty"),
        ({"x": (b"abc", "F32", (1,))}, "needs 4"),
        ({"x": (b"abcd", "Q4", (1,))}, "unknown or unsupported dtype"),
        ({"x": [1, 2]}, "expected a torch.Tensor"),
        ({"__metadata__": torch.zeros(1)}, "not allowed"),
        ({"\udc80": torch.zeros(1)}, "UTF-8"),
    ],
)
def test_bad_tensors(tmp_path, tensors, match):
    with PyShardWriter(tmp_path) as w:
        with pytest.raises(InvalidInputError, match=match):
            w.submit("k", tensors)
        w.submit("k", {"x": torch.zeros(1)})  # the key was not taken by the failed call


@pytest.mark.parametrize("metadata", [{"key": "x"}, {"a": 1}, {1: "a"}, ["a"], {"a": "\ud800"}])
def test_bad_record_metadata(tmp_path, metadata):
    with PyShardWriter(tmp_path) as w:
        with pytest.raises(InvalidInputError):
            w.submit("k", make_tensors(0), metadata)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"codec": "lz4"}, "unknown codec"),
        ({"codec": "zstd", "level": 99}, "level"),
        ({"shard_size": 0}, "shard_size"),
        ({"durability": "sometimes"}, "durability"),
        ({"durability": 0}, "durability"),
        ({"threads": 0}, "threads"),
        ({"max_inflight_bytes": -1}, "max_inflight_bytes"),
        ({"batch_bytes": 0}, "batch_bytes"),
        ({"writer_id": ".hidden"}, "writer id"),
        ({"writer_id": "a/b"}, "writer id"),
        ({"io": "uring"}, "no io_uring"),
        ({"io": "mmap"}, "io must be"),
        ({"metadata": {"a": 1}}, "must be str"),
    ],
)
def test_bad_options(tmp_path, options, match):
    with pytest.raises(InvalidInputError, match=match):
        PyShardWriter(tmp_path / "ds", **options)
    assert not (tmp_path / "ds").exists() or not os.listdir(tmp_path / "ds")


def test_io_pwrite_and_codec_none_ignores_level(tmp_path):
    with PyShardWriter(tmp_path, io="pwrite", codec="none", level=99) as w:
        w.submit("k", make_tensors(0))
    assert len(shard_files(tmp_path)) == 1


def test_closed_writer(tmp_path):
    w = PyShardWriter(tmp_path)
    w.submit("k", make_tensors(0))
    w.close()
    w.close()  # idempotent
    assert [c.key for c in w.poll()] == ["k"]  # completed by close, still collected
    with pytest.raises(WriterClosedError):
        w.submit("k2", make_tensors(1))
    with pytest.raises(WriterClosedError):
        w.flush()
    with _reader(shard_files(tmp_path)[0]) as r:
        assert r.complete and len(r.entries) == 1


def test_reading_while_the_writer_is_open(tmp_path):
    with PyShardWriter(tmp_path, codec="zstd") as w:
        w.submit("a", make_tensors(0))
        w.flush()
        with layertap.open(tmp_path, backend="python") as ds:
            assert ds.keys() == ["a"] and ds.shards[0].being_written and not ds.shards[0].complete
            assert ds.verify().ok
        w.submit("b", make_tensors(1))
    with layertap.open(tmp_path, backend="python") as ds:
        assert ds.keys() == ["a", "b"] and ds.shards[0].complete and not ds.shards[0].being_written


def test_an_empty_writer_leaves_an_empty_complete_shard(tmp_path):
    PyShardWriter(tmp_path, writer_id="e").close()
    with layertap.open(tmp_path, backend="python") as ds:
        assert len(ds) == 0 and ds.shards[0].complete and ds.verify().ok


def test_a_dropped_writer_is_closed(tmp_path):
    w = PyShardWriter(tmp_path, writer_id="d")
    w.submit("k", make_tensors(0))
    del w
    gc.collect()
    with _reader(shard_files(tmp_path)[0]) as r:
        assert r.complete and [e.key for e in r.entries] == ["k"]


def test_writer_left_open_at_exit_completes_its_shard(tmp_path):
    code = textwrap.dedent(
        """
        import sys, torch, layertap
        w = layertap.PyShardWriter(sys.argv[1], writer_id="exit", codec="bp16-zstd")
        for i in range(3):
            w.submit(f"k{i}", {"x": torch.randn(64, 64).to(torch.bfloat16)})
        # no close(): interpreter exit must complete the shard
        """
    )
    proc = run_python(code, str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    with _reader(shard_files(tmp_path)[0]) as r:
        assert r.complete and len(r.entries) == 3


def test_io_error_is_raised_then_writer_is_closed(tmp_path):
    # RLIMIT_FSIZE makes writes past 40 KB fail with EFBIG: a real failing write, in a subprocess.
    code = textwrap.dedent(
        """
        import errno, json, resource, signal, sys, torch
        import layertap
        from layertap.errors import WriterIOError, WriterClosedError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, resource.RLIM_INFINITY))
        w = layertap.PyShardWriter(sys.argv[1], writer_id="f", codec="none", batch_bytes=1)
        out = {"done": []}
        try:
            for i in range(100):
                w.submit(f"k{i}", {"x": torch.ones(1000)})
                out["done"] += [c.key for c in w.poll()]
            w.flush()
        except WriterIOError as e:
            out["errno"], out["filename"] = e.errno, e.filename
            out["is_oserror"] = isinstance(e, OSError)
        try:
            w.submit("after", {"x": torch.ones(1)})
        except WriterClosedError:
            out["closed"] = True
        out["done"] += [c.key for c in w.poll()]
        w.close()
        print(json.dumps(out))
        """
    )
    proc = run_python(code, str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    import json

    out = json.loads(proc.stdout)
    assert out["errno"] == errno.EFBIG and out["is_oserror"] and out["closed"]
    shard = os.path.join(str(tmp_path), "f-000000.lts")
    assert out["filename"] == shard
    assert 1 <= len(out["done"]) < 100
    # Records reported done are readable; the shard is open and recover completes it.
    with _reader(shard) as r:
        assert not r.complete
        assert [e.key for e in r.entries][: len(out["done"])] == out["done"]
    from layertap._py.recover import recover

    report = recover(shard)
    assert not report.was_complete and report.records >= len(out["done"])
    with layertap.open(shard, backend="python") as ds:
        assert ds.verify().ok and ds.keys()[: len(out["done"])] == out["done"]
