"""Files written whole or not at all, and directory entries that survive a crash: what several
modules write (a dataset's manifest, a run's statistics, a writer's error marker, a statistics
page) done one way, here."""

from __future__ import annotations

import contextlib
import errno
import os
import threading


def fsync_dir(path: str) -> None:
    """fsyncs directory ``path``, so that the files created, renamed or removed in it survive a
    crash (a file's own fsync does not cover its directory entry)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(
    path: str, data: str | bytes, *, durable: bool = False, sync_dir: bool = True, suffix: str = "", check: bool = False
) -> None:
    """Writes ``data`` (text as UTF-8) to ``path`` through a temporary file beside it, renamed
    over ``path`` when whole: a reader sees the old file or the new one, never a part (an empty
    error marker, seen between open and write, once reported a failure with no reason). With
    ``durable`` the file and (``sync_dir``) the rename are fsynced, so both survive a crash: a
    caller writing many files fsyncs their directories once, at the end. ``suffix`` ends the
    temporary file's name, so that a caller can find those a killed run left; ``check`` reads the
    file back and compares it before the rename (``OSError`` EIO where it differs). On an error
    the temporary file is removed."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}{suffix}"
    body = data.encode() if isinstance(data, str) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        try:
            view = memoryview(body)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if check:
            with open(tmp, "rb", buffering=0) as f:
                if f.read(len(body) + 1) != body:
                    raise OSError(errno.EIO, "the file read back differs from what was written", tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable and sync_dir:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


__all__ = ["fsync_dir", "write_atomic"]
