"""``PyShardReader``: one shard, read as docs/FORMAT.md "Reading" says, in pure Python.

A complete shard is read through its index; any other shard is scanned (``scan.py``). Reads use
``os.pread`` on one file descriptor, so a shard that is still growing can be opened: what was
there when it was opened is what the reader sees.
"""

from __future__ import annotations

import os
import stat

from layertap._cursor import pread_fully
from layertap._py import scan
from layertap._py.decode import decode_stored
from layertap._spec.format import (
    CODECS,
    FILE_HEADER_FIXED_LEN,
    MAX_META_LEN,
    TORN_EMPTY_REASON,
    FormatProblem,
    RawEntry,
    decode_file_header,
    is_torn_empty,
    read_frame_header,
)
from layertap._spec.lock import is_locked
from layertap._types import ClosedOnExit, IndexEntry, Problem, ProblemKind
from layertap.errors import CorruptRecordError, FormatError, LayertapError


class PyShardReader(ClosedOnExit):
    """The shard-backend protocol (see ``layertap.reader``) over one shard file. ``data_end``: the
    end of the record data (the index frame's offset of a complete shard, the end of the last
    valid record frame of an open one)."""

    def __init__(self, path: str | os.PathLike, *, probe_lock: bool = True):
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._open(probe_lock)
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise

    def _open(self, probe_lock: bool) -> None:
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{self.path}: not a layertap shard: not a regular file", self.path)
        self.file_bytes = st.st_size
        head = self.pread(0, min(self.file_bytes, FILE_HEADER_FIXED_LEN + 4 + MAX_META_LEN))
        try:
            header = decode_file_header(head, self.file_bytes)
        except FormatProblem as e:
            reason = TORN_EMPTY_REASON if is_torn_empty(head) else e
            raise FormatError(f"{self.path}: not a layertap shard: {reason}", self.path) from None
        self.shard_id = header.shard_id
        self.meta = header.meta
        self.header_len = header.header_len
        self.being_written = is_locked(self.path) if probe_lock else False
        self.scan_problems: list[Problem] = []
        footer = scan.read_index(self)
        #: Damaged parts (corrupt records, damaged regions) that recovery left out of the index
        #: of this complete shard, as its trailer says; 0 for an open shard.
        self.lost_in_recovery = 0
        if footer is not None and footer.entries is not None:
            self.complete = True
            self.lost_in_recovery = footer.lost_in_recovery
            self._raw = footer.entries
            self.data_end = footer.index_offset
            self.torn_tail_bytes = 0
        else:
            self.complete = False
            if footer is not None:
                self._problem(
                    footer.index_offset,
                    ProblemKind.BAD_INDEX,
                    f"index at offset {footer.index_offset} is unusable ({footer.problem}); "
                    "the shard was scanned instead",
                )
            found = scan.scan(self)
            self._raw = found.entries
            self.data_end = found.data_end
            self.scan_problems += found.problems
            # Behind a valid trailer, the footer (however damaged) is not part of the torn tail.
            tail_end = found.stop
            if footer is not None and found.data_end <= footer.index_offset <= found.stop:
                tail_end = footer.index_offset
            # A file cut inside the header's padding ends before header_len, where data_end is:
            # an open shard without records or torn tail (docs/FORMAT.md, "File header").
            self.torn_tail_bytes = max(0, tail_end - found.data_end)
            if self.torn_tail_bytes:
                self._problem(
                    found.data_end,
                    ProblemKind.TORN_TAIL,
                    f"torn tail of {self.torn_tail_bytes} bytes at offset {found.data_end}: "
                    "an unfinished frame after the last valid one",
                )
            if found.stopped_at_index and footer is None:
                self._problem(
                    found.stop,
                    ProblemKind.BAD_INDEX,
                    "an index frame without a valid trailer after it (the writer died while closing the shard?)",
                )
        self.entries = [
            IndexEntry(e.key, e.frame_offset, e.stored_len, e.raw_len, e.num_tokens, CODECS[e.codec], e.payload_crc)
            for e in self._raw
        ]

    def _problem(self, offset: int, kind: ProblemKind, text: str) -> None:
        self.scan_problems.append(Problem(self.path, offset, None, kind, text))

    # -- bytes --------------------------------------------------------------------------------

    def pread(self, offset: int, n: int) -> bytearray:
        """``n`` bytes at ``offset`` (fewer only at the end of the file), writable: the tensors of
        a record stored with codec ``none`` are views of them, writable as the Rust reader's."""
        if self._fd < 0:
            raise LayertapError(f"{self.path}: the shard reader is closed")
        return bytearray(pread_fully(self._fd, offset, n))

    def raw_entries(self) -> list[RawEntry]:
        return list(self._raw)

    # -- records ------------------------------------------------------------------------------

    def _corrupt(self, e: RawEntry, reason: str) -> CorruptRecordError:
        return CorruptRecordError.at(self.path, e.frame_offset, e.key, reason)

    def read(self, i: int, verify: bool = True):
        """``(metadata, [(name, dtype, shape, buffer)])`` of record ``i``; the tensors in the
        order of their data. Raises CorruptRecordError naming the shard, offset and key."""
        e = self._raw[i]
        stored = self.pread(e.payload_offset, e.stored_len)
        if len(stored) != e.stored_len:
            raise self._corrupt(e, "payload is cut off by the end of the file")
        crc = e.payload_crc if verify else None
        return decode_stored(
            stored, key=e.key, codec=e.codec, raw_len=e.raw_len, payload_crc=crc, path=self.path, offset=e.frame_offset
        )

    def check(self, i: int) -> None:
        """Full check of record ``i``: its frame header agrees with the entry, then everything
        ``read`` checks. Raises CorruptRecordError."""
        e = self._raw[i]
        try:
            h = read_frame_header(self.pread, e.frame_offset, self.file_bytes)
        except FormatProblem as problem:
            raise self._corrupt(e, f"no valid frame header at the indexed offset: {problem}") from None
        if not e.matches(h):
            raise self._corrupt(e, "the frame header does not agree with the index entry")
        self.read(i, verify=True)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __repr__(self) -> str:
        state = "complete" if self.complete else "open"
        return f"PyShardReader({self.path!r}, {state}, {len(self._raw)} records)"
