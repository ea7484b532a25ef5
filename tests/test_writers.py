"""What the writer does (docs/API.md, "Writers"), ``ShardWriter`` with each I/O backend where it
matters, on real files. Shards are read back with the pure-Python reader. Its threads, budget and
batching are in test_writer.py."""

from __future__ import annotations

import array
import errno
import gc
import json
import os

import numpy as np
import pytest
import torch

import layertap
from helpers import make_tensors, mounted, run_python, shard_files, takes_o_direct, writer_class
from layertap._spec.lock import is_locked
from layertap.errors import DuplicateKeyError, InvalidInputError, OptionError, WriterClosedError


@pytest.fixture(autouse=True)
def _no_io_override(monkeypatch):
    monkeypatch.delenv("LAYERTAP_IO", raising=False)


def _uring_or_skip(tmp_path_factory) -> None:
    """io_uring refused by the kernel is reported as a skip, with the reason."""
    try:
        writer_class()(tmp_path_factory.mktemp("probe"), io="uring").close()
    except OSError as e:
        pytest.skip(f"io_uring is not available here: {e}")


@pytest.fixture(params=["uring", "pwrite", "uring-direct", "pwrite-direct"])
def io_options(request, tmp_path_factory) -> dict:
    """The writer's I/O options: each backend, through the page cache and with O_DIRECT
    (tests/test_writer_direct.py has the rest)."""
    io, *direct = request.param.split("-")
    if io == "uring":
        _uring_or_skip(tmp_path_factory)
    return {"io": io, "direct": bool(direct)}


def Writer(path, **options):
    return writer_class()(os.fspath(path), **options)


def read(path) -> layertap.Dataset:
    return layertap.open(os.fspath(path), backend="python")


# ---------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("codec", ["none", "zstd", "bp16-zstd"])
def test_torch_numpy_and_buffers_round_trip(tmp_path, io_options, codec):
    rng = np.random.default_rng(0)
    tensors = {
        "hidden_states": torch.randn(5, 3, 16).to(torch.bfloat16),
        "half": torch.randn(7, 3).to(torch.float16),
        "single": torch.randn(4, 4),
        "token_ids": torch.arange(5, dtype=torch.int64) * 7,
        "np_f32": rng.standard_normal((3, 5)).astype(np.float32),
        "np_u8": rng.integers(0, 255, 13, dtype=np.uint8),
        "raw_bytes": (np.arange(6, dtype=np.int16).tobytes(), "I16", (2, 3)),
        "raw_bytearray": (bytearray(b"\x01\x02\x03"), "U8", (3,)),
        "raw_view": (memoryview(np.arange(4, dtype=np.float64)), "F64", [4]),
        "raw_array": (array.array("i", [1, -2, 3]), "I32", (3,)),
    }
    with Writer(tmp_path, codec=codec, writer_id="w", metadata={"model": "m"}, **io_options) as w:
        assert w.backend == {"uring": "io_uring", "pwrite": "pwrite"}[io_options["io"]]
        assert w.stats["direct"] is (io_options["direct"] and takes_o_direct(tmp_path))
        assert w.writer_id == "w" and w.path == str(tmp_path)
        seq = w.submit("rec", tensors, {"layer_ids": "[1, 2, 3]"})
        w.flush()
        done = w.poll()
        assert w.poll() == []
    assert seq == 0
    assert [tuple(c) for c in done] == [(0, "rec", os.path.join(str(tmp_path), "w-000000.lts"), *done[0][3:])]
    with read(tmp_path) as ds:
        rec = ds["rec"]
        assert list(rec.tensors) == list(tensors)
        assert rec.num_tokens == 5 and rec.layer_ids == [1, 2, 3]
        assert rec.metadata == {"key": "rec", "layer_ids": "[1, 2, 3]"}
        assert ds.shards[0].complete and ds.shards[0].meta["user"] == {"model": "m"}
        assert ds.shards[0].meta["writer"].startswith("layertap-rust ")
        assert ds.shards[0].meta["writer_id"] == "w" and ds.shards[0].meta["shard_index"] == 0
        assert ds.verify().ok
        for name in ["hidden_states", "half", "single", "token_ids"]:
            assert rec[name].dtype == tensors[name].dtype and torch.equal(rec[name], tensors[name])
        assert rec["np_f32"].numpy().tolist() == tensors["np_f32"].tolist()
        assert rec["np_u8"].numpy().tolist() == tensors["np_u8"].tolist()
        assert rec["raw_bytes"].tolist() == [[0, 1, 2], [3, 4, 5]]
        assert rec["raw_bytearray"].tolist() == [1, 2, 3]
        assert rec["raw_view"].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert rec["raw_array"].tolist() == [1, -2, 3]
        assert (done[0].offset, done[0].stored_len) == (rec.offset, ds.shards[0].stored_bytes)


