"""Pure-Python reference of docs/FORMAT.md "Recovery": completing a shard whose writer died.

``layertap.recover`` is the Rust implementation; this one is what it is checked against and what
``layertap recover --backend python`` runs.
"""

from __future__ import annotations

import fcntl
import os

from layertap._py.reader import PyShardReader
from layertap._py.shardfile import fsync_dir, io_error
from layertap._spec.format import FILE_HEADER_FIXED_LEN, MAX_META_LEN, encode_footer, is_torn_empty
from layertap._types import ProblemKind, RecoverReport
from layertap.errors import ShardLockedError


def recover(path: str | os.PathLike) -> RecoverReport:
    """Turns an open shard into a complete one: under ``LOCK_EX|LOCK_NB`` it scans the shard,
    cuts the torn tail, appends an index of every valid record and a trailer (which counts the
    damaged parts left out, ``lost_in_recovery``), and fsyncs. A complete shard is left as it
    is; a torn empty shard (shorter than its header) is removed. Raises ShardLockedError if a
    live writer holds the shard (it is not touched), FormatError if the file is not a shard."""
    path = os.fspath(path)
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # EWOULDBLOCK
            raise ShardLockedError(
                f"{path}: locked by another process (a live writer?); refusing to modify it", path
            ) from None
        size = os.fstat(fd).st_size
        if size < FILE_HEADER_FIXED_LEN + 4 + MAX_META_LEN and is_torn_empty(os.pread(fd, size, 0)):
            _remove(fd, path)
            return RecoverReport(path, False, 0, size, [], removed=True)
        # Scanned only once the lock is held, so that no writer appends behind the scan.
        with PyShardReader(path, probe_lock=False) as shard:
            if shard.complete:
                return RecoverReport(path, True, len(shard.entries), 0, [])
            entries = shard.raw_entries()
            data_end = shard.data_end
            # A file cut inside the header's padding is shorter than data_end: ftruncate below
            # pads it with zeros, so that the index frame starts at header_len.
            truncated = max(0, shard.file_bytes - data_end)
            problems = [
                p for p in shard.scan_problems if p.kind in (ProblemKind.CORRUPT_RECORD, ProblemKind.DAMAGED_REGION)
            ]
        footer = encode_footer(entries, data_end, min(len(problems), 0xFFFF_FFFF))
        try:
            os.ftruncate(fd, data_end)
            written = 0
            while written < len(footer):
                written += os.pwrite(fd, footer[written:], data_end + written)
            os.fsync(fd)
        except OSError as e:
            raise io_error(e, path, "recover") from None
        return RecoverReport(path, False, len(entries), truncated, problems)
    finally:
        os.close(fd)  # releases the lock


def _remove(fd: int, path: str) -> None:
    """Removes the torn empty shard open (and locked) as ``fd`` if ``path`` still names it."""
    ours = os.fstat(fd)
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return
    if (now.st_dev, now.st_ino) != (ours.st_dev, ours.st_ino):
        return  # replaced since it was opened: not ours to remove
    try:
        os.unlink(path)
    except OSError as e:
        raise io_error(e, path, "remove") from None
    fsync_dir(os.path.dirname(path) or ".")
