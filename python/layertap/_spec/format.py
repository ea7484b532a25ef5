"""Byte layout of shards (docs/FORMAT.md): file header, frame headers, index and trailer; the
codecs' wire ids; record keys, writer ids and shard file names.

Pure encoding and decoding, no I/O but through a caller's ``pread``; the Python twin of
``rust/core/src/format.rs`` and ``names.rs``. Decoders raise ``FormatProblem`` saying what is
wrong instead of guessing, so that callers can name it.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from typing import NamedTuple

from crc32c import crc32c  # crc32c(data, value=0): the CRC continued from ``value``

from layertap._spec import json_text
from layertap.errors import InvalidInputError

FILE_MAGIC = b"\x89LTAP\r\n\x1a"
VERSION = 1
FRAME_MAGIC = b"LTRF"
TRAILER_MAGIC = b"LTAPTAIL"
FILE_HEADER_FIXED_LEN = 32
FRAME_HEADER_LEN = 48
INDEX_ENTRY_FIXED_LEN = 40
TRAILER_LEN = 32
MAX_META_LEN = 1 << 20
KIND_RECORD = 1
KIND_INDEX = 2
MAX_KEY_LEN = 1024
MAX_WRITER_ID_LEN = 64
SHARD_SUFFIX = ".lts"

#: Codec names, indexed by the id stored in frame headers and index entries (docs/FORMAT.md,
#: "Codecs").
CODECS: tuple[str, ...] = ("none", "zstd", "bp16-zstd", "exp-huf")
CODEC_NONE, CODEC_ZSTD, CODEC_BP16_ZSTD, CODEC_EXP_HUF = 0, 1, 2, 3

# magic, kind, codec, key_len, stored_len, raw_len, num_tokens, payload_crc, 12 reserved bytes
_FRAME = struct.Struct("<4sBBHQQII12x")
# frame_offset, stored_len, raw_len, num_tokens, payload_crc, codec, reserved, key_len, reserved
_ENTRY = struct.Struct("<QQQIIBxH4x")
_TRAILER = struct.Struct("<QQI")
_FILE_FIXED = struct.Struct("<8sHHI16s")


def align8(n: int) -> int:
    return (n + 7) & ~7


class FormatProblem(Exception):
    """Raised by decoders: the bytes are not what the format says; the message says why."""


# ---------------------------------------------------------------------------------------------
# Names


_WRITER_ID = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_WRITER_ID_LEN}}}")
_KEY_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f/\\]")


def key_problem(key: object) -> str | None:
    """Why ``key`` is not a valid record key, or None if it is."""
    if not isinstance(key, str):
        return f"record key must be a str, not {type(key).__name__}"
    if not key:
        return "record key is empty"
    try:
        n = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        return f"record key {key!r} is not valid UTF-8 (it holds a lone surrogate)"
    if n > MAX_KEY_LEN:
        return f"record key is {n} bytes long; the limit is {MAX_KEY_LEN} (key starts {key[:40]!r})"
    bad = _KEY_FORBIDDEN.search(key)
    if bad:
        return (
            f"record key {key!r} contains {bad.group()!r}; keys may not contain path separators or control characters"
        )
    return None


#: What a writer id may be, for messages.
WRITER_ID_RULE = f"1 to {MAX_WRITER_ID_LEN} characters from [A-Za-z0-9._-], not starting with '.'"


def writer_id_problem(writer_id: object) -> str | None:
    """Why ``writer_id`` is not a valid writer id, or None if it is."""
    if isinstance(writer_id, str) and _WRITER_ID.fullmatch(writer_id) and not writer_id.startswith("."):
        return None
    return f"writer id {writer_id!r} is not valid: use {WRITER_ID_RULE}"


def shard_file_name(writer_id: str, index: int) -> str:
    return f"{writer_id}-{index:06}{SHARD_SUFFIX}"


def parse_shard_index(file_name: str, writer_id: str) -> int | None:
    """If ``file_name`` is a shard of ``writer_id``, its index."""
    prefix = writer_id + "-"
    if not file_name.startswith(prefix) or not file_name.endswith(SHARD_SUFFIX):
        return None
    digits = file_name[len(prefix) : -len(SHARD_SUFFIX)]
    if len(digits) < 6 or not (digits.isascii() and digits.isdigit()):
        return None
    return int(digits)


def writer_and_index(file_name: str) -> tuple[str, int] | None:
    """``(writer_id, shard index)`` of a shard file name ``{writer_id}-{n:06}.lts``."""
    writer_id = file_name.rpartition("-")[0]
    index = parse_shard_index(file_name, writer_id) if writer_id else None
    return None if index is None else (writer_id, index)


# ---------------------------------------------------------------------------------------------
# File header


def encode_file_header(shard_id: bytes, meta: dict) -> bytes:
    """The file header, padding included; its length is where the first frame starts."""
    if len(shard_id) != 16:
        raise InvalidInputError(f"shard_id must be 16 bytes, not {len(shard_id)}")
    meta_bytes = json.dumps(meta, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    out = bytearray(_FILE_FIXED.pack(FILE_MAGIC, VERSION, 0, len(meta_bytes), shard_id))
    out += meta_bytes
    out += crc32c(out).to_bytes(4, "little")
    out += bytes(align8(len(out)) - len(out))
    return bytes(out)


class FileHeader(NamedTuple):
    shard_id: bytes
    meta: dict
    header_len: int
    """Where the first frame starts."""


def decode_file_header(data: bytes, file_len: int) -> FileHeader:
    """Decodes the header at the start of a file of ``file_len`` bytes whose first bytes are
    ``data`` (at least ``min(file_len, 36 + MAX_META_LEN)`` of them). Raises FormatProblem."""
    if len(data) < 8 or data[:8] != FILE_MAGIC:
        raise FormatProblem("wrong magic bytes")
    if len(data) < FILE_HEADER_FIXED_LEN + 4:
        raise FormatProblem(f"file is {file_len} bytes long, too short for a header")
    _, version, flags, meta_len, shard_id = _FILE_FIXED.unpack_from(data, 0)
    if version != VERSION:
        raise FormatProblem(f"format version {version}; this reader reads version {VERSION}")
    if flags != 0:
        raise FormatProblem(f"unknown header flags {flags:#x}")
    if meta_len > MAX_META_LEN:
        raise FormatProblem(f"shard metadata of {meta_len} bytes is larger than {MAX_META_LEN}")
    crc_at = FILE_HEADER_FIXED_LEN + meta_len
    if len(data) < crc_at + 4:
        # A file a writer left inside its header is a torn empty shard, which the readers tell
        # apart before they say this: here the header was damaged or the file cut.
        raise FormatProblem(
            f"its header's metadata length ({meta_len} bytes) runs past the end of the file: the header was "
            "damaged or the file cut (restore the shard from a copy; `layertap recover` leaves it)"
        )
    if crc32c(data[:crc_at]) != int.from_bytes(data[crc_at : crc_at + 4], "little"):
        raise FormatProblem("header checksum mismatch")
    try:
        meta = json_text.parse(data[FILE_HEADER_FIXED_LEN:crc_at])
    except ValueError as e:  # UnicodeDecodeError is one
        raise FormatProblem(f"the shard metadata is not UTF-8 JSON within FORMAT.md's limits: {e}") from None
    if not isinstance(meta, dict):
        raise FormatProblem("the shard metadata is not a JSON object")
    return FileHeader(bytes(shard_id), meta, align8(crc_at + 4))


#: What readers say about a torn empty shard (the Rust reader's words too).
TORN_EMPTY_REASON = (
    "the file ends inside its header: a torn empty shard (its writer died before writing the header; "
    "`layertap recover` removes it)"
)


def is_torn_empty(data) -> bool:
    """Whether ``data``, a whole file, is a torn empty shard (docs/FORMAT.md, "File header"):
    shorter than the header it begins (before the end of its checksum), every byte present being
    what a header holds there (magic, version 1, no flags, a metadata length readers accept), and
    no frame header following. An empty file is one. It holds no record: ``recover`` removes it."""
    fixed = _FILE_FIXED.pack(FILE_MAGIC, VERSION, 0, 0, bytes(16))[:12]
    n = min(len(data), len(fixed))
    if bytes(data[:n]) != fixed[:n]:
        return False
    if len(data) < 16:
        return True  # the metadata length is not all there: the header ends later
    meta_len = int.from_bytes(data[12:16], "little")
    return meta_len <= MAX_META_LEN and len(data) < FILE_HEADER_FIXED_LEN + meta_len + 4 and not _holds_a_frame(data)


def _holds_a_frame(data) -> bool:
    """Whether a frame header (magic and checksum right) starts at a multiple of 8 after the
    header's fixed part. A writer that died in its header wrote no frame; a shard whose
    ``meta_len`` was damaged later (one flipped bit can make a complete shard of under 1 MiB
    look shorter than its header) still holds its frames, and ``recover`` must not remove it."""
    data = bytes(data)
    view = memoryview(data)
    at = data.find(FRAME_MAGIC, FILE_HEADER_FIXED_LEN)
    while at >= 0:
        if at % 8 == 0 and at + FRAME_HEADER_LEN <= len(data):
            key_len = int.from_bytes(data[at + 6 : at + 8], "little")
            if at + FRAME_HEADER_LEN + key_len <= len(data) and _header_crc_matches(view[at:], key_len):
                return True
        at = data.find(FRAME_MAGIC, at + 1)
    return False


# ---------------------------------------------------------------------------------------------
# Frames


class FrameHeader(NamedTuple):
    kind: int
    codec: int
    key: str
    stored_len: int
    raw_len: int
    num_tokens: int
    payload_crc: int

    @property
    def header_len(self) -> int:
        """Bytes from the frame start to the payload."""
        return frame_header_len(len(self.key.encode("utf-8")))

    @property
    def frame_len(self) -> int:
        return self.header_len + align8(self.stored_len)


def frame_header_len(key_len: int) -> int:
    """Bytes from a frame's start to its payload."""
    return align8(FRAME_HEADER_LEN + key_len)