def test_many_records_in_order_across_shards(tmp_path, io_options):
    with Writer(tmp_path, codec="bp16-zstd", shard_size=4096, writer_id="r", threads=3, **io_options) as w:
        seqs = [w.submit(f"k{i}", make_tensors(i, tokens=8, hidden=32)) for i in range(40)]
        w.flush()
        done = w.poll()
        stats = w.stats
    assert seqs == list(range(40)) and [c.seq for c in done] == seqs
    names = [os.path.basename(p) for p in shard_files(tmp_path)]
    assert len(names) > 3 and names == [f"r-{n:06}.lts" for n in range(len(names))]
    assert stats["records_submitted"] == stats["records_written"] == 40
    assert stats["shards_closed"] == len(names) - 1
    assert stats["bytes_in"] == sum(c.raw_len for c in done)
    assert stats["bytes_stored"] == sum(c.stored_len for c in done)
    assert stats["ratio"] == pytest.approx(stats["bytes_in"] / stats["bytes_stored"])
    assert stats["queue_depth"] == stats["inflight_bytes"] == 0
    # It compressed 40 records, on its 3 threads.
    assert stats["threads"] == 3 and stats["encode_seconds"] > 0
    with read(tmp_path) as ds:
        assert ds.keys() == [f"k{i}" for i in range(40)] and ds.verify().ok
        assert all(s.complete for s in ds.shards)
        assert [s.meta["shard_index"] for s in ds.shards] == list(range(len(names)))
        for i in (0, 17, 39):
            assert torch.equal(ds[f"k{i}"].hidden_states, make_tensors(i, tokens=8, hidden=32)["hidden_states"])
        # A record that would take a shard past shard_size starts the next one.
        for s, backend in zip(ds.shards, ds.backends):
            assert backend.data_end <= 4096 or s.records == 1


@pytest.mark.parametrize("durability", ["none", "close", 4096])
def test_durability_modes(tmp_path, io_options, durability):
    with Writer(tmp_path, durability=durability, codec="none", **io_options) as w:
        for i in range(10):
            w.submit(f"k{i}", make_tensors(i, tokens=32, hidden=32))
        w.flush()
    with read(tmp_path) as ds:
        assert len(ds) == 10 and ds.verify().ok


def test_writer_id_continues_after_existing_shards(tmp_path):
    for prefix in ("first", "second"):
        with Writer(tmp_path, writer_id="rank0") as w:
            w.submit(prefix, make_tensors(0))
    (tmp_path / "rank0-000007.lts").write_bytes(b"not looked at")
    with Writer(tmp_path, writer_id="rank0") as w:
        w.submit("third", make_tensors(0))
    names = sorted(os.listdir(tmp_path))
    assert names == ["rank0-000000.lts", "rank0-000001.lts", "rank0-000007.lts", "rank0-000008.lts"]
    assert (tmp_path / "rank0-000007.lts").read_bytes() == b"not looked at"
    with Writer(tmp_path / "d") as w:
        wid = w.writer_id
    assert os.listdir(tmp_path / "d") == [f"{wid}-000000.lts"]


def test_same_writer_id_at_once_fails_instead_of_mixing(tmp_path):
    a = Writer(tmp_path, writer_id="x", shard_size=100, codec="none")  # creates x-000000
    b = Writer(tmp_path, writer_id="x", codec="none")  # continues with x-000001
    a.submit("a0", make_tensors(0))
    with pytest.raises(layertap.WriterIOError) as info:
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
    with read(tmp_path) as ds:
        assert ds.keys() == ["a0", "b0"] and ds.verify().ok


# ---------------------------------------------------------------------------------------------
# Options


