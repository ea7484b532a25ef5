"""``RustShardReader``: the shard backend over the Rust core's memory-mapped reader.

Records stored with codec ``none`` are not copied: each read of a record of at least 64 KiB gets
its own private copy-on-write mapping of the shard, so its tensors are writable, writing to them
never reaches the file, and no other read of the record sees the writes. The GIL is released
while the core scans, checks checksums and decompresses.
"""

from __future__ import annotations

import os

import numpy as np

from layertap._native import NativeShardReader, batch_memory, is_being_written, read_batch_into, read_stored_into
from layertap._spec import json_text
from layertap._types import ClosedOnExit, IndexEntry, Problem, ProblemKind
from layertap.errors import FormatError


class RustShardReader(ClosedOnExit):
    """One shard, read by the Rust core: the shard-backend protocol (``layertap._types``), and
    ``shard_id``, ``header_len``, ``data_end``, ``index_unusable``, ``closed``.

    Raises ``FormatError`` for a file that is not a shard, ``OSError`` when it cannot be opened.
    ``probe_lock=False`` skips the check of whether a writer holds the shard (``being_written``
    is then False)."""

    def __init__(self, path: str | os.PathLike, *, probe_lock: bool = True):
        self.path = os.fspath(path)
        native = NativeShardReader(self.path)
        self._native = native
        self.complete: bool = native.complete
        self.file_bytes: int = native.file_bytes
        self.torn_tail_bytes: int = native.torn_tail_bytes
        self.header_len: int = native.header_len
        #: The end of the record data: the index frame's offset of a complete shard, the end of
        #: the last valid record frame of an open one.
        self.data_end: int = native.data_end
        self.index_unusable: bool = native.index_unusable
        #: Damaged parts that recovery left out of the index of this complete shard (its trailer).
        self.lost_in_recovery: int = native.lost_in_recovery
        self.shard_id: bytes = native.shard_id
        try:
            self.meta: dict = json_text.parse(native.meta_json.encode("utf-8"))
        except ValueError as e:  # the core checked it is a JSON object; keep the promise anyway
            raise FormatError(f"{self.path}: not a layertap shard: shard metadata: {e}", self.path) from None
        self.scan_problems: list[Problem] = [
            Problem(self.path, offset, key, ProblemKind(kind), message)
            for kind, offset, key, message in native.problems
        ]
        self.entries: list[IndexEntry] = [IndexEntry(*row) for row in native.entries()]
        self.being_written: bool = is_being_written(self.path) if probe_lock else False

    def read(
        self, i: int, verify: bool = True
    ) -> tuple[dict[str, str], list[tuple[str, str, tuple[int, ...], np.ndarray]]]:
        """``(metadata, [(name, dtype, shape, buffer)])`` of record ``i``, each buffer a writable
        ``uint8`` numpy array over the record's own memory. Raises ``CorruptRecordError``."""
        metadata, tensors = self._native.read(i, verify)
        return metadata, [(name, dtype, shape, np.asarray(buf)) for name, dtype, shape, buf in tensors]

    @staticmethod
    def read_batch_into(
        reads: list[tuple[RustShardReader, int, object]], name: str, *, verify: bool = True, threads: int = 1
    ) -> list[tuple[dict[str, str], list[tuple[str, str, tuple[int, ...], np.ndarray | None]]] | Exception]:
        """Reads a batch's records together: ``reads`` holds ``(reader, i, out)``, ``out`` a
        writable buffer (the record's padded row) that record ``i``'s tensor ``name`` is decoded
        straight into, zeros after it, when it fits; no two ``out`` overlap (else ``ValueError``).
        Returns, in order, what ``read`` returns (that tensor's buffer None when it went to
        ``out``), or the exception reading the record raised."""
        results = read_batch_into(
            [(r._native, i, out) for r, i, out in reads], name=name, verify=verify, threads=threads
        )
        return [
            r
            if isinstance(r, Exception)
            else (r[0], [(n, d, s, None if b is None else np.asarray(b)) for n, d, s, b in r[1]])
            for r in results
        ]

    @staticmethod
    def read_stored_into(
        reads: list[tuple[RustShardReader, int, object]], *, verify: bool = True, threads: int = 1
    ) -> list[Exception | None]:
        """Copies the stored payloads of a batch's records (for a decoder on a GPU): ``reads``
        holds ``(reader, i, out)``, ``out`` a writable buffer of exactly record ``i``'s
        ``stored_len`` bytes, no two overlapping. Returns, in order, None for each record copied
        or the exception reading it raised."""
        return read_stored_into([(r._native, i, out) for r, i, out in reads], verify=verify, threads=threads)

    @staticmethod
    def batch_memory(nbytes: int) -> np.ndarray:
        """``nbytes`` of writable memory for a batch (``read_batch_into``): an earlier batch's that
        nothing refers to any more, when large enough (it costs no page faults; its bytes are
        what that batch left), else new zeroed memory."""
        return np.asarray(batch_memory(nbytes))

    def check(self, i: int) -> None:
        """Checks record ``i``: frame header against the entry, checksum, decoding, key."""
        self._native.check(i)

    def close(self) -> None:
        """Closes the reader (idempotent). Tensors already read stay valid."""
        self._native.close()

    @property
    def closed(self) -> bool:
        return self._native.closed

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        state = "complete" if self.complete else "open"
        return f"RustShardReader({self.path!r}, {state}, {len(self.entries)} records)"


__all__ = ["RustShardReader"]
