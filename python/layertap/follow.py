"""Reading a dataset while it is written: ``layertap.follow`` (docs/API.md, "Following a dataset
while it is written"), and ``DatasetTail``, what it and ``layertap.vllm.fetch`` are built on.

A shard that is complete when it is first seen is read by the readers' shard backend. A shard
still being written is read incrementally: each look reads only the frame headers written since
the previous one, and a record's payload is read, decoded and checked (``_decoder``) once it is
wanted. A record whose payload does not match its checksum yet, in a shard a live writer holds
(writes may land out of order), is waited for. Once a writer has left a shard for good (its lock
is free and a newer shard of the same writer exists, or the shard ended with an index), damage
that the incremental reading cannot pass is handed to the shard backend, which resynchronises.

Waiting uses inotify on the directory (``DirectoryWatch``, over the ``inotify_simple`` package);
nothing polls. Linux only, and only for changes this kernel sees (a local file system; NFS does not
report writes made on another machine).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from inotify_simple import INotify
from inotify_simple import flags as _in

from layertap._checks import one_of
from layertap._choices import ERROR_MODES
from layertap._cursor import ShardCursor, pread_fully
from layertap._decoder import RecordDecoder, record_decoder
from layertap._spec.format import (
    CODECS,
    KIND_INDEX,
    TRAILER_LEN,
    FormatProblem,
    Truncated,
    decode_trailer,
    frame_header_len,
    writer_and_index,
)
from layertap._spec.lock import is_locked
from layertap._tensors import tensor_maker
from layertap._types import ClosedOnExit, IndexEntry, Problem, ProblemKind
from layertap.errors import (
    CorruptRecordError,
    FormatError,
    InvalidInputError,
    StoreUnavailableError,
)
from layertap.reader import Record, backend_class, record_problem


class DirectoryWatch:
    """An inotify watch on one directory: ``wait`` returns when a file in it changed. Made
    before the first look at the files, so that a change between the look and the wait is
    still seen.

    A directory watch names a changed file by the name it was opened under, and the writers
    create each shard unnamed (``O_TMPFILE``, or a temporary name) and link it under its final
    name once its header is in: their writes are reported as ``#<inode>`` or the temporary name.
    So the files being followed are also watched themselves (``watch_file``: a watch on the
    inode, whatever name the writer opened it by), and their changes reported by their names."""

    _MASK = _in.MODIFY | _in.ATTRIB | _in.CLOSE_WRITE | _in.MOVED_TO | _in.CREATE
    _FILE_MASK = _in.MODIFY | _in.ATTRIB | _in.CLOSE_WRITE

    def __init__(self, directory: str):
        self._inotify = INotify()
        try:
            self._inotify.add_watch(directory, self._MASK)
        except OSError as e:
            self._inotify.close()
            raise OSError(e.errno, f"cannot watch the dataset directory: {e.strerror}", directory) from None
        self._files: dict[int, str] = {}
        """Watch descriptor of each watched file -> its name in the directory."""

    def watch_file(self, path: str) -> None:
        """Watches the file at ``path`` itself; best effort: a file that is gone, or a watch the
        kernel refuses (``max_user_watches``), is left to the directory's watch."""
        try:
            self._files[self._inotify.add_watch(path, self._FILE_MASK)] = os.path.basename(path)
        except OSError:
            pass

    def wait(self, timeout: float | None, concerns: Callable[[str], bool]) -> None:
        """Blocks until a file whose name ``concerns`` accepts changed (or events were lost), or
        for ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000) + 1)
            events = self._inotify.read(timeout=ms)
            if not events:
                return
            for e in events:
                if e.mask & _in.Q_OVERFLOW or concerns(self._files.get(e.wd, e.name)):
                    return

    def close(self) -> None:
        self._inotify.close()


class NotYet(Exception):
    """The record's frame is there but its payload is not all written yet."""