@pytest.mark.parametrize(
    "options, option, match",
    [
        ({"codec": "lz4"}, "codec", "codec must be one of 'none', 'zstd', 'bp16-zstd', 'exp-huf', not 'lz4'"),
        ({"codec": "zstd", "level": 99}, "level", "level must be a zstd level from -131072 to 22, not 99"),
        ({"level": "3"}, "level", "level must be an integer, not '3'"),
        ({"codec": "none", "level": 1 << 40}, "level", "level must be a 32-bit integer"),
        ({"shard_size": 0}, "shard_size", "shard_size must be a positive integer below 2\\*\\*64, not 0"),
        ({"shard_size": -5}, "shard_size", "shard_size must be a positive"),
        ({"durability": "sometimes"}, "durability", "must be 'none', 'close' or a positive number of bytes"),
        ({"durability": 0}, "durability", "durability must be"),
        ({"durability": True}, "durability", "durability must be"),
        ({"threads": 0}, "threads", "threads must be None or an integer from 1 to 256, not 0"),
        ({"threads": 1000}, "threads", "threads must be"),
        ({"max_inflight_bytes": -1}, "max_inflight_bytes", "max_inflight_bytes must be a positive"),
        ({"batch_bytes": 0}, "batch_bytes", "batch_bytes must be a positive"),
        ({"batch_bytes": 1 << 70}, "batch_bytes", "batch_bytes must be a positive integer below"),
        ({"writer_id": ".hidden"}, "writer_id", "writer_id must be None or 1 to 64 characters"),
        ({"writer_id": "a/b"}, "writer_id", "writer_id must be None or 1 to 64 characters .* not 'a/b'"),
        ({"writer_id": 5}, "writer_id", "writer_id must be"),
        ({"io": "mmap"}, "io", "io must be one of 'auto', 'uring', 'pwrite', not 'mmap'"),
        ({"direct": "yes"}, "direct", "direct must be True or False, not 'yes'"),
        ({"direct": 1}, "direct", "direct must be True or False"),
        ({"metadata": {"a": 1}}, "metadata", "metadata entry 'a': 1: keys and values must be str"),
        ({"metadata": ["a"]}, "metadata", "metadata must be a mapping of str to str, not list"),
        ({"metadata": {"a": "\ud800"}}, "metadata", "not valid UTF-8"),
        ({"metadata": {"a": "x" * (600 << 10)}}, "metadata", "metadata is too large"),
        ({"key_memory": 0}, "key_memory", "key_memory must be a positive integer"),
    ],
)
def test_bad_options_are_refused_alike(tmp_path, options, option, match):
    with pytest.raises(OptionError, match=match) as info:
        Writer(tmp_path / "ds", **options)
    assert info.value.option == option
    assert isinstance(info.value, InvalidInputError) and isinstance(info.value, ValueError)
    assert not (tmp_path / "ds").exists()


def test_options_object_and_overrides(tmp_path):
    options = layertap.WriterOptions(codec="zstd", level=3, writer_id="o", metadata={"run": "1"})
    assert options == layertap.WriterOptions(codec="zstd", level=3, writer_id="o", metadata={"run": "1"})
    with pytest.raises(TypeError):
        options.metadata["run"] = "2"  # read-only: checked values stay checked
    with pytest.raises(AttributeError):
        options.codec = "none"  # frozen
    with Writer(tmp_path, options=options, shard_size=1 << 20) as w:
        assert w.options == options.replace(shard_size=1 << 20) != options
        w.submit("k", make_tensors(0))
    with read(tmp_path) as ds:
        assert ds.shards[0].codecs == {"zstd": 1} and ds.shards[0].meta["user"] == {"run": "1"}
        assert ds.keys() == ["k"]
    with pytest.raises(TypeError, match="bogus"):
        Writer(tmp_path / "x", bogus=1)
    with pytest.raises(InvalidInputError, match="options must be a layertap.WriterOptions"):
        Writer(tmp_path / "x", options={"codec": "none"})


def test_io_uring_alias():
    """``"io_uring"`` (the backend's name in ``stats``) is taken for ``"uring"``."""
    assert layertap.WriterOptions(io="io_uring").io == "uring"


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "key",
    ["", "a/b", "a\\b", "line\nbreak", "tab\t", "nul\x00", "del\x7f", "k" * 1025, "\ud800", 7, None, b"k"],
)
def test_bad_keys_are_refused_before_queuing(tmp_path, key):
    with Writer(tmp_path) as w:
        with pytest.raises(InvalidInputError):
            w.submit(key, make_tensors(0))
        assert w.stats["records_submitted"] == 0
        assert w.submit("good", make_tensors(0)) == 0


