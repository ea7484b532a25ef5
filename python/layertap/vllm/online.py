"""Online use: the record of a finished request, read as soon as its writer has written it.

``fetch(response.kv_transfer_params)`` waits without polling: it watches the dataset directory
with inotify (through ctypes, no extra package) and looks at the writer's shards again only when
one of them changed. Each look reads frame headers from where the previous look stopped, so a
fetch costs the headers written while it waits, not the size of the shard. This module does not
import vLLM.

Requirements: Linux, and the dataset directory on a file system that reports changes made by
the server to this process (a local file system; NFS does not report remote writes).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from layertap._py.blob import parse_header
from layertap._py.codecs import decode
from layertap._py.format import (
    FILE_HEADER_FIXED_LEN,
    FRAME_HEADER_LEN,
    KIND_INDEX,
    MAX_META_LEN,
    TRAILER_LEN,
    TRAILER_MAGIC,
    FormatProblem,
    crc32c,
    decode_file_header,
    decode_frame_header,
    key_problem,
    parse_shard_index,
    writer_id_problem,
)
from layertap._py.reader import is_locked
from layertap._tensors import to_torch
from layertap.errors import CorruptRecordError, InvalidInputError, LayertapError

#: The entry of a response's kv_transfer_params that the connector fills.
PARAMS_KEY = "layertap"


def error_marker_path(dataset: str, writer_id: str) -> str:
    """Where a worker whose writer failed leaves the error, for waiting ``fetch`` calls."""
    return os.path.join(dataset, f"{writer_id}.error")


@dataclass(frozen=True)
class RecordLocation:
    """Where the connector writes a request's record."""

    dataset: str
    """The dataset directory (absolute, as the server sees it)."""
    writer_id: str
    """The id of the engine's writer: its shards are ``{writer_id}-{n:06}.lts``."""
    key: str
    num_tokens: int | None = None


def record_location(kv_transfer_params: Mapping[str, Any] | None) -> RecordLocation:
    """Reads a response's ``kv_transfer_params`` (or its ``"layertap"`` entry). Raises
    ``InvalidInputError`` when the server refused the request (a bad ``sample_id``...) and
    ``LayertapError`` when it did not save it for another reason, with the server's message."""
    if kv_transfer_params is None:
        raise InvalidInputError(
            "the response has no kv_transfer_params: the server does not run the layertap connector, "
            "or the request did not finish normally (aborted requests are not saved)"
        )
    if not isinstance(kv_transfer_params, Mapping):
        raise InvalidInputError(f"kv_transfer_params must be a mapping, got {type(kv_transfer_params).__name__}")
    entry = kv_transfer_params.get(PARAMS_KEY, kv_transfer_params)
    if not isinstance(entry, Mapping):
        raise InvalidInputError(f"kv_transfer_params[{PARAMS_KEY!r}] must be a mapping, got {entry!r}")
    if "error" in entry:
        cls = InvalidInputError if entry.get("reason") == "invalid_request" else LayertapError
        raise cls(f"the server did not save this request's hidden states: {entry['error']}")
    try:
        dataset, writer_id, key = entry["dataset"], entry["writer_id"], entry["key"]
    except KeyError as e:
        raise InvalidInputError(
            f"kv_transfer_params has no {e.args[0]!r}: not a layertap record location ({dict(entry)!r})"
        ) from None
    if not isinstance(dataset, str) or not os.path.isabs(dataset):
        raise InvalidInputError(f"dataset {dataset!r} is not an absolute path")
    for problem in (writer_id_problem(writer_id), key_problem(key)):
        if problem:
            raise InvalidInputError(problem)
    num_tokens = entry.get("num_tokens")
    return RecordLocation(dataset, writer_id, key, num_tokens if isinstance(num_tokens, int) else None)