def encode_frame_header(
    kind: int, codec: int, key: bytes, stored_len: int, raw_len: int, num_tokens: int, payload_crc: int
) -> bytes:
    fixed = _FRAME.pack(FRAME_MAGIC, kind, codec, len(key), stored_len, raw_len, num_tokens, payload_crc)
    crc = crc32c(key, crc32c(fixed))
    out = fixed + crc.to_bytes(4, "little") + key
    return out + bytes(frame_header_len(len(key)) - len(out))


class Truncated(FormatProblem):
    """Fewer bytes remain than the frame needs (it runs past the end of the file)."""


class FrameCutOff(Truncated):
    """The frame header (key included) is intact and its checksum right, but the frame runs past
    the end of the file: the frame a writer is (or was) writing."""


def _header_crc_matches(data, key_len: int) -> bool:
    """Whether the frame header at the start of ``data`` (its key all there) matches its
    ``header_crc``: bytes 0-43, then the key."""
    key = data[FRAME_HEADER_LEN : FRAME_HEADER_LEN + key_len]
    return crc32c(key, crc32c(data[:44])) == int.from_bytes(data[44:48], "little")


def decode_frame_header(data, remaining: int) -> FrameHeader:
    """Decodes the frame header at the start of ``data``, where ``remaining`` bytes are left in
    the file from the frame's start. ``data`` holds at least ``min(remaining, 48 + 65535)``
    bytes. Checks magic, header CRC, kind, codec, key encoding and that the frame fits in
    ``remaining``. Raises Truncated or FormatProblem."""
    if remaining < FRAME_HEADER_LEN or len(data) < FRAME_HEADER_LEN:
        raise Truncated("frame header is cut off by the end of the file")
    if data[:4] != FRAME_MAGIC:
        raise FormatProblem("wrong frame magic")
    _, kind, codec, key_len, stored_len, raw_len, num_tokens, payload_crc = _FRAME.unpack_from(data, 0)
    if remaining < FRAME_HEADER_LEN + key_len or len(data) < FRAME_HEADER_LEN + key_len:
        raise Truncated("frame key is cut off by the end of the file")
    if not _header_crc_matches(data, key_len):
        raise FormatProblem("frame header checksum mismatch")
    key_bytes = bytes(data[FRAME_HEADER_LEN : FRAME_HEADER_LEN + key_len])
    if kind not in (KIND_RECORD, KIND_INDEX):
        raise FormatProblem(f"unknown frame kind {kind}")
    if codec >= len(CODECS):
        raise FormatProblem(f"unknown codec id {codec}")
    try:
        key = key_bytes.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatProblem("frame key is not UTF-8") from None
    header = FrameHeader(kind, codec, key, stored_len, raw_len, num_tokens, payload_crc)
    if frame_header_len(key_len) + align8(stored_len) > remaining:
        raise FrameCutOff("frame is cut off by the end of the file")
    return header