def test_longest_key_is_taken(tmp_path):
    with Writer(tmp_path) as w:
        w.submit("é" * 512, make_tensors(0))
    with read(tmp_path) as ds:
        assert ds.keys() == ["é" * 512]


def test_duplicate_key(tmp_path):
    with Writer(tmp_path) as w:
        w.submit("k", make_tensors(0))
        w.flush()
        with pytest.raises(DuplicateKeyError) as info:
            w.submit("k", make_tensors(1))
        assert info.value.key == "k" and isinstance(info.value, InvalidInputError)
        assert w.submit("k2", make_tensors(1)) == 1
    with read(tmp_path) as ds:
        assert ds.keys() == ["k", "k2"]
        assert torch.equal(ds["k"].hidden_states, make_tensors(0)["hidden_states"])


def test_key_memory_bounds_the_keys_remembered(tmp_path):
    """With ``key_memory=3`` the writer refuses a key among the last three it took and forgets
    older ones (a server's writer keeps bounded memory); the readers report the duplicate."""
    with Writer(tmp_path, key_memory=3) as w:
        for key in "abcd":
            w.submit(key, make_tensors(0))
        for recent in "bcd":
            with pytest.raises(DuplicateKeyError):
                w.submit(recent, make_tensors(1))
        w.submit("a", make_tensors(1))  # four keys ago: forgotten
        with pytest.raises(DuplicateKeyError):
            w.submit("a", make_tensors(2))
    with read(tmp_path) as ds:
        assert ds.keys() == ["a", "b", "c", "d", "a"]
        assert torch.equal(ds["a"].hidden_states, make_tensors(0)["hidden_states"])  # the first
        assert [p.kind for p in ds.verify().problems] == ["duplicate_key"]


@pytest.mark.parametrize(
    "tensors, match",
    [
        ({}, "at least one tensor"),
        ([("x", torch.zeros(2))], "mapping"),
        ({"x": torch.zeros(4, 4).t()}, "not contiguous"),
        ({"x": np.zeros((4, 4))[:, 1]}, "not C-contiguous"),
        ({"x": (memoryview(b"abcdef")[::2], "U8", (3,))}, "not C-contiguous"),
        ({"x": (b"abc", "F32", (1,))}, "needs 4"),
        ({"x": (b"abcd", "Q4", (1,))}, "unknown or unsupported dtype"),
        ({"x": (b"abcd", "U8", (-4,))}, "negative"),
        ({"x": [1, 2]}, "expected a torch.Tensor"),
        ({"x": ("text", "U8", (4,))}, "buffer protocol"),
        ({"__metadata__": torch.zeros(1)}, "not allowed"),
        ({"\udc80": torch.zeros(1)}, "UTF-8"),
    ],
)
def test_bad_tensors(tmp_path, tensors, match):
    with Writer(tmp_path) as w:
        with pytest.raises(InvalidInputError, match=match):
            w.submit("k", tensors)
        w.submit("k", {"x": torch.zeros(1)})  # the key was not taken by the failed call


@pytest.mark.parametrize("codec", ["none", "zstd", "bp16-zstd"])
def test_zero_token_records_round_trip(tmp_path, codec):
    # A request that produced no token is a record with empty tensors: written, read back by
    # both readers, with num_tokens 0 (docs/FORMAT.md, "Record payload").
    empty = {
        "hidden_states": torch.zeros(0, 2, 8, dtype=torch.bfloat16),
        "token_ids": torch.zeros(0, dtype=torch.int64),
    }
    with Writer(tmp_path, codec=codec) as w:
        w.submit("empty", empty, {"model": "m"})
        w.submit_many([("between", make_tensors(1)), ("raw", {"x": (b"", "U8", (0,)), "y": (b"ab", "U8", (2,))})])
        w.submit_buffers([("buffers", [("hidden_states", b"", "F16", (0, 3, 4))], None, 0)])
    for backend in ("python", "rust"):
        with layertap.open(tmp_path, backend=backend) as ds:
            assert ds.keys() == ["empty", "between", "raw", "buffers"] and ds.verify().ok
            rec = ds["empty"]
            assert rec.num_tokens == 0 and rec.metadata["model"] == "m"
            assert tuple(rec.hidden_states.shape) == (0, 2, 8) and rec.hidden_states.dtype == torch.bfloat16
            assert tuple(rec.token_ids.shape) == (0,) and rec.token_ids.dtype == torch.int64
            assert torch.equal(ds["between"].hidden_states, make_tensors(1)["hidden_states"])
            assert tuple(ds["raw"]["x"].shape) == (0,) and ds["raw"]["y"].tolist() == [97, 98]
            assert list(ds["raw"].tensors) == ["x", "y"]
            assert tuple(ds["buffers"].hidden_states.shape) == (0, 3, 4)
            assert [s.tokens for s in ds.shards] == [3]