def fetch(
    kv_transfer_params: Mapping[str, Any] | RecordLocation,
    timeout: float | None = None,
    durable: bool = True,
):
    """The ``layertap.Record`` of a finished request, once its writer has written it.

    ``kv_transfer_params``: the response's (``output.kv_transfer_params`` offline,
    ``response["kv_transfer_params"]`` over HTTP), or a ``RecordLocation``. Waits up to
    ``timeout`` seconds (None: without limit) and raises ``TimeoutError`` past it. The record is
    found as soon as its bytes are in the shard and match their checksum (readable by any
    reader); with ``durable`` (the default) the shard is then fsynced before returning, so the
    record is on stable storage whatever the connector's ``durability`` option (``durable=False``
    skips that, for callers that only need the tensors). Raises ``LayertapError`` if the
    server's writer failed."""
    loc = kv_transfer_params if isinstance(kv_transfer_params, RecordLocation) else record_location(kv_transfer_params)
    deadline = None if timeout is None else time.monotonic() + timeout
    # Watch first, then look: a change between the two is still seen.
    with _DirectoryWatch(loc.dataset) as watch:
        finder = _Finder(loc)
        try:
            while True:
                record = finder.look()
                if record is not None:
                    if durable:
                        _fsync(record.shard)
                    return record
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"record {loc.key!r} of writer {loc.writer_id} did not appear in {loc.dataset} "
                        f"within {timeout} s"
                    )
                watch.wait(remaining, finder.concerns)
        finally:
            finder.close()


def _fsync(path: str) -> None:
    """Flushes a shard to stable storage (what its writer wrote so far): fsync works on a
    read-only descriptor, so a client can make a record durable without the server's help."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# inotify

_IN_MODIFY, _IN_ATTRIB, _IN_CLOSE_WRITE = 0x002, 0x004, 0x008
_IN_MOVED_TO, _IN_CREATE, _IN_Q_OVERFLOW = 0x080, 0x100, 0x4000
_IN_NONBLOCK, _IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
_EVENT = struct.Struct("iIII")
_libc_handle = None


def _libc():
    global _libc_handle
    if _libc_handle is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.inotify_init1.argtypes = [ctypes.c_int]
        lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        _libc_handle = lib
    return _libc_handle


class _DirectoryWatch:
    """An inotify watch on one directory: ``wait`` returns when a file in it changed."""

    _MASK = _IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE

    def __init__(self, directory: str):
        lib = _libc()
        fd = lib.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        if lib.inotify_add_watch(fd, os.fsencode(directory), self._MASK) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"cannot watch the dataset directory: {os.strerror(err)}", directory)
        self._fd = fd
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def wait(self, timeout: float | None, concerns: Callable[[str], bool]) -> None:
        """Blocks until a file that ``concerns`` accepts changed (or events were lost), or for
        ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000) + 1)
            if not self._poll.poll(ms):
                return
            for mask, name in self._events():
                if mask & _IN_Q_OVERFLOW or concerns(name):
                    return

    def _events(self) -> list[tuple[int, str]]:
        out = []
        while True:
            try:
                buf = os.read(self._fd, 64 << 10)
            except BlockingIOError:
                return out
            at = 0
            while at + _EVENT.size <= len(buf):
                _, mask, _, length = _EVENT.unpack_from(buf, at)
                name = buf[at + _EVENT.size : at + _EVENT.size + length].split(b"\0", 1)[0]
                out.append((mask, os.fsdecode(name)))
                at += _EVENT.size + length

    def __enter__(self) -> _DirectoryWatch:
        return self

    def __exit__(self, *exc) -> None:
        os.close(self._fd)


# ---------------------------------------------------------------------------------------------
# Looking through one writer's shards