def read_frame_header(pread: Callable[[int, int], bytes], pos: int, file_bytes: int) -> FrameHeader:
    """The valid frame header at ``pos`` of a file of ``file_bytes`` bytes read with ``pread(offset,
    n)`` (the whole frame inside the file), else raises FormatProblem (``Truncated`` when the file
    ends first, ``FrameCutOff`` when only the payload does)."""
    remaining = file_bytes - pos
    head = pread(pos, min(remaining, FRAME_HEADER_LEN))
    if len(head) == FRAME_HEADER_LEN and head[:4] == FRAME_MAGIC:
        key_len = int.from_bytes(head[6:8], "little")
        if key_len:
            head = bytes(head) + bytes(pread(pos + FRAME_HEADER_LEN, min(key_len, remaining - FRAME_HEADER_LEN)))
    return decode_frame_header(head, remaining)


def payload_crc(pread: Callable[[int, int], bytes], offset: int, length: int) -> int:
    """The CRC of the ``length`` bytes at ``offset`` read with ``pread(offset, n)``, 8 MiB at a
    time (a payload may be gigabytes); bytes past the end of the file count as absent."""
    crc, end = 0, offset + length
    while offset < end:
        chunk = pread(offset, min(8 << 20, end - offset))
        if not chunk:
            break
        crc = crc32c(chunk, crc)
        offset += len(chunk)
    return crc


