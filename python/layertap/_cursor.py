"""``ShardCursor``: where the next frame of a shard is, for every reader that walks a shard's
frames one after the other while a writer may still be appending to it (``layertap.follow``'s
``ShardTail``, ``layertap generate``'s progress, the reference reader's scan, ``_py/scan``).

It reads only frame headers (docs/FORMAT.md, "Frames"); what a caller does with a frame that is
not (all) there yet, a damaged one or the index is the caller's: a tail waits, a scan
resynchronises. The file is read through ``pread(offset, n)``, so the cursor owns no file.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from layertap._spec.format import (
    FILE_HEADER_FIXED_LEN,
    KIND_INDEX,
    MAX_META_LEN,
    FormatProblem,
    FrameHeader,
    decode_file_header,
    read_frame_header,
)

Pread = Callable[[int, int], bytes]


def pread_fully(fd: int, offset: int, n: int) -> bytes:
    """``n`` bytes of file ``fd`` from ``offset``, fewer only where the file ends first:
    ``os.pread`` may return less than asked (a signal, a large read) before the end."""
    parts = []
    while n > 0:
        chunk = os.pread(fd, n, offset)
        if not chunk:
            break
        parts.append(chunk)
        offset += len(chunk)
        n -= len(chunk)
    return b"".join(parts)


class ShardCursor:
    """The offset of the next frame header of one shard (``pos``; None until the file header
    is complete), moved past each frame the caller takes."""

    __slots__ = ("_pread", "at_index", "pos")

    def __init__(self, pread: Pread, pos: int | None = None):
        self._pread = pread
        self.pos = pos
        self.at_index = False
        """``records`` stopped at the index frame: the shard is complete, nothing follows."""

    def find_start(self, file_bytes: int) -> bool:
        """Whether the first frame's offset is known: reads the file header the first time it is
        complete (a writer may still be writing it)."""
        if self.pos is None:
            head = self._pread(0, min(file_bytes, FILE_HEADER_FIXED_LEN + 4 + MAX_META_LEN))
            try:
                self.pos = decode_file_header(head, file_bytes).header_len
            except FormatProblem:
                return False
        return True

    def peek(self, file_bytes: int) -> FrameHeader:
        """The frame header at ``pos`` of a file of ``file_bytes`` bytes, the whole frame inside
        it; else raises FormatProblem (``Truncated`` when the file ends first, ``FrameCutOff``
        when only the payload does). Call ``find_start`` first."""
        assert self.pos is not None, "find_start first"
        return read_frame_header(self._pread, self.pos, file_bytes)

    def step(self, header: FrameHeader) -> int:
        """Moves past the frame ``header`` (the one at ``pos``); returns its offset."""
        at = self.pos
        assert at is not None
        self.pos = at + header.frame_len
        return at

    def records(self, file_bytes: int) -> Iterator[tuple[int, FrameHeader]]:
        """The record frames complete between ``pos`` and ``file_bytes``, each ``(offset,
        header)``, the cursor past each as it is yielded. Stops at the first frame that is not
        (all) there yet or not valid, and at the index (``at_index``): for a caller that
        waits for more rather than looking past damage."""
        if self.at_index or not self.find_start(file_bytes):
            return
        while True:
            try:
                h = self.peek(file_bytes)
            except FormatProblem:
                return
            if h.kind == KIND_INDEX:
                self.at_index = True
                return
            yield self.step(h), h


__all__ = ["ShardCursor"]
