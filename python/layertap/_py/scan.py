"""Finding a shard's records (docs/FORMAT.md, "Reading", steps 2 and 3): through the index of a
complete shard, or by scanning the frames of an open one, with resynchronisation.

What is reported (the Rust reader, rust/core/src/reader, reports the same): a record frame whose
header is valid but whose payload fails its CRC is a ``corrupt_record``; bytes skipped to find the
next valid frame header are a ``damaged_region``; both only when a valid record follows them.
The bytes from the end of the last valid record frame to the end of the file, or to the footer
(an index frame the scan meets, or the one a valid trailer points to), are the torn tail
(``torn_tail``). A footer that cannot be used (a valid trailer whose index is damaged, or an
index frame without a valid trailer) is a ``bad_index``. A frame whose header is intact but
which runs past the end of the file is the frame being written: the scan stops there.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from layertap._cursor import ShardCursor
from layertap._spec.format import (
    FRAME_HEADER_LEN,
    FRAME_MAGIC,
    KIND_INDEX,
    TRAILER_LEN,
    FormatProblem,
    FrameCutOff,
    RawEntry,
    crc32c,
    decode_index,
    decode_trailer,
    payload_crc,
    read_frame_header,
)
from layertap._types import Problem, ProblemKind

_CHUNK = 8 << 20


class _Shard(Protocol):
    path: str
    file_bytes: int
    header_len: int

    def pread(self, offset: int, n: int) -> bytearray: ...


# ---------------------------------------------------------------------------------------------
# Step 2: the index


class Footer(NamedTuple):
    index_offset: int
    entries: list[RawEntry] | None
    """The records, or None when the index is unusable."""
    problem: str | None
    """Why the index is unusable."""
    lost_in_recovery: int = 0
    """What the trailer says recovery left out of the index."""


def read_index(shard: _Shard) -> Footer | None:
    """The footer of the shard: ``None`` if the file does not end with a valid trailer (an open
    shard), else where the index is and its records, or why they cannot be used."""
    size = shard.file_bytes
    if size < shard.header_len + TRAILER_LEN:
        return None
    trailer = decode_trailer(shard.pread(size - TRAILER_LEN, TRAILER_LEN))
    if trailer is None:
        return None
    index_offset, record_count, lost = trailer
    try:
        return Footer(index_offset, _index_entries(shard, index_offset, record_count), None, lost)
    except FormatProblem as e:
        return Footer(index_offset, None, str(e))


def _index_entries(shard: _Shard, index_offset: int, record_count: int) -> list[RawEntry]:
    size = shard.file_bytes
    if index_offset % 8 or not shard.header_len <= index_offset <= size - TRAILER_LEN - FRAME_HEADER_LEN:
        raise FormatProblem(f"the trailer points at offset {index_offset}, where no index frame can be")
    end = size - TRAILER_LEN
    h = read_frame_header(shard.pread, index_offset, end)  # the index frame ends before the trailer
    if h.kind != KIND_INDEX or h.codec != 0 or h.key or h.num_tokens or h.raw_len != h.stored_len:
        raise FormatProblem("the frame at the trailer's index offset is not an index frame")
    if index_offset + h.frame_len != end:
        raise FormatProblem("the index frame does not end where the trailer starts")
    payload = shard.pread(index_offset + h.header_len, h.stored_len)
    if crc32c(payload) != h.payload_crc:
        raise FormatProblem("the index payload does not match its checksum")
    entries = decode_index(payload)
    if len(entries) != record_count:
        raise FormatProblem(f"the trailer counts {record_count} records, the index lists {len(entries)}")
    at = shard.header_len
    for e in entries:
        if e.frame_offset % 8 or e.frame_offset < at or e.frame_offset + e.frame_len > index_offset:
            raise FormatProblem(f"entry for key {e.key!r} points at offset {e.frame_offset}, outside the records")
        at = e.frame_offset + e.frame_len
    return entries


# ---------------------------------------------------------------------------------------------
# Step 3: the scan


class ScanResult(NamedTuple):
    entries: list[RawEntry]
    data_end: int
    """End of the last valid record frame (the header's end if there is none)."""
    stop: int
    """Where the scan stopped: an index frame's offset, else the end of the file."""
    stopped_at_index: bool
    problems: list[Problem]
    """Corrupt records and damaged regions before ``data_end``."""


def scan(shard: _Shard) -> ScanResult:
    size = shard.file_bytes
    cursor = ShardCursor(shard.pread, shard.header_len)
    data_end = shard.header_len
    stop, stopped_at_index = size, False
    entries: list[RawEntry] = []
    problems: list[Problem] = []
    pending: list[Problem] = []  # reported only once a valid record follows them
    damaged_from = None
    while (pos := cursor.pos or 0) < size:
        try:
            h = cursor.peek(size)
        except FrameCutOff:
            break  # the frame being written; the rest of the file is its unfinished payload
        except FormatProblem:
            if damaged_from is None:
                damaged_from = pos
            cursor.pos = _next_candidate(shard, pos + 8)  # resynchronise past the damage
            continue
        if damaged_from is not None:
            text = (
                f"damaged region of {pos - damaged_from} bytes at [{damaged_from}, {pos}): no valid frame header in it"
            )
            pending.append(Problem(shard.path, damaged_from, None, ProblemKind.DAMAGED_REGION, text))
            damaged_from = None
        if h.kind == KIND_INDEX:
            stop, stopped_at_index = pos, True
            break
        nxt = pos + h.frame_len
        cursor.step(h)
        crc = payload_crc(shard.pread, pos + h.header_len, h.stored_len)
        if crc == h.payload_crc:
            problems += pending
            pending = []
            entries.append(RawEntry(pos, h.stored_len, h.raw_len, h.num_tokens, h.payload_crc, h.codec, h.key))
            data_end = nxt
        else:
            text = f"payload checksum mismatch (frame says {h.payload_crc:#010x}, payload has {crc:#010x})"
            pending.append(Problem(shard.path, pos, h.key, ProblemKind.CORRUPT_RECORD, text))
    return ScanResult(entries, data_end, stop, stopped_at_index, problems)


def _next_candidate(shard: _Shard, start: int) -> int:
    """The first multiple of 8 at or after ``start`` where a frame header may start (its magic
    is there), else the end of the file. A position without the magic cannot hold a valid
    header, so jumping to the next one is the same as trying every multiple of 8."""
    size = shard.file_bytes
    pos = start
    while pos + 4 <= size:
        chunk = shard.pread(pos, min(_CHUNK + 3, size - pos))
        at = chunk.find(FRAME_MAGIC)
        while 0 <= at < _CHUNK:
            if (pos + at) % 8 == 0:
                return pos + at
            at = chunk.find(FRAME_MAGIC, at + 1)
        pos += _CHUNK
    return size
