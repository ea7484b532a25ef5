"""layertap._files: the one way the package writes a small file whole (manifest, statistics,
error marker, statistics page) and makes directory entries durable."""

from __future__ import annotations

import os
import resource
import signal

import pytest

from layertap._files import fsync_dir, write_atomic


def test_a_file_is_replaced_whole_and_no_temporary_file_stays(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old\n")
    write_atomic(str(path), "new\n")
    assert path.read_text() == "new\n"
    write_atomic(str(path), b"\x00bytes", durable=True)
    assert path.read_bytes() == b"\x00bytes"
    assert sorted(os.listdir(tmp_path)) == ["summary.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path):
    """The write fails after the temporary file was made (a file size limit: EFBIG, as a full
    disk's ENOSPC would): the old file stays as it was and the temporary one is removed."""
    path = tmp_path / "manifest.json"
    path.write_text("old\n")
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old_limit[1]))
    try:
        with pytest.raises(OSError, match="too large"):
            write_atomic(str(path), b"x" * 10000, durable=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert path.read_text() == "old\n"
    assert sorted(os.listdir(tmp_path)) == ["manifest.json"]


def test_fsync_dir_refuses_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    fsync_dir(str(tmp_path))
    with pytest.raises(NotADirectoryError):
        fsync_dir(str(tmp_path / "f"))