# ---------------------------------------------------------------------------------------------
# Index


class RawEntry(NamedTuple):
    """An index entry as stored (codec as its id)."""

    frame_offset: int
    stored_len: int
    raw_len: int
    num_tokens: int
    payload_crc: int
    codec: int
    key: str

    @property
    def frame_len(self) -> int:
        return frame_header_len(len(self.key.encode("utf-8"))) + align8(self.stored_len)

    @property
    def payload_offset(self) -> int:
        return self.frame_offset + frame_header_len(len(self.key.encode("utf-8")))

    def matches(self, h: FrameHeader) -> bool:
        """Whether this entry agrees with the frame header found at its offset."""
        mine = (self.key, self.stored_len, self.raw_len, self.num_tokens, self.payload_crc, self.codec)
        return h.kind == KIND_RECORD and (h.key, h.stored_len, h.raw_len, h.num_tokens, h.payload_crc, h.codec) == mine


def encode_index(entries: list[RawEntry]) -> bytes:
    out = bytearray(len(entries).to_bytes(8, "little"))
    for e in entries:
        key = e.key.encode("utf-8")
        start = len(out)
        out += _ENTRY.pack(e.frame_offset, e.stored_len, e.raw_len, e.num_tokens, e.payload_crc, e.codec, len(key))
        out += key
        out += bytes(start + align8(INDEX_ENTRY_FIXED_LEN + len(key)) - len(out))
    return bytes(out)


def decode_index(data) -> list[RawEntry]:
    if len(data) < 8:
        raise FormatProblem("index shorter than its entry count")
    count = int.from_bytes(data[:8], "little")
    if count > (len(data) - 8) // INDEX_ENTRY_FIXED_LEN:
        raise FormatProblem(f"index claims {count} entries in {len(data)} bytes")
    entries = []
    at = 8
    for i in range(count):
        if len(data) < at + INDEX_ENTRY_FIXED_LEN:
            raise FormatProblem(f"index entry {i} is cut off")
        frame_offset, stored_len, raw_len, num_tokens, payload_crc, codec, key_len = _ENTRY.unpack_from(data, at)
        key_at = at + INDEX_ENTRY_FIXED_LEN
        if len(data) < key_at + key_len:
            raise FormatProblem(f"index entry {i} key is cut off")
        if codec >= len(CODECS):
            raise FormatProblem(f"index entry {i}: unknown codec id {codec}")
        try:
            key = bytes(data[key_at : key_at + key_len]).decode("utf-8")
        except UnicodeDecodeError:
            raise FormatProblem(f"index entry {i} key is not UTF-8") from None
        entries.append(RawEntry(frame_offset, stored_len, raw_len, num_tokens, payload_crc, codec, key))
        at += align8(INDEX_ENTRY_FIXED_LEN + key_len)
    if at != len(data):
        raise FormatProblem(f"index has {len(data) - at} bytes after its last entry")
    return entries


# ---------------------------------------------------------------------------------------------
# Trailer


class Trailer(NamedTuple):
    index_offset: int
    record_count: int
    lost_in_recovery: int
    """Damaged parts (corrupt records, damaged regions) that recovery left out of the index; 0
    in a shard its writer completed."""


def encode_trailer(index_offset: int, record_count: int, lost_in_recovery: int = 0) -> bytes:
    head = _TRAILER.pack(index_offset, record_count, lost_in_recovery)
    return head + crc32c(head[:20]).to_bytes(4, "little") + TRAILER_MAGIC


def decode_trailer(data) -> Trailer | None:
    if len(data) != TRAILER_LEN or data[24:32] != TRAILER_MAGIC:
        return None
    if crc32c(data[:20]) != int.from_bytes(data[20:24], "little"):
        return None
    return Trailer(*_TRAILER.unpack_from(data, 0))


def encode_footer(entries: list[RawEntry], data_end: int, lost_in_recovery: int = 0) -> bytes:
    """What closes a shard whose record frames end at ``data_end``: index frame and trailer.
    ``lost_in_recovery``: what recovery left out of the index (writers leave it 0)."""
    payload = encode_index(entries)
    header = encode_frame_header(KIND_INDEX, 0, b"", len(payload), len(payload), 0, crc32c(payload))
    pad = bytes(align8(len(payload)) - len(payload))
    return header + payload + pad + encode_trailer(data_end, len(entries), lost_in_recovery)
