"""``ShardWriter(direct=True)``: O_DIRECT where the file system takes it, the buffered fallback
where it does not (ramfs), the same shards as without, records readable as soon as they are
reported, and a bad value refused. Round trips of every codec, rotation,
durability modes and write errors with ``direct`` are in test_writer.py (its ``direct``
fixture); the SIGKILL case is in test_crash.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import layertap
from helpers import make_tensors, mounted, shard_files, takes_o_direct, writer_class
from layertap.errors import InvalidInputError


@pytest.fixture(autouse=True)
def _no_io_override(monkeypatch):
    monkeypatch.delenv("LAYERTAP_IO", raising=False)


@pytest.fixture
def ramfs(tmp_path):
    """A ramfs, whose files refuse O_DIRECT; the test fails (never skips) if it cannot be
    mounted."""
    with mounted(tmp_path / "ramfs", "-t", "ramfs", "ramfs", purpose="the O_DIRECT fallback test") as mnt:
        yield mnt


def _records(n: int):
    """Records of sizes around and across 4 KiB blocks and 64 KiB batches."""
    for i in range(n):
        tokens = (3, 40, 700, 129)[i % 4] + i
        yield f"k{i}", make_tensors(i, tokens=tokens, hidden=24)


def _check(path, n: int) -> None:
    with layertap.open(os.fspath(path), backend="python") as ds:
        assert ds.keys() == [f"k{i}" for i in range(n)]
        assert ds.verify().ok and all(s.complete for s in ds.shards)
        for key, tensors in _records(n):
            assert torch.equal(ds[key].hidden_states, tensors["hidden_states"]), key


@pytest.mark.parametrize("io", ["uring", "pwrite"])
@pytest.mark.parametrize("codec", ["none", "bp16-zstd"])
def test_a_file_system_without_o_direct_falls_back_to_buffered_writes(ramfs, io, codec):
    assert not takes_o_direct(ramfs)
    w = writer_class()(os.fspath(ramfs), codec=codec, io=io, direct=True, shard_size=200_000, batch_bytes=64 << 10)
    with w:
        assert w.stats["direct"] is False  # asked for, not in effect: reported, not an error
        for key, tensors in _records(30):
            w.submit(key, tensors)
    assert len(shard_files(ramfs)) >= 2
    _check(ramfs, 30)


def test_direct_and_buffered_writers_write_the_same_frames(tmp_path):
    """Codec ``none``: the shards of both differ only in their headers' shard_id and creation
    time."""
    kinds = {"direct": True, "buffered": False}
    for name, direct in kinds.items():
        with writer_class()(
            os.fspath(tmp_path / name),
            codec="none",
            direct=direct,
            writer_id="w",
            shard_size=150_000,
            batch_bytes=64 << 10,
        ) as w:
            assert w.stats["direct"] is (direct and takes_o_direct(tmp_path))
            for key, tensors in _records(25):
                w.submit(key, tensors)
    shards = {name: shard_files(tmp_path / name) for name in kinds}
    assert len(shards["direct"]) >= 2 and len({len(v) for v in shards.values()}) == 1
    for files in zip(*shards.values()):
        data = [Path(f).read_bytes() for f in files]
        # Frames run from the end of the header to the index frame (the trailer's first field).
        frames = [d[_header_len(d) : int.from_bytes(d[-32:-24], "little")] for d in data]
        assert frames[0] == frames[1]
        assert data[0][_header_len(data[0]) :] == data[1][_header_len(data[1]) :], "index and trailer too"


def _header_len(shard: bytes) -> int:
    return (36 + int.from_bytes(shard[12:16], "little") + 7) // 8 * 8


def test_each_record_is_readable_once_reported(tmp_path):
    """A record reported done is in the file although its last block was not written with
    O_DIRECT yet: a reader of the open shard sees it, whole, with no torn tail after it."""
    with writer_class()(os.fspath(tmp_path), codec="zstd", direct=True, batch_bytes=64 << 10) as w:
        for n, (key, tensors) in enumerate(_records(12), start=1):
            w.submit(key, tensors)
            assert [c.key for c in w.poll(timeout=30)] == [key]
            with layertap.open(os.fspath(tmp_path), backend="python") as ds:
                assert len(ds) == n and ds.shards[0].torn_tail_bytes == 0
                assert torch.equal(ds[key].hidden_states, tensors["hidden_states"])
    # After close (fsync) the file's cached pages are dropped: what is read comes from the disk.
    for f in shard_files(tmp_path):
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    _check(tmp_path, 12)


def test_direct_must_be_a_bool(tmp_path):
    with pytest.raises(InvalidInputError, match="direct must be True or False"):
        writer_class()(os.fspath(tmp_path / "b"), direct="yes")