@pytest.mark.parametrize("metadata", [{"key": "x"}, {"a": 1}, {1: "a"}, ["a"], {"a": "\ud800"}])
def test_bad_record_metadata(tmp_path, metadata):
    with Writer(tmp_path) as w:
        with pytest.raises(InvalidInputError):
            w.submit("k", make_tensors(0), metadata)
        assert w.stats["records_submitted"] == 0


# ---------------------------------------------------------------------------------------------
# Lifecycle


def test_closed_writer(tmp_path):
    w = Writer(tmp_path)
    w.submit("k", make_tensors(0))
    w.close()
    w.close()  # idempotent
    assert [c.key for c in w.poll()] == ["k"]  # completed by close, still collected
    with pytest.raises(WriterClosedError):
        w.submit("k2", make_tensors(1))
    with pytest.raises(WriterClosedError):
        w.flush()
    with read(tmp_path) as ds:
        assert ds.shards[0].complete and len(ds) == 1


def test_an_empty_writer_leaves_an_empty_complete_shard(tmp_path):
    Writer(tmp_path, writer_id="e").close()
    with read(tmp_path) as ds:
        assert len(ds) == 0 and ds.shards[0].complete and ds.verify().ok


def test_a_dropped_writer_is_closed(tmp_path):
    w = Writer(tmp_path, writer_id="d")
    w.submit("k", make_tensors(0))
    del w
    gc.collect()
    with read(tmp_path) as ds:
        assert ds.shards[0].complete and ds.keys() == ["k"]


def test_reading_while_the_writer_is_open(tmp_path):
    with Writer(tmp_path, codec="zstd") as w:
        w.submit("a", make_tensors(0))
        w.flush()
        with read(tmp_path) as ds:
            assert ds.keys() == ["a"] and ds.shards[0].being_written and not ds.shards[0].complete
            assert ds.verify().ok
        w.submit("b", make_tensors(1))
    with read(tmp_path) as ds:
        assert ds.keys() == ["a", "b"] and ds.shards[0].complete and not ds.shards[0].being_written


def test_a_complete_shard_is_unlocked_before_its_fsync(tmp_path):
    """A shard is unlocked once its trailer is written: when the first record of the next shard
    is reported, the shards before it are not being written and ``recover`` leaves them as they
    are. (The Rust writer fsyncs them on its sync thread meanwhile; they used to stay locked until
    that fsync ended, and ``recover`` refused them.)"""
    with Writer(tmp_path, durability="close", shard_size=4096, writer_id="w") as w:
        newest = None
        for i in range(24):
            w.submit(f"k{i}", make_tensors(i, tokens=8, hidden=32))
            shard = w.poll(timeout=30.0)[-1].shard
            if shard == newest:
                continue
            for path in shard_files(tmp_path):
                if path < shard:
                    assert not is_locked(path), path
                    assert layertap.recover(path).was_complete, path
            newest = shard
    assert len(shard_files(tmp_path)) > 3