class ShardTail:
    """What has been found so far of one shard: ``entries`` (records in file order), and how
    to read each."""

    def __init__(self, path: str, writer_id: str, index: int, backend: type, decode: RecordDecoder | None = None):
        self.path = path
        self.writer_id = writer_id
        self.index = index
        self.entries: list[IndexEntry] = []
        self.done = False
        """Nothing more will be found in this shard."""
        self.consumed = 0
        """Records ``follow`` has handed out (or skipped)."""
        self._backend_class = backend
        self._decode = decode or record_decoder()
        self._backend: Any = None
        self._from_backend: list[int | None] = []  # per entry: its position in the backend, or None (a frame)
        self._corrupt: dict[int, str] = {}  # entry -> why the backend found it corrupt
        self._keys: dict[str, int] = {}
        self._fd = -1
        self._cursor = ShardCursor(self._pread)  # the next frame header to read

    # -- finding records ----------------------------------------------------------------------

    def refresh(self, superseded: bool) -> None:
        """Finds the records written since the last call. ``superseded``: a newer shard of the
        same writer exists (so the writer will not come back to this one)."""
        if self.done:
            return
        if self._fd < 0:
            try:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                self.done = True  # removed meanwhile
                return
            if self._has_trailer():
                self._take_from_backend(0)  # complete when first seen: its index says everything
                return
        size = os.fstat(self._fd).st_size
        if not self._cursor.find_start(size):
            if superseded and not is_locked(self.path):
                self._take_from_backend(0)  # left without a header (or not a shard)
            return
        while True:
            try:
                h = self._cursor.peek(size)
            except Truncated:
                # Nothing more yet (or the frame being written). A writer that left for good
                # leaves only a torn tail here.
                if superseded and not is_locked(self.path):
                    self._finish()
                return
            except FormatProblem:
                # Not written yet (writes may land out of order), or damage.
                if not is_locked(self.path) and (superseded or self._has_trailer()):
                    self._take_from_backend(self._cursor.pos or 0)
                return
            if h.kind == KIND_INDEX:
                self._finish()
                return
            pos = self._cursor.step(h)
            self._add(IndexEntry(h.key, pos, h.stored_len, h.raw_len, h.num_tokens, CODECS[h.codec], h.payload_crc))

    def _add(self, entry: IndexEntry, at_backend: int | None = None, corrupt: str | None = None) -> None:
        if corrupt is not None:
            self._corrupt[len(self.entries)] = corrupt
        else:
            self._keys.setdefault(entry.key, len(self.entries))
        self.entries.append(entry)
        self._from_backend.append(at_backend)

    def _has_trailer(self) -> bool:
        size = os.fstat(self._fd).st_size
        return size >= TRAILER_LEN and decode_trailer(self._pread(size - TRAILER_LEN, TRAILER_LEN)) is not None

    def _take_from_backend(self, start: int) -> None:
        """Takes the records from offset ``start`` on as the shard backend finds them (index, or
        a scan that resynchronises past damage); nothing more comes after."""
        try:
            backend = self._backend_class(self.path)
        except (FormatError, FileNotFoundError):
            self._finish()  # not a shard (``layertap.open`` lists it as such)
            return
        found: list[tuple[int, IndexEntry, int | None, str | None]] = [
            (e.frame_offset, e, i, None) for i, e in enumerate(backend.entries) if e.frame_offset >= start
        ]
        for p in backend.scan_problems:
            if p.kind == ProblemKind.CORRUPT_RECORD and p.offset is not None and p.offset >= start:
                found.append((p.offset, IndexEntry(p.key or "", p.offset, 0, 0, 0, "none", 0), None, p.message))
        for _, entry, at, corrupt in sorted(found, key=lambda f: f[0]):
            self._add(entry, at, corrupt)
        # Closed until a record is read: a fetch may look through many shards for one key.
        backend.close()
        self._finish()

    def _finish(self) -> None:
        self.done = True
        self._close_file()

    def _close_file(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def position(self, key: str) -> int | None:
        """The first readable entry with ``key``, if found so far."""
        return self._keys.get(key)

    # -- reading ------------------------------------------------------------------------------

    def read(self, i: int, make) -> Record:
        """Record ``i``, its tensors made by ``make``. Raises NotYet while its payload is being
        written, CorruptRecordError when it is damaged."""
        e = self.entries[i]
        if i in self._corrupt:  # the readers' words, so that messages do not depend on who found it
            raise CorruptRecordError.at(self.path, e.frame_offset, e.key, self._corrupt[i])
        at = self._from_backend[i]
        if at is not None:
            if self._backend is None:
                self._backend = self._backend_class(self.path)
            metadata, tensors = self._backend.read(at)
            return Record.from_parts(e, self.path, metadata, tensors, make)
        try:
            metadata, tensors = self._decode.read(
                self.path,
                e.frame_offset + frame_header_len(len(e.key.encode("utf-8"))),
                key=e.key,
                codec=CODECS.index(e.codec),
                raw_len=e.raw_len,
                stored_len=e.stored_len,
                payload_crc=e.payload_crc,
                offset=e.frame_offset,
                fd=self._fd if self._fd >= 0 else None,
            )
        except CorruptRecordError:
            if is_locked(self.path):
                raise NotYet from None
            raise
        return Record.from_parts(e, self.path, metadata, tensors, make)

    def _pread(self, offset: int, n: int) -> bytes:
        return pread_fully(self._fd, offset, n)

    def close(self) -> None:
        """Releases the file and the backend; entries found stay."""
        self._close_file()
        if self._backend is not None:
            self._backend.close()
            self._backend = None

    __del__ = close


class DatasetTail(ClosedOnExit):
    """The shards of a dataset directory (of one writer, if ``writer_id`` is given) as they
    appear, each a ``ShardTail``; ``wait`` blocks until one of them changes. Close it (or use
    it as a context manager) to release the files.

    A shard whose records were all handed out is dropped (``forget``): a tail that runs as long
    as a served engine (the Mooncake forwarder's) or a trainer's ``follow`` would otherwise keep
    every shard's entries, about 300 bytes a record. Only its name stays, while its file is
    there, so that it is not picked up again."""

    def __init__(self, directory: str | os.PathLike, *, writer_id: str | None = None, backend: str = "auto"):
        self.directory = os.fspath(directory)
        self.writer_id = writer_id
        self._backend_class = backend_class(backend)
        self._decode = record_decoder(backend)
        if not os.path.isdir(self.directory) and os.path.exists(self.directory):
            raise InvalidInputError(f"{self.directory}: not a directory; follow reads a dataset directory")
        if not os.path.isdir(self.directory):
            raise FileNotFoundError(
                errno.ENOENT, "cannot watch the dataset directory: No such file or directory", self.directory
            )
        # The watch is made at the first wait, not here: a look that finds what it wants (a
        # fetch of a record already written) never pays for one (closing an inotify descriptor
        # costs milliseconds). ``wait`` then returns at once, so that the caller looks again
        # with the watch in place: a change between its last look and the watch is still seen.
        self._watch: DirectoryWatch | None = None
        self._shards: dict[str, ShardTail] = {}
        self._forgotten: set[str] = set()  # names of shards dropped by ``forget`` whose files are there
        self._newest: dict[str, int] = {}  # writer id -> highest shard index seen

    def concerns(self, name: str) -> bool:
        """Whether a file name is one of the shards this tail reads."""
        parsed = writer_and_index(name)
        return parsed is not None and (self.writer_id is None or parsed[0] == self.writer_id)

    def shards(self) -> list[ShardTail]:
        """Every shard found so far and not forgotten, in file-name order."""
        still_there: set[str] = set()
        with os.scandir(self.directory) as it:
            for entry in it:
                if entry.name in self._forgotten:
                    still_there.add(entry.name)
                    continue
                if entry.name in self._shards or not self.concerns(entry.name):
                    continue
                writer_id, index = writer_and_index(entry.name)
                self._shards[entry.name] = ShardTail(entry.path, writer_id, index, self._backend_class, self._decode)
                if self._watch is not None:
                    self._watch.watch_file(entry.path)
                self._newest[writer_id] = max(index, self._newest.get(writer_id, -1))
        # A name whose file is gone (the forwarder removes what it forwarded) is not kept: a
        # file that appears under it later is a new shard.
        self._forgotten = still_there
        return [self._shards[name] for name in sorted(self._shards, key=os.fsencode)]

    def forget(self, shard: ShardTail) -> None:
        """Drops ``shard`` (``done``, its records all handed out); ``shards`` does not list it again."""
        shard.close()
        name = os.path.basename(shard.path)
        if self._shards.pop(name, None) is not None:
            self._forgotten.add(name)

    def refresh(self, shard: ShardTail) -> None:
        shard.refresh(superseded=shard.index < self._newest[shard.writer_id])

    def find(self, key: str, make) -> Record | None:
        """The record with ``key`` (newest shards first, where a record just written is), or
        None while it is not (all) written."""
        for shard in reversed(self.shards()):
            self.refresh(shard)
            i = shard.position(key)
            if i is not None:
                try:
                    return shard.read(i, make)
                except NotYet:
                    return None
        return None

    def wait(self, timeout: float | None, also: str | None = None) -> None:
        """Blocks until one of the shards (or the file ``also``) changed, or for ``timeout``
        seconds; at once the first time (see ``__init__``)."""
        if self._watch is None:
            self._watch = DirectoryWatch(self.directory)
            for shard in self._shards.values():
                self._watch.watch_file(shard.path)
            return
        self._watch.wait(timeout, lambda name: name == also or self.concerns(name))

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        for shard in self._shards.values():
            shard.close()


class _Following(ClosedOnExit):
    """What both followers share: the iterator over ``_run``, the idle timeout, the records
    skipped with ``errors="skip"``, and closing."""

    def __init__(self, timeout: float | None, make, skip: bool):
        self._timeout = timeout
        self._make = make
        self._skip = skip
        self.skipped = 0
        self.problems: list[Problem] = []
        self._records = self._run()

    def _run(self) -> Iterator[Record]:
        raise NotImplementedError

    def _skip_or_raise(self, err: CorruptRecordError, path: str, offset: int, key: str | None) -> None:
        """Counts a damaged record with ``errors="skip"``, else raises its error."""
        if not self._skip:
            raise err
        self.skipped += 1
        self.problems.append(record_problem(err, path, offset, key))

    def _time_left(self, idle_since: float) -> float | None:
        """Seconds until the idle timeout ends the iteration (None: no timeout)."""
        return None if self._timeout is None else self._timeout - (time.monotonic() - idle_since)

    def __iter__(self):
        return self

    def __next__(self) -> Record:
        return next(self._records)

    def close(self) -> None:
        """Stops following and releases what it holds (idempotent)."""
        self._records.close()


class Follow(_Following):
    """The records of a dataset as they are written (``layertap.follow``): an iterator, and a
    context manager that releases the files. ``skipped`` counts the corrupt records left out
    with ``errors="skip"``, ``problems`` lists them."""

    def __init__(self, tail: DatasetTail, timeout: float | None, make, skip: bool):
        self._tail = tail
        super().__init__(timeout, make, skip)

    def _run(self) -> Iterator[Record]:
        idle_since = time.monotonic()
        while True:
            for shard in self._tail.shards():
                self._tail.refresh(shard)
                while shard.consumed < len(shard.entries):
                    try:
                        record = shard.read(shard.consumed, self._make)
                    except NotYet:
                        break
                    except CorruptRecordError as err:
                        e = shard.entries[shard.consumed]
                        self._skip_or_raise(err, shard.path, e.frame_offset, e.key or None)
                        shard.consumed += 1
                        continue
                    shard.consumed += 1
                    yield record
                    idle_since = time.monotonic()
                if shard.done and shard.consumed == len(shard.entries):
                    self._tail.forget(shard)
            left = self._time_left(idle_since)
            if left is not None and left <= 0:
                return
            self._tail.wait(left)

    def close(self) -> None:
        super().close()
        self._tail.close()

    def __repr__(self) -> str:
        return f"Follow({self._tail.directory!r}, skipped {self.skipped})"


class StoreFollow(_Following):
    """``follow`` of a dataset in Mooncake Store (docs/MOONCAKE.md): the store tells no one when
    objects appear, so the writers' heads and index chunks are looked at again every
    ``STORE_POLL`` seconds; records are read and checked as ``layertap.open`` reads them. A
    record the index lists and the store does not hold raises ``RecordMissingError`` (a
    ``CorruptRecordError``: ``errors="skip"`` counts it).

    A writer's records are counted by their position in its index, so each look lists them up
    to its first index chunk that cannot be read, and a look during which the store cannot be
    read ends there and is made again at the next poll: a record is handed out once, in order,
    whatever failed meanwhile. A store that stays unreadable for ``STORE_GRACE`` seconds (or at
    the end of the idle timeout) raises ``StoreUnavailableError``."""

    STORE_POLL = 0.2
    STORE_GRACE = 10.0

    def __init__(self, path: str, timeout: float | None, make, skip: bool, backend: str = "auto"):
        self._path = path
        self._backend = backend
        super().__init__(timeout, make, skip)

    def _run(self) -> Iterator[Record]:
        consumed: dict[str, int] = {}  # writer path -> records handed out (or skipped)
        idle_since = time.monotonic()
        failing_since: float | None = None
        while True:
            try:
                for record in self._look(consumed):
                    yield record
                    idle_since = time.monotonic()
                failing_since = None
            except StoreUnavailableError:
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                left = self._time_left(idle_since)
                # Ending quietly at the idle timeout would read as "no more records".
                if now - failing_since >= self.STORE_GRACE or (left is not None and left <= 0):
                    raise
            left = self._time_left(idle_since)
            if left is not None and left <= 0:
                return
            time.sleep(self.STORE_POLL if left is None else min(self.STORE_POLL, left))

    def _look(self, consumed: dict[str, int]) -> Iterator[Record]:
        """The records listed since the last look."""
        from layertap.mooncake.backend import open_address

        _, shards, _ = open_address(self._path, until_gap=True, backend=self._backend)
        for shard in shards:
            while (i := consumed.get(shard.path, 0)) < len(shard.entries):
                e = shard.entries[i]
                try:
                    metadata, tensors = shard.read(i)  # StoreUnavailableError: read again next look
                except CorruptRecordError as err:
                    consumed[shard.path] = i + 1
                    self._skip_or_raise(err, shard.path, i, e.key)
                    continue
                consumed[shard.path] = i + 1
                yield Record.from_parts(e, shard.path, metadata, tensors, self._make)

    def __repr__(self) -> str:
        return f"StoreFollow({self._path!r}, skipped {self.skipped})"


def follow(
    path: str | os.PathLike,
    *,
    timeout: float | None = None,
    writer_id: str | None = None,
    errors: str = "raise",
    backend: str = "auto",
    tensors: str = "auto",
) -> Follow | StoreFollow:
    """The records of the dataset directory ``path``, each once, as soon as it is written and
    checked: records already there first, then new ones as writers add them (shards in
    file-name order, records in file order). For a trainer that consumes a dataset while it is
    generated.

    ``timeout``: the iteration ends once no new record has come for this many seconds (None:
    it waits for more until the caller stops). ``writer_id``: only that writer's shards.
    ``errors``: ``"raise"`` raises ``CorruptRecordError`` at a damaged record, ``"skip"`` leaves
    it out and counts it in ``skipped``. ``backend`` and ``tensors`` as for ``layertap.open``.
    ``path`` may be a dataset in Mooncake Store (``mooncake://...``, ``StoreFollow``). Raises
    FileNotFoundError if the directory does not exist."""
    one_of("errors", errors, ERROR_MODES)
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout >= 0):
        raise InvalidInputError(f"timeout must be a number of seconds >= 0 or None, not {timeout!r}")
    make = tensor_maker(tensors)
    if isinstance(path, str) and path.startswith("mooncake://"):
        if writer_id is not None:
            raise InvalidInputError("writer_id is for a dataset directory; a store dataset is followed whole")
        record_decoder(backend)  # a bad value fails before the store is asked
        return StoreFollow(path, timeout, make, errors == "skip", backend)
    return Follow(DatasetTail(path, writer_id=writer_id, backend=backend), timeout, make, errors == "skip")


__all__ = ["DatasetTail", "Follow", "ShardTail", "StoreFollow", "follow"]
