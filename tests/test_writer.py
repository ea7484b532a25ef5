"""Behaviour of the Rust writer alone through ``layertap.ShardWriter`` (docs/API.md, "Writers"):
threads, the GIL, fork, buffers held without copying, the native checks. What both writers do
alike is in test_writers.py."""

from __future__ import annotations

import gc
import os
import threading
import weakref

import numpy as np
import pytest
import torch

import layertap
from helpers import BUSY_WRITER, busy_record, make_tensors, python_runs_during, writer_class
from layertap.errors import InvalidInputError, WriterClosedError


@pytest.fixture(autouse=True)
def _no_io_override(monkeypatch):
    monkeypatch.delenv("LAYERTAP_IO", raising=False)


def Writer(path, **options):
    return writer_class()(os.fspath(path), **options)


def read(path) -> layertap.Dataset:
    return layertap.open(os.fspath(path), backend="python")


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


def test_default_writer_id_names_host_and_process(tmp_path):
    with Writer(tmp_path) as w:
        wid = w.writer_id
        assert f"-{os.getpid()}-" in wid
    assert os.listdir(tmp_path) == [f"{wid}-000000.lts"]


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


def test_native_checks_buffers_itself(tmp_path):
    """The native writer does not trust its Python caller: a strided or short buffer is refused
    with the tensor named."""
    with Writer(tmp_path) as w:
        native = w.native
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
# The GIL


#: Sizes (MiB) of the record a GIL check waits for, one try each until the check sees what it
#: looks for: random bytes that keep ``BUSY_WRITER``'s one compression thread busy (0.2, 0.6
#: and 4 s on the 2-core machine; ``helpers.busy_record``). A wait that keeps the
#: GIL lets the probe thread run 0 times however long it lasts (``python_runs_during``), so it
#: fails every try; a longer try is for a loaded machine, where the test's thread may not get
#: to its call, or the probe to the released GIL, before a short record is written.
BUSY_MIB = (1, 4, 16)


def busy(mib: int) -> dict:
    """``helpers.busy_record`` as numpy (made before the watched call: torch's methods and
    os.urandom let the GIL go by themselves, a release that is not the writer's)."""
    return {"x": busy_record(mib)["x"].numpy()}


def test_gil_is_released_during_flush_and_blocked_submit(tmp_path):
    """Another Python thread runs while ``flush`` waits and while ``submit`` waits for budget,
    watched without a clock (``helpers.python_runs_during``). Each waits for a record that keeps
    the writer's one compression thread busy (``BUSY_MIB``)."""
    small = {"x": np.zeros(1 << 10, dtype=np.uint16)}
    flushes = []
    for mib in BUSY_MIB:
        record = busy(mib)
        with Writer(tmp_path / f"a{mib}", **BUSY_WRITER) as w:
            w.submit("first", record)
            flushes.append((mib, python_runs_during(w.flush)))
        if flushes[-1][1] > 0:
            break
    assert flushes[-1][1] > 0, f"no other Python thread ran while flush waited (MiB, runs: {flushes}): it kept the GIL"

    # A try in which the test's thread was held up until "first" was written has no wait to
    # look at (blocked_seconds 0): the next, longer, try.
    tries = []
    for mib in BUSY_MIB:
        record = busy(mib)
        with Writer(tmp_path / f"b{mib}", max_inflight_bytes=1, **BUSY_WRITER) as w:
            w.submit("first", record)
            ran = python_runs_during(lambda w=w: w.submit("second", small))  # waits for "first"
            tries.append((mib, w.stats["blocked_seconds"], ran))
        if tries[-1][1] > 0 and ran > 0:
            break
    _, blocked, ran = tries[-1]
    assert blocked > 0, f"no try waited for the budget (MiB, blocked s, runs): {tries}"
    assert ran > 0, f"no other Python thread ran while submit waited for budget: it kept the GIL {tries}"


# ---------------------------------------------------------------------------------------------
# Fork


def test_forked_child_gets_a_clear_error(tmp_path):
    with Writer(tmp_path) as w:
        w.submit("before", make_tensors(0))
        r, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: every call must refuse, naming the fork
            msg = "ok"
            for call in (lambda: w.submit("child", make_tensors(1)), w.poll, w.flush, lambda: w.stats):
                try:
                    call()
                    msg = "a call worked in the child"
                except WriterClosedError as e:
                    if "forked child" not in str(e):
                        msg = f"unclear message: {e}"
                except BaseException as e:
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
