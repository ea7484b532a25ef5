"""A full disk (issue 34 item 3), on a real tmpfs: the writers fill it to within one record,
raise ``DiskFullError`` naming the directory and the space left, and every record they
reported written is intact and readable."""

from __future__ import annotations

import errno
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

import layertap
from helpers import free_bytes, mounted_tmpfs
from layertap.errors import DiskFullError, WriterIOError

#: A record of 64 KiB (codec none: its frame is a little larger); 2 MiB hold 31 of them.
RECORD_BYTES = 64 << 10


@pytest.fixture(autouse=True)
def _no_io_override(monkeypatch):
    monkeypatch.delenv("LAYERTAP_IO", raising=False)


def _record(i: int) -> dict:
    return {"x": np.random.default_rng(i).integers(0, 256, RECORD_BYTES, dtype=np.uint8)}


def _fill(writer) -> tuple[DiskFullError, list]:
    """Submits records until the writer refuses one; returns the error and what it reported."""
    reported = []
    with pytest.raises(DiskFullError) as info:
        for i in range(100):
            writer.submit(f"r{i}", _record(i))
            reported += writer.poll()
        writer.flush()
    reported += writer.poll()
    return info.value, reported


@pytest.mark.parametrize("io", ["pwrite", "uring"])
def test_shard_writer_fills_a_small_disk_and_says_it_is_full(tmp_path, io):
    """``ShardWriter`` gave up on a 20 MB tmpfs with 3.8 MB free: a write of several records (up
    to ``batch_bytes``) that the disk took in part lost every record in it. Now the space left
    is less than the record that did not fit plus a page (the shard's index, written once that
    record is cut off, takes some of it)."""
    with mounted_tmpfs(tmp_path / "small", "2m") as mount:
        directory = os.path.join(mount, "ds")
        writer = layertap.ShardWriter(directory, codec="none", io=io)
        if io == "uring" and writer.stats["backend"] != "io_uring":
            writer.close()
            pytest.skip("NOT RUN: io_uring is refused here")
        error, reported = _fill(writer)
        writer.close()  # the error was raised once; the writer takes nothing more
        free = free_bytes(directory)
        assert isinstance(error, WriterIOError) and isinstance(error, OSError)
        assert error.errno == errno.ENOSPC
        assert (error.directory, error.free_bytes) == (directory, free)
        message = str(error)
        assert "\n" not in message and message.startswith(f"{directory}: disk full, "), message
        assert f", {layertap._text.human_bytes(free)} free (write of " in message, message
        frame = reported[0].stored_len
        assert free < frame + 4096, (free, frame, message)
        # Everything reported is there, in a complete shard, and nothing else.
        with layertap.open(directory) as ds:
            assert [s.complete for s in ds.shards] == [True]
            assert sorted(ds.keys()) == sorted(c.key for c in reported)
            for c in reported:
                assert np.array_equal(ds[c.key]["x"].numpy(), _record(int(c.key[1:]))["x"])
        assert len(reported) >= (2 << 20) // frame - 2, len(reported)
        verified = subprocess.run(
            [sys.executable, "-m", "layertap", "verify", directory], capture_output=True, text=True
        )
        assert verified.returncode == 0, verified.stdout + verified.stderr


def test_disk_full_error_keeps_its_details_across_processes():
    e = DiskFullError(errno.ENOSPC, "/d: disk full, 12.0 KiB free (...)", "/d/w-000000.lts", "/d", 12288)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is DiskFullError and str(back) == str(e) == "/d: disk full, 12.0 KiB free (...)"
    assert (back.errno, back.filename, back.directory, back.free_bytes) == (
        errno.ENOSPC,
        "/d/w-000000.lts",
        "/d",
        12288,
    )