def test_writer_left_open_at_exit_completes_its_shard(tmp_path):
    code = """
import sys, torch, layertap
w = layertap.ShardWriter(sys.argv[1], writer_id="exit", codec="bp16-zstd")
for i in range(3):
    w.submit(f"k{i}", {"x": torch.randn(64, 64).to(torch.bfloat16)})
# no close(): interpreter exit must complete the shard
"""
    proc = run_python(code, str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    with read(tmp_path) as ds:
        assert ds.shards[0].complete and len(ds) == 3


def test_poll_with_a_timeout_waits_for_the_first_record(tmp_path):
    with Writer(tmp_path, codec="zstd", level=1) as w:
        assert w.poll(timeout=None) == []  # nothing in flight: returns at once
        w.submit("a", make_tensors(0, tokens=2000, hidden=512))
        assert [c.key for c in w.poll(timeout=None)] == ["a"]
        w.submit("b", make_tensors(1, tokens=2000, hidden=512))
        got = w.poll(timeout=30.0)
        assert [c.key for c in got] == ["b"]
        for bad in (-1, float("nan"), float("inf")):
            with pytest.raises(InvalidInputError, match="timeout"):
                w.poll(timeout=bad)


# ---------------------------------------------------------------------------------------------
# Write errors: real failing writes


_FILL_UNTIL_ERROR = """
import json, sys, torch
import layertap
from layertap.errors import WriterIOError, WriterClosedError

def fill(path, io_options):
    w = layertap.ShardWriter(path, writer_id="f", codec="none", batch_bytes=4096, **io_options)
    out = {"done": [], "backend": w.backend}
    try:
        for i in range(10_000):
            w.submit(f"k{i}", {"x": torch.full((1000,), float(i))})
            out["done"] += [c.key for c in w.poll()]
        w.flush()
    except WriterIOError as e:
        out.update(errno=e.errno, filename=e.filename, message=str(e), is_oserror=isinstance(e, OSError))
    try:
        w.submit("after", {"x": torch.ones(1)})
    except WriterClosedError as e:
        out["closed"] = str(e)
    out["done"] += [c.key for c in w.poll()]  # records written before the error
    w.close()  # does not raise again
    return out
"""


def _check_failed_shard(shard: str, out: dict, want_errno: int, recover: bool = True) -> None:
    """The writer raised ``want_errno`` naming ``shard``, refused work after it, and every
    record reported done is intact in the shard (which the Rust writer cuts back to whole
    frames)."""
    assert out["errno"] == want_errno and out["is_oserror"], out
    assert out["filename"] == shard, out
    assert "closed" in out, out
    assert 1 <= len(out["done"]) < 10_000
    with read(os.path.dirname(shard)) as ds:
        (info,) = ds.shards
        assert not info.complete
        assert info.torn_tail_bytes == 0
        keys = ds.keys()
        assert keys[: len(out["done"])] == out["done"]
        for key in out["done"]:
            assert torch.equal(ds[key]["x"], torch.full((1000,), float(int(key[1:]))))
        assert not [p for p in ds.verify().problems if p.kind != "torn_tail"]
    if recover:
        assert layertap.recover(shard).records == len(keys)
        with read(os.path.dirname(shard)) as ds:
            assert ds.shards[0].complete and ds.keys() == keys and ds.verify().ok


def test_file_size_limit_gives_efbig_and_keeps_written_records(tmp_path, io_options):
    # With O_DIRECT the write crossing the limit is cut to a length O_DIRECT refuses (EINVAL);
    # the Rust writer retries it through the page cache, which gives EFBIG.
    code = (
        _FILL_UNTIL_ERROR
        + """
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
print(json.dumps(fill(sys.argv[1], json.loads(sys.argv[2]))))
"""
    )
    proc = run_python(code, str(tmp_path), json.dumps(io_options))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    _check_failed_shard(os.path.join(str(tmp_path), "f-000000.lts"), out, errno.EFBIG)
    assert "write" in out["message"]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs; the test fails (never skips) if it cannot be mounted."""
    with mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=1m", "tmpfs", purpose="the disk-full test") as mnt:
        yield mnt


def test_disk_full_gives_enospc_and_keeps_written_records(small_tmpfs, io_options):
    code = _FILL_UNTIL_ERROR + "print(json.dumps(fill(sys.argv[1], json.loads(sys.argv[2]))))"
    ds_dir = small_tmpfs / "ds"
    proc = run_python(code, str(ds_dir), json.dumps(io_options))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["backend"] == {"uring": "io_uring", "pwrite": "pwrite"}[io_options["io"]]
    # The disk is still full, so recovery (which appends an index) is not tried here.
    _check_failed_shard(os.path.join(str(ds_dir), "f-000000.lts"), out, errno.ENOSPC, recover=False)


def test_the_removed_python_writer_names_its_replacement():
    want = r"^layertap.PyShardWriter was removed in 0.1.0: the Rust writer, layertap.ShardWriter \(same constructor"
    with pytest.raises(ImportError, match=want):
        layertap.PyShardWriter  # noqa: B018
    with pytest.raises(ImportError, match=want):
        from layertap import PyShardWriter  # noqa: F401
