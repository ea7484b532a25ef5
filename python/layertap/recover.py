"""``layertap.recover``: completing a shard whose writer died (docs/FORMAT.md, "Recovery"), by the
Rust core. ``layertap._py.recover`` is the pure-Python reference it is tested against."""

from __future__ import annotations

import os

from layertap._types import Problem, ProblemKind, RecoverReport


def recover(path: str | os.PathLike) -> RecoverReport:
    """Turns the open shard at ``path`` into a complete one: under ``LOCK_EX|LOCK_NB`` it scans
    the shard, truncates it to the end of its last valid record frame (cutting the torn tail and
    any unusable footer), appends an index of the valid records and a trailer, and fsyncs.

    A complete shard is left untouched (``was_complete=True``). Corrupt records and damaged
    regions stay in the file, unindexed, and are listed in ``problems``; the trailer keeps their
    number (``ShardInfo.lost_in_recovery``). Running it again after an interruption gives the
    same result. A torn empty shard (a file shorter than its header, which holds no record) is
    removed (``removed=True``).

    Raises ``ShardLockedError`` if a live writer holds the shard (nothing is changed),
    ``FormatError`` if the file is not a shard, ``OSError`` (e.g. ``FileNotFoundError``) if it
    cannot be opened, and ``WriterIOError`` if truncating, writing or fsyncing fails.
    """
    # Imported here so that ``import layertap`` works without the extension built.
    from layertap._native import recover as native_recover

    path = os.fspath(path)
    d = native_recover(path)
    return RecoverReport(
        path=d["path"],
        was_complete=d["was_complete"],
        records=d["records"],
        truncated_bytes=d["truncated_bytes"],
        removed=d["removed"],
        problems=[
            Problem(path, offset, key, ProblemKind(kind), message) for kind, offset, key, message in d["problems"]
        ],
    )


__all__ = ["recover"]
