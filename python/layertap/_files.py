"""Files written whole or not at all, and directory entries that survive a crash: what several
modules write (a dataset's manifest, a run's statistics, a writer's error marker, a statistics
page) done one way, here."""

from __future__ import annotations

import os


def fsync_dir(path: str) -> None:
    """fsyncs directory ``path``, so that the files created, renamed or removed in it survive a
    crash (a file's own fsync does not cover its directory entry)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: str | bytes, *, durable: bool = False) -> None:
    """Writes ``data`` (text as UTF-8) to ``path`` through a temporary file beside it, renamed
    over ``path`` when whole: a reader sees the old file or the new one, never a part (an empty
    error marker, seen between open and write, once reported a failure with no reason). With
    ``durable`` the file and the rename are fsynced, so both survive a crash."""
    tmp = f"{path}.tmp-{os.getpid()}"
    body = data.encode() if isinstance(data, str) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(body)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


__all__ = ["fsync_dir", "write_atomic"]