class _Cursor:
    """How far the frames of one shard have been read."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.file_bytes = 0
        self.pos: int | None = None
        """Offset of the next frame to read; None until the file header is there."""
        self.done = False

    def pread(self, offset: int, n: int) -> bytes:
        parts = []
        while n > 0:
            chunk = os.pread(self.fd, n, offset)
            if not chunk:
                break
            parts.append(chunk)
            offset += len(chunk)
            n -= len(chunk)
        return b"".join(parts)

    def close(self) -> None:
        os.close(self.fd)


class _Finder:
    """Looks for one key among one writer's shards, remembering how far each was read."""

    def __init__(self, loc: RecordLocation):
        self.loc = loc
        self._marker = os.path.basename(error_marker_path(loc.dataset, loc.writer_id))
        self._cursors: dict[str, _Cursor] = {}

    def concerns(self, name: str) -> bool:
        return name == self._marker or parse_shard_index(name, self.loc.writer_id) is not None

    def close(self) -> None:
        for cursor in self._cursors.values():
            cursor.close()

    def _shards(self) -> list[str]:
        """The writer's shard names, newest first (where a record just written is)."""
        found = []
        with os.scandir(self.loc.dataset) as it:
            for entry in it:
                index = parse_shard_index(entry.name, self.loc.writer_id)
                if index is not None:
                    found.append((index, entry.name))
        return [name for _, name in sorted(found, reverse=True)]

    def look(self):
        marker = os.path.join(self.loc.dataset, self._marker)
        if os.path.exists(marker):
            with open(marker) as f:
                raise LayertapError(f"writer {self.loc.writer_id} failed and writes no more: {f.read().strip()}")
        shards = self._shards()
        for n, name in enumerate(shards):
            cursor = self._cursors.get(name)
            if cursor is None:
                try:
                    cursor = self._cursors[name] = _Cursor(os.path.join(self.loc.dataset, name))
                except FileNotFoundError:
                    continue
            if not cursor.done:
                record = self._look_in(cursor, superseded=n > 0)
                if record is not None:
                    return record
        return None

    def _look_in(self, cursor: _Cursor, superseded: bool):
        cursor.file_bytes = os.fstat(cursor.fd).st_size
        if cursor.pos is None:
            head = cursor.pread(0, min(cursor.file_bytes, FILE_HEADER_FIXED_LEN + 4 + MAX_META_LEN))
            try:
                cursor.pos = decode_file_header(head, cursor.file_bytes).header_len
            except FormatProblem:
                return None  # the writer has not written the header yet
        if cursor.file_bytes >= cursor.pos + TRAILER_LEN and (
            cursor.pread(cursor.file_bytes - TRAILER_LEN, TRAILER_LEN)[-8:] == TRAILER_MAGIC
        ):
            return self._read_finished(cursor)  # complete: its index says where the key is
        key = self.loc.key
        while True:
            pos = cursor.pos
            head = cursor.pread(pos, FRAME_HEADER_LEN)
            if len(head) == FRAME_HEADER_LEN:
                head += cursor.pread(pos + FRAME_HEADER_LEN, int.from_bytes(head[6:8], "little"))
            try:
                frame = decode_frame_header(head, cursor.file_bytes - pos)
            except FormatProblem:
                # Not written yet, or, in a shard its writer left, damage: the full reader
                # resynchronises past it.
                if superseded and not is_locked(cursor.path):
                    return self._read_finished(cursor)
                return None
            if frame.kind == KIND_INDEX:
                return self._read_finished(cursor)
            if frame.key == key:
                return self._read_record(cursor, pos, frame)
            cursor.pos = pos + frame.frame_len

    def _read_finished(self, cursor: _Cursor):
        """Looks the key up in a shard nobody writes any more, with the dataset reader."""
        from layertap.reader import open as open_dataset

        cursor.done = True
        with open_dataset(cursor.path) as ds:
            return ds.get(self.loc.key)

    def _read_record(self, cursor: _Cursor, pos: int, frame):
        """The record whose frame is at ``pos``; None while its payload is still being written."""
        from layertap.reader import Record

        stored = cursor.pread(pos + frame.header_len, frame.stored_len)
        if len(stored) < frame.stored_len or crc32c(stored) != frame.payload_crc:
            if is_locked(cursor.path):
                return None
            raise CorruptRecordError(
                f"{cursor.path}: corrupt record at offset {pos} (key {frame.key!r}): payload does "
                "not match its checksum",
                cursor.path, pos, frame.key,
            )
        try:
            raw = decode(frame.codec, bytearray(stored), frame.raw_len)
            metadata, tensors, _ = parse_header(raw)
        except FormatProblem as e:
            raise CorruptRecordError(
                f"{cursor.path}: corrupt record at offset {pos} (key {frame.key!r}): {e}", cursor.path, pos, frame.key
            ) from None
        if metadata.get("key") != frame.key:
            raise CorruptRecordError(
                f"{cursor.path}: record at offset {pos}: __metadata__ key differs from the frame key",
                cursor.path, pos, frame.key,
            )
        view = memoryview(raw).cast("B")
        return Record(
            frame.key,
            {t.name: to_torch(view[t.begin : t.end], t.dtype, t.shape) for t in tensors},
            metadata,
            cursor.path,
            pos,
            frame.num_tokens,
        )


__all__ = ["RecordLocation", "error_marker_path", "fetch", "record_location"]
