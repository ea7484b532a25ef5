"""Behaviour of the Rust writer through ``layertap.ShardWriter`` (docs/API.md, "Writers"), on
real files, with both I/O backends. Shards are read back with the pure-Python reader."""

from __future__ import annotations

import array
import errno
import gc
import json
import os
import threading
import time
import weakref

import numpy as np
import pytest
import torch

import layertap
from helpers import make_tensors, mounted, run_python, shard_files, takes_o_direct, writer_class
from layertap.errors import DuplicateKeyError, InvalidInputError, WriterClosedError


@pytest.fixture(autouse=True)
def _no_io_override(monkeypatch):
    monkeypatch.delenv("LAYERTAP_IO", raising=False)


@pytest.fixture(params=["uring", "pwrite"])
def io(request, tmp_path_factory):
    """Each I/O backend; io_uring refused by the kernel is reported as a skip, with the reason."""
    if request.param == "uring":
        try:
            writer_class("rust")(tmp_path_factory.mktemp("probe"), io="uring").close()
        except OSError as e:
            pytest.skip(f"io_uring is not available here: {e}")
    return request.param


@pytest.fixture(params=[False, True], ids=["buffered", "direct"])
def direct(request):
    """Through the page cache, and with O_DIRECT (tests/test_writer_direct.py has the rest)."""
    return request.param


def Writer(path, **options):
    return writer_class("rust")(os.fspath(path), **options)


def read(path) -> layertap.Dataset:
    return layertap.open(os.fspath(path), backend="python")


# ---------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("codec", ["none", "zstd", "bp16-zstd"])
def test_torch_numpy_and_buffers_round_trip(tmp_path, io, codec, direct):
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
    with Writer(tmp_path, codec=codec, io=io, direct=direct, writer_id="w", metadata={"model": "m"}) as w:
        assert w.backend == {"uring": "io_uring", "pwrite": "pwrite"}[io]
        assert w.stats["direct"] is (direct and takes_o_direct(tmp_path))
        seq = w.submit("rec", tensors, {"layer_ids": "[1, 2, 3]"})
        w.flush()
        done = w.poll()
    assert seq == 0
    assert [tuple(c) for c in done] == [(0, "rec", os.path.join(str(tmp_path), "w-000000.lts"), *done[0][3:])]
    with read(tmp_path) as ds:
        rec = ds["rec"]
        assert list(rec.tensors) == list(tensors)
        assert rec.num_tokens == 5 and rec.layer_ids == [1, 2, 3]
        assert rec.metadata == {"key": "rec", "layer_ids": "[1, 2, 3]"}
        assert ds.shards[0].complete and ds.shards[0].meta["user"] == {"model": "m"}
        assert ds.shards[0].meta["writer"].startswith("layertap-rust ")
        assert ds.verify().ok
        for name in ["hidden_states", "half", "single", "token_ids"]:
            assert rec[name].dtype == tensors[name].dtype and torch.equal(rec[name], tensors[name])
        assert rec["np_f32"].numpy().tolist() == tensors["np_f32"].tolist()
        assert rec["np_u8"].numpy().tolist() == tensors["np_u8"].tolist()
        assert rec["raw_bytes"].tolist() == [[0, 1, 2], [3, 4, 5]]
        assert rec["raw_bytearray"].tolist() == [1, 2, 3]
        assert rec["raw_view"].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert rec["raw_array"].tolist() == [1, -2, 3]
        entry = ds.shards[0]
        assert (done[0].offset, done[0].stored_len) == (rec.offset, entry.stored_bytes)


def test_many_records_in_order_across_shards(tmp_path, io, direct):
    with Writer(tmp_path, codec="bp16-zstd", level=1, io=io, direct=direct, shard_size=4096, writer_id="r",
                threads=3) as w:
        seqs = [w.submit(f"k{i}", make_tensors(i, tokens=8, hidden=32)) for i in range(40)]
        w.flush()
        done = w.poll()
        stats = w.stats
    assert seqs == list(range(40)) and [c.seq for c in done] == seqs
    names = [os.path.basename(p) for p in shard_files(tmp_path)]
    assert len(names) > 3 and names == [f"r-{n:06}.lts" for n in range(len(names))]
    assert stats["records_written"] == 40 and stats["shards_closed"] == len(names) - 1
    assert stats["bytes_in"] == sum(c.raw_len for c in done)
    assert stats["ratio"] == pytest.approx(stats["bytes_in"] / stats["bytes_stored"])
    assert stats["threads"] == 3 and stats["encode_seconds"] > 0  # it compressed 40 records
    with read(tmp_path) as ds:
        assert ds.keys() == [f"k{i}" for i in range(40)] and ds.verify().ok
        assert all(s.complete for s in ds.shards)
        for i in (0, 17, 39):
            assert torch.equal(ds[f"k{i}"].hidden_states, make_tensors(i, tokens=8, hidden=32)["hidden_states"])
        # A shard goes past shard_size only when it holds a single record.
        for s in ds.shards:
            assert s.file_bytes - 32 <= 4096 + 1024 or s.records == 1


