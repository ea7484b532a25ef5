"""Writing an export's files so that an interrupted export can continue: each file is written
under a temporary name in its directory, read back and compared, (optionally) fsynced, then
renamed to its final name. A file at its final name is therefore complete, and a rerun skips it.
One export at a time per output directory (a lock file), and temporary files a killed export
left behind are removed when the next one starts."""

from __future__ import annotations

import errno
import fcntl
import gzip
import io
import json
import os
from typing import Any

from layertap._files import fsync_dir, write_atomic
from layertap._types import ClosedOnExit
from layertap.errors import InvalidInputError

TMP_SUFFIX = ".layertap-tmp"
LOCK_NAME = ".layertap-export.lock"
MANIFEST_NAME = "layertap-export.json"


class ExportLock(ClosedOnExit):
    """An exclusive lock on an export's root directory, held while the export runs."""

    def __init__(self, root: str):
        os.makedirs(root, exist_ok=True)
        self._fd = os.open(os.path.join(root, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise InvalidInputError(f"{root}: another layertap export is writing there") from None
            raise

    def close(self) -> None:
        """Releases the lock (idempotent: a second close must not close another file's reused
        descriptor); the file stays (removing it would race)."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def remove_stale_temporaries(root: str, depth: int = 1) -> int:
    """Removes the temporary files under ``root`` (and its subdirectories, ``depth`` levels)
    that an interrupted export left. Call with the lock held. Returns how many."""
    removed = 0
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return 0
    for entry in entries:
        if entry.is_dir(follow_symlinks=False) and depth > 0:
            removed += remove_stale_temporaries(entry.path, depth - 1)
        elif entry.name.endswith(TMP_SUFFIX) and entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)
            removed += 1
    return removed


def write_file(path: str, data: bytes, fsync: bool) -> None:
    """Writes ``data`` to ``path`` atomically, read back and compared, fsynced when asked (its
    directory is fsynced once the export is done). Raises ``OSError``."""
    write_atomic(path, data, durable=fsync, sync_dir=False, suffix=TMP_SUFFIX, check=True)


def gzipped(data: bytes, name: str, level: int) -> bytes:
    """``data`` as the one-member gzip file that ``gzip.open(name + ".gz", "wb", compresslevel=level)``
    writes (the original name ``name`` in the header), but with no timestamp (mtime 0), so that
    the same record always gives the same bytes. zlib releases the GIL while it deflates."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename=name, mode="wb", compresslevel=level, fileobj=buf, mtime=0) as f:
        f.write(data)
    return buf.getvalue()


def _dataset_paths(source: str) -> tuple[str, ...]:
    """The dataset a manifest's ``source`` names, symlinks resolved: the same dataset reached by
    another path is the same source. (Several paths are joined by ", ", as the summary shows them.)"""
    return tuple(os.path.realpath(p) for p in source.split(", "))


def check_manifest(root: str, settings: dict[str, Any], info: dict[str, Any], fsync: bool) -> bool:
    """Writes the export's ``settings`` and ``info`` (its ``source`` dataset, and facts not
    compared) to ``root``'s manifest, or checks that an earlier export there was of the same
    source with the same settings, so that a rerun continues it rather than mixing two exports:
    a file already there counts as done, so another dataset's rows would be left as the first's.
    Returns whether an earlier export was found. Raises ``InvalidInputError``."""
    path = os.path.join(root, MANIFEST_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            earlier = json.load(f)
    except FileNotFoundError:
        write_file(path, (json.dumps({**settings, **info}, indent=2) + "\n").encode(), fsync)
        return False
    except ValueError as e:
        raise InvalidInputError(f"{path}: not a layertap export manifest: {e}") from None
    if not isinstance(earlier, dict):
        raise InvalidInputError(f"{path}: not a layertap export manifest: not a JSON object")
    source = earlier.get("source")
    if isinstance(source, str) and _dataset_paths(source) != _dataset_paths(info["source"]):
        raise InvalidInputError(
            f"{root} holds an export of {source}, not of {info['source']}: export into another directory, "
            f"or remove {root} to replace that export"
        )
    differ = sorted(k for k in settings if earlier.get(k) != settings[k])
    if differ:
        what = ", ".join(f"{k} {earlier.get(k)!r} (now {settings[k]!r})" for k in differ)
        raise InvalidInputError(
            f"{root} holds an export made with other settings: {what}; continue it with the same "
            "settings, or export to another directory"
        )
    return True


__all__ = [
    "ExportLock",
    "LOCK_NAME",
    "MANIFEST_NAME",
    "TMP_SUFFIX",
    "check_manifest",
    "fsync_dir",
    "gzipped",
    "remove_stale_temporaries",
    "write_file",
]