def test_submit_from_many_threads(tmp_path):
    def work(t, w):
        for i in range(25):
            w.submit(f"t{t}-{i}", make_tensors(i))

    with Writer(tmp_path, codec="zstd") as w:
        threads = [threading.Thread(target=work, args=(t, w)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        w.flush()
        done = w.poll()
    assert sorted(c.seq for c in done) == list(range(100)) == [c.seq for c in done]
    with read(tmp_path) as ds:
        assert ds.keys() == [c.key for c in done]


def test_durability_modes(tmp_path, io, direct):
    for n, durability in enumerate(["none", "close", 4096]):
        d = tmp_path / str(n)
        with Writer(d, io=io, direct=direct, durability=durability, codec="none") as w:
            for i in range(10):
                w.submit(f"k{i}", make_tensors(i, tokens=32, hidden=32))
            w.flush()
        with read(d) as ds:
            assert len(ds) == 10 and ds.verify().ok


def test_writer_id_continues_and_default_id(tmp_path):
    (tmp_path / "rank0-000007.lts").write_bytes(b"not looked at")
    with Writer(tmp_path, writer_id="rank0") as w:
        w.submit("a", make_tensors(0))
    assert sorted(os.listdir(tmp_path)) == ["rank0-000007.lts", "rank0-000008.lts"]
    with Writer(tmp_path / "d") as w:
        wid = w.writer_id
        assert f"-{os.getpid()}-" in wid and w.path == str(tmp_path / "d")
    assert os.listdir(tmp_path / "d") == [f"{wid}-000000.lts"]


def test_same_writer_id_at_once_fails_instead_of_mixing(tmp_path):
    a = Writer(tmp_path, writer_id="x", shard_size=100, codec="none")  # creates x-000000
    b = Writer(tmp_path, writer_id="x", codec="none")  # continues with x-000001
    a.submit("a0", make_tensors(0))
    a.submit("a1", make_tensors(1))  # needs x-000001, which b holds
    with pytest.raises(layertap.WriterIOError) as info:
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
# Buffers are held, not copied, and released


def test_buffers_are_held_until_written_then_released(tmp_path):
    buf = bytearray(64)
    t = torch.ones(1000)
    ref = weakref.ref(t)
    with Writer(tmp_path, codec="none") as w:
        w.submit("a", {"b": (buf, "U8", (64,)), "t": t})
        del t
        with pytest.raises(BufferError):
            buf.extend(b"x")  # exported to the writer: the no-copy path holds it
        w.flush()
        gc.collect()
        buf.extend(b"x")  # released once written
        assert ref() is None
        assert w.poll()[0].key == "a"


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


@pytest.mark.parametrize(
    "tensors, match",
    [
        ({}, "at least one tensor"),
        ([("x", torch.zeros(2))], "mapping"),
        ({"x": torch.zeros(4, 4).t()}, "not contiguous"),
        ({"x": np.zeros((4, 4))[:, 1]}, "not C-contiguous"),
        ({"x": (memoryview(b"abcdef")[::2], "U8", (3,))}, "not C-contiguous"),
        ({"x": torch.zeros(0, 3)}, "empty"),
        ({"x": (b"", "U8", (0,))}, "empty"),
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


def test_native_checks_buffers_itself(tmp_path):
    """The native writer does not trust its Python caller: a strided or short buffer is refused
    with the tensor named."""
    with Writer(tmp_path) as w:
        native = w._native
        strided = memoryview(bytearray(8))[::2]
        with pytest.raises(InvalidInputError, match='tensor "h".*not C-contiguous'):
            native.submit("k", [("h", strided, "U8", [4])], None, 0)
        with pytest.raises(InvalidInputError, match='tensor "h".*has 3 bytes'):
            native.submit("k", [("h", b"abc", "F32", [1])], None, 0)
        with pytest.raises(InvalidInputError, match='tensor "h".*unknown dtype'):
            native.submit("k", [("h", b"abcd", "float", [1])], None, 0)
        with pytest.raises(InvalidInputError, match='tensor "h".*buffer protocol'):
            native.submit("k", [("h", 1234, "U8", [1])], None, 0)
        assert native.submit("k", [("h", b"abcd", "F32", [1])], None, 0) == 0


@pytest.mark.parametrize("metadata", [{"key": "x"}, {"a": 1}, {1: "a"}, ["a"]])
def test_bad_record_metadata(tmp_path, metadata):
    with Writer(tmp_path) as w:
        with pytest.raises(InvalidInputError):
            w.submit("k", make_tensors(0), metadata)
        assert w.stats["records_submitted"] == 0


@pytest.mark.parametrize(
    "options, match",
    [
        ({"codec": "lz4"}, "unknown codec"),
        ({"codec": "zstd", "level": 99}, "level"),
        ({"level": "3"}, "level"),
        ({"shard_size": 0}, "shard_size"),
        ({"shard_size": -5}, "shard_size"),
        ({"durability": "sometimes"}, "durability"),
        ({"durability": 0}, "durability"),
        ({"durability": True}, "durability"),
        ({"threads": 0}, "threads"),
        ({"threads": 1000}, "threads"),
        ({"max_inflight_bytes": -1}, "max_inflight_bytes"),
        ({"batch_bytes": 0}, "batch_bytes"),
        ({"batch_bytes": 1 << 70}, "batch_bytes"),
        ({"writer_id": ".hidden"}, "writer id"),
        ({"writer_id": "a/b"}, "writer id"),
        ({"writer_id": 5}, "writer_id"),
        ({"io": "mmap"}, "io must be"),
        ({"direct": "yes"}, "direct must be True or False"),
        ({"direct": 1}, "direct must be True or False"),
        ({"metadata": {"a": 1}}, "must be str"),
        ({"metadata": ["a"]}, "metadata"),
    ],
)
def test_bad_options(tmp_path, options, match):
    with pytest.raises(InvalidInputError, match=match):
        Writer(tmp_path / "ds", **options)
    assert not (tmp_path / "ds").exists() or not os.listdir(tmp_path / "ds")


def test_codec_none_ignores_level_and_env_overrides_io(tmp_path, monkeypatch):
    with Writer(tmp_path / "a", codec="none", level=99) as w:
        w.submit("k", make_tensors(0))
    monkeypatch.setenv("LAYERTAP_IO", "pwrite")
    with Writer(tmp_path / "b", io="uring") as w:
        assert w.backend == "pwrite" and w.stats["backend"] == "pwrite"
    monkeypatch.setenv("LAYERTAP_IO", "sideways")
    with pytest.raises(InvalidInputError, match="LAYERTAP_IO"):
        Writer(tmp_path / "c")


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


# ---------------------------------------------------------------------------------------------
# The GIL


def _count_while(fn) -> tuple[int, float]:
    """Runs ``fn`` while another Python thread counts; returns the count and fn's duration."""
    count = 0
    running = threading.Event()
    stop = threading.Event()

    def counter():
        nonlocal count
        running.set()
        while not stop.is_set():
            count += 1

    th = threading.Thread(target=counter)
    th.start()
    running.wait()
    before = count
    start = time.perf_counter()
    try:
        fn()
    finally:
        elapsed = time.perf_counter() - start
        during = count - before
        stop.set()
        th.join()
    return during, elapsed


def test_gil_is_released_during_flush_and_blocked_submit(tmp_path):
    big = {"x": torch.randn(1 << 21).to(torch.bfloat16)}  # 4 MiB
    with Writer(tmp_path, codec="bp16-zstd", level=9, threads=1, max_inflight_bytes=1 << 30) as w:
        for i in range(6):
            w.submit(f"a{i}", big)
        during, elapsed = _count_while(w.flush)
        assert elapsed > 0.05, "flush too short to tell"
        assert during > 10_000, f"another thread ran only {during} loops during a {elapsed:.2f} s flush"

    with Writer(tmp_path / "b", codec="bp16-zstd", level=9, threads=1, max_inflight_bytes=1) as w:
        w.submit("first", big)
        during, elapsed = _count_while(lambda: w.submit("second", big))  # waits for "first"
        assert elapsed > 0.05 and w.stats["blocked_seconds"] > 0
        assert during > 10_000, f"another thread ran only {during} loops during a {elapsed:.2f} s wait"


# ---------------------------------------------------------------------------------------------
# Fork


def test_forked_child_gets_a_clear_error(tmp_path):
    with Writer(tmp_path) as w:
        w.submit("before", make_tensors(0))
        r, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: every call must refuse, naming the fork
            msg = "ok"
            for call in (lambda: w.submit("child", make_tensors(1)), w.poll, w.flush):
                try:
                    call()
                    msg = "a call worked in the child"
                except WriterClosedError as e:
                    if "forked child" not in str(e):
                        msg = f"unclear message: {e}"
                except BaseException as e:  # noqa: BLE001 - reported to the parent
                    msg = f"{type(e).__name__}: {e}"
            os.write(wfd, msg.encode())
            os._exit(0)
        os.close(wfd)
        _, status = os.waitpid(pid, 0)
        msg = os.read(r, 1000).decode()
        os.close(r)
        assert os.waitstatus_to_exitcode(status) == 0 and msg == "ok", msg
        w.submit("after", make_tensors(1))
    with read(tmp_path) as ds:
        assert ds.keys() == ["before", "after"] and ds.verify().ok


# ---------------------------------------------------------------------------------------------
# Write errors: real failing writes


_FILL_UNTIL_ERROR = """
import json, sys, torch
import layertap
from layertap.errors import WriterIOError, WriterClosedError

def fill(path, io, **options):
    w = layertap.ShardWriter(path, writer_id="f", codec="none", io=io, batch_bytes=4096, **options)
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
    record reported done is intact in the shard, which holds whole frames only."""
    assert out["errno"] == want_errno and out["is_oserror"], out
    assert out["filename"] == shard, out
    assert "closed" in out, out
    assert 1 <= len(out["done"]) < 10_000
    with read(os.path.dirname(shard)) as ds:
        (info,) = ds.shards
        assert not info.complete and info.torn_tail_bytes == 0  # cut back to whole frames
        keys = ds.keys()
        assert keys[: len(out["done"])] == out["done"]
        for key in out["done"]:
            assert torch.equal(ds[key]["x"], torch.full((1000,), float(int(key[1:]))))
        assert ds.verify().ok
    if recover:
        assert layertap.recover(shard).records == len(keys)
        with read(os.path.dirname(shard)) as ds:
            assert ds.shards[0].complete and ds.keys() == keys


def test_file_size_limit_gives_efbig_and_keeps_written_records(tmp_path, io, direct):
    # With O_DIRECT the write crossing the limit is cut to a length O_DIRECT refuses (EINVAL);
    # the writer retries it through the page cache, which gives EFBIG.
    code = _FILL_UNTIL_ERROR + """
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
print(json.dumps(fill(sys.argv[1], sys.argv[2], direct=sys.argv[3] == "1")))
"""
    proc = run_python(code, str(tmp_path), io, str(int(direct)))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    _check_failed_shard(os.path.join(str(tmp_path), "f-000000.lts"), out, errno.EFBIG)
    assert "write" in out["message"]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs; the test fails (never skips) if it cannot be mounted."""
    with mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=1m", "tmpfs", purpose="the disk-full test") as mnt:
        yield mnt


def test_disk_full_gives_enospc_and_keeps_written_records(small_tmpfs, io, direct):
    code = _FILL_UNTIL_ERROR + "print(json.dumps(fill(sys.argv[1], sys.argv[2], direct=sys.argv[3] == '1')))"
    ds_dir = small_tmpfs / "ds"
    proc = run_python(code, str(ds_dir), io, str(int(direct)))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["backend"] == {"uring": "io_uring", "pwrite": "pwrite"}[io]
    # The disk is still full, so recovery (which appends an index) is not tried here.
    _check_failed_shard(os.path.join(str(ds_dir), "f-000000.lts"), out, errno.ENOSPC, recover=False)


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


# ---------------------------------------------------------------------------------------------
# Waiting for completions (both writers: the connector's pool waits on it when it is full)


@pytest.mark.parametrize("kind", ["rust", "python"])
def test_poll_with_a_timeout_waits_for_the_first_record(tmp_path, kind):
    with writer_class(kind)(os.fspath(tmp_path), codec="zstd", level=1) as w:
        assert w.poll(timeout=None) == []  # nothing in flight: returns at once
        w.submit("a", make_tensors(0, tokens=2000, hidden=512))
        assert [c.key for c in w.poll(timeout=None)] == ["a"]
        w.submit("b", make_tensors(1, tokens=2000, hidden=512))
        got = w.poll(timeout=30.0)
        assert [c.key for c in got] == ["b"]
        for bad in (-1, float("nan"), float("inf")):
            with pytest.raises(InvalidInputError, match="timeout"):
                w.poll(timeout=bad)
