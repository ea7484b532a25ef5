"""Reading datasets: ``layertap.open`` returns a ``Dataset`` of ``Record``s (docs/API.md,
"Reading"); ``layertap.follow`` (``follow.py``) reads one while it is written.

A dataset is a list of shards, each read by a *shard backend*: ``RustShardReader`` (memory-mapped,
``layertap._rust_reader``) or ``PyShardReader`` (the pure-Python reference, ``layertap._py.reader``,
imported only when it is chosen or the extension is not built). Both follow the protocol
``layertap._types.ShardBackend``; ``backend_class`` picks one (``layertap._backends``).
"""

from __future__ import annotations

import bisect
import builtins
import itertools
import json
import operator
import os
import sys
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from layertap._backends import resolve_backend
from layertap._checks import one_of
from layertap._choices import ERROR_MODES
from layertap._spec.format import (
    FILE_HEADER_FIXED_LEN,
    MAX_META_LEN,
    SHARD_SUFFIX,
    TORN_EMPTY_REASON,
    align8,
    frame_header_len,
    is_torn_empty,
)
from layertap._spec.lock import is_locked
from layertap._spec.record import HIDDEN_STATES, LAYER_IDS, TOKEN_IDS
from layertap._tensors import tensor_maker
from layertap._types import ClosedOnExit, IndexEntry, Problem, ProblemKind, ShardBackend, ShardInfo, VerifyReport
from layertap.errors import CorruptRecordError, FormatError, RecordMissingError, RecordNotFoundError

if TYPE_CHECKING:
    from layertap.parts import Parts


def _rust_backend() -> type[ShardBackend]:
    from layertap._rust_reader import RustShardReader

    return RustShardReader


def _python_backend() -> type[ShardBackend]:
    from layertap._py.reader import PyShardReader

    return PyShardReader


def backend_class(backend: str) -> type[ShardBackend]:
    """The shard backend class ``backend`` names: ``"rust"``, ``"python"``, or ``"auto"`` (Rust
    when the extension is built)."""
    return resolve_backend("backend", backend, rust=_rust_backend, python=_python_backend)


class Record:
    """One record: its tensors (``torch.Tensor``s, or ``numpy.ndarray``s: see ``open``'s
    ``tensors``; in stored order), metadata and place."""

    __slots__ = ("key", "tensors", "metadata", "shard", "offset", "num_tokens")

    def __init__(self, key: str, tensors: dict, metadata: dict[str, str], shard: str, offset: int, num_tokens: int):
        self.key = key
        self.tensors = tensors
        self.metadata = metadata
        self.shard = shard
        """Path of the shard file."""
        self.offset = offset
        """Offset of the record's frame in the shard."""
        self.num_tokens = num_tokens

    @property
    def hidden_states(self):
        """The ``hidden_states`` tensor ``[tokens, layers, hidden]``, or None."""
        return self.tensors.get(HIDDEN_STATES)

    @property
    def token_ids(self):
        """The ``token_ids`` tensor ``[tokens]``, or None."""
        return self.tensors.get(TOKEN_IDS)

    @property
    def layer_ids(self) -> list[int] | None:
        """The layer ids of ``hidden_states``' second axis (metadata ``layer_ids``), or None."""
        text = self.metadata.get(LAYER_IDS)
        if text is None:
            return None
        try:
            ids = json.loads(text)
        except ValueError:
            raise FormatError(f"{self.shard}: record {self.key!r} has layer_ids {text!r}, not a JSON list") from None
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise FormatError(f"{self.shard}: record {self.key!r} has layer_ids {text!r}, not a list of integers")
        return ids

    def __getitem__(self, name: str):
        return self.tensors[name]

    @classmethod
    def from_parts(cls, entry: IndexEntry, shard: str, metadata: dict[str, str], tensors: list, make) -> Record:
        """A record from what a shard backend's ``read`` returns, its tensors made by ``make``."""
        return cls(
            entry.key,
            {name: make(buf, dtype, shape) for name, dtype, shape, buf in tensors},
            metadata,
            shard,
            entry.frame_offset,
            entry.num_tokens,
        )

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{name}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for name, t in self.tensors.items()
        )
        shard = os.path.basename(self.shard)
        return f"Record(key={self.key!r}, shard={shard!r}, offset={self.offset}, tokens={self.num_tokens}, tensors={{{parts}}})"


class _TornEmptyShard:
    """A shard file shorter than its header (docs/FORMAT.md, "File header"): a torn empty shard
    whose writer died before writing the header (``layertap recover`` removes it), or, while a
    live writer holds its lock, one whose header is not written yet. It has no records."""

    complete = False
    entries: list[IndexEntry] = []
    lost_in_recovery = 0

    def __init__(self, path: str, being_written: bool):
        self.path = path
        self.being_written = being_written
        self.meta: dict = {}
        self.file_bytes = os.path.getsize(path)
        self.torn_tail_bytes = self.file_bytes
        reason = "its header is not written yet" if being_written else TORN_EMPTY_REASON
        self.scan_problems = [Problem(path, 0, None, ProblemKind.TORN_TAIL, reason)]

    def read(self, i: int, verify: bool = True):
        raise IndexError(i)

    check = read

    def close(self) -> None:
        pass


def _headerless(path: str) -> _TornEmptyShard | None:
    """The stand-in for a torn empty shard, or one whose live writer may not have written the
    header yet; None for any other file."""
    if is_locked(path):
        return _TornEmptyShard(path, being_written=True)
    with builtins.open(path, "rb") as f:
        head = f.read(FILE_HEADER_FIXED_LEN + 4 + MAX_META_LEN)
    return _TornEmptyShard(path, being_written=False) if is_torn_empty(head) else None


def shard_paths(directory: str) -> list[str]:
    with os.scandir(directory) as it:
        names = [e.name for e in it if e.name.endswith(SHARD_SUFFIX) and e.is_file()]
    return [os.path.join(directory, n) for n in sorted(names, key=os.fsencode)]  # byte-wise order


class Dataset(ClosedOnExit):
    """The records of one shard or of every shard of a dataset directory, in dataset order
    (shards by file name, records in file order). Use ``layertap.open`` to make one."""

    def __init__(
        self,
        path: str,
        shards: list[ShardBackend],
        unreadable: list[Problem] | None = None,
        tensors: str = "auto",
        parts: Parts | None = None,
    ):
        self.path = path
        """The path the dataset was opened with (paths given in a list: joined by ``", "``)."""
        self._parts = parts
        self._make = tensor_maker(tensors)
        self._shards = shards
        self._unreadable = unreadable or []
        self._starts = [0, *itertools.accumulate(len(s.entries) for s in shards)]
        self._first: dict[str, int] = {}
        for pos, (_, e) in enumerate(self._entries()):
            self._first.setdefault(e.key, pos)

    def _entries(self) -> Iterator[tuple[Any, IndexEntry]]:
        for s in self._shards:
            for e in s.entries:
                yield s, e

    def _locate(self, pos: int) -> tuple[Any, int]:
        k = bisect.bisect_right(self._starts, pos) - 1
        return self._shards[k], pos - self._starts[k]

    def _record(self, pos: int) -> Record:
        shard, i = self._locate(pos)
        metadata, tensors = shard.read(i)
        return Record.from_parts(shard.entries[i], shard.path, metadata, tensors, self._make)

    # -- lookup -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._starts[-1]

    def keys(self) -> list[str]:
        """Every record's key, in dataset order."""
        return [e.key for _, e in self._entries()]

    def __getitem__(self, item: int | str) -> Record:
        """A record by position (negative counts from the end) or by key (the first record with
        it in dataset order)."""
        if isinstance(item, str):
            pos = self._first.get(item)
            if pos is None:
                raise RecordNotFoundError(f"no record with key {item!r} in {self.path}")
            return self._record(pos)
        try:
            pos = operator.index(item)
        except TypeError:
            raise TypeError(f"records are looked up by int position or str key, not {type(item).__name__}") from None
        n = len(self)
        if not -n <= pos < n:
            raise IndexError(f"record position {pos} is out of range for a dataset of {n} records")
        return self._record(pos % n)

    def get(self, key: str, default=None) -> Record | Any:
        pos = self._first.get(key)
        return default if pos is None else self._record(pos)

    def __contains__(self, key: object) -> bool:
        return key in self._first

    def __iter__(self) -> Iterator[Record]:
        return self.iter()

    def iter(self, errors: str = "raise") -> RecordIterator:
        """Every record, in dataset order. ``errors="raise"`` raises ``CorruptRecordError`` at
        the first corrupt record; ``errors="skip"`` leaves corrupt records out and counts them
        in the iterator's ``skipped`` (and lists them in its ``problems``)."""
        one_of("errors", errors, ERROR_MODES)
        return RecordIterator(self, errors == "skip")

    # -- summaries ----------------------------------------------------------------------------

    @property
    def shards(self) -> list[ShardInfo]:
        """One ``ShardInfo`` per shard, from the indexes (no payload is read)."""
        return [
            ShardInfo(
                path=s.path,
                complete=s.complete,
                records=len(s.entries),
                tokens=sum(e.num_tokens for e in s.entries),
                raw_bytes=sum(e.raw_len for e in s.entries),
                stored_bytes=sum(e.stored_len for e in s.entries),
                file_bytes=s.file_bytes,
                torn_tail_bytes=s.torn_tail_bytes,
                codecs=dict(Counter(e.codec for e in s.entries)),
                meta=s.meta,
                being_written=s.being_written,
                lost_in_recovery=s.lost_in_recovery,
            )
            for s in self._shards
        ]

    @property
    def unreadable(self) -> list[Problem]:
        """``.lts`` files of the directory that are not shards (kind ``not_a_shard``)."""
        return list(self._unreadable)

    @property
    def parts(self) -> list[str]:
        """The dataset's parts in dataset order: directories of shards or shard files (one for
        a plain directory or shard; several for a manifest or a list)."""
        return list(self._parts.paths) if self._parts is not None else [self.path]

    @property
    def manifest(self) -> str | None:
        """The manifest file that listed the parts, if the dataset was opened through one."""
        return self._parts.manifest if self._parts is not None else None

    def shard_name(self, shard_path: str) -> str:
        """A shard's name as listings show it: its file name, or its path relative to the
        manifest's directory (or the directory several parts share) in a dataset of parts."""
        root = self._parts.root if self._parts is not None else None
        if root is None:
            return os.path.basename(shard_path)
        rel = os.path.relpath(os.path.abspath(shard_path), root)
        return shard_path if rel.startswith("..") else rel

    @property
    def duplicates(self) -> list[Problem]:
        """A ``duplicate_key`` problem for each record whose key an earlier record (in dataset
        order) has: lookups, exports and ``HiddenStatesDataset`` use that first record. Read from
        the indexes, nothing is decoded."""
        first: dict[str, tuple[str, int]] = {}
        out = []
        for s, e in self._entries():
            path, offset = first.setdefault(e.key, (s.path, e.frame_offset))
            if (path, offset) != (s.path, e.frame_offset):
                why = f"key {e.key!r} was already used by the record at offset {offset} of {path}, "
                why += "which is the key's record"
                out.append(Problem(s.path, e.frame_offset, e.key, ProblemKind.DUPLICATE_KEY, why))
        return out

    @property
    def backends(self) -> list[ShardBackend]:
        """The shard backends (``RustShardReader`` or ``PyShardReader``), one per shard."""
        return list(self._shards)

    def verify(self, progress: bool = False, *, allow_duplicates: bool = False) -> VerifyReport:
        """Checks every record (frame header against the index, checksum, decoding, metadata
        key) and reports, besides corrupt records, what opening the shards found (damaged
        regions, torn tails, bad indexes, files that are not shards) and duplicate keys. A torn
        tail of a shard that a live writer holds is not a problem. What an earlier ``recover``
        left out of a shard's index is not a problem of the shard as it is now, but it is not
        forgotten either: ``report.notes`` has a ``lost_in_recovery`` entry for each such shard.

        Duplicate keys are problems, unless ``allow_duplicates``: then they are listed in the
        report's ``duplicates`` instead (the first record of each key in dataset order is the
        one that counts; the others are still checked)."""
        report = VerifyReport()
        report.problems += self._unreadable
        report.notes += [_lost_note(s) for s in self._shards if s.lost_in_recovery]
        report.lost_in_recovery = sum(s.lost_in_recovery for s in self._shards)
        with progress_bar(progress, len(self), "verify") as bar:
            for s in self._shards:
                for p in s.scan_problems:
                    if p.kind == ProblemKind.TORN_TAIL and s.being_written:
                        continue
                    report.problems.append(p)
                    if p.kind == ProblemKind.CORRUPT_RECORD:
                        report.records_bad += 1
                for i, e in enumerate(s.entries):
                    try:
                        s.check(i)
                    except FormatError as err:
                        report.records_bad += 1
                        report.problems.append(record_problem(err, s.path, e.frame_offset, e.key))
                    else:
                        report.records_ok += 1
                    bar.update(1)
        if allow_duplicates:
            report.duplicates = self.duplicates
        else:
            report.problems += self.duplicates
        return report

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        for s in self._shards:
            s.close()

    def __repr__(self) -> str:
        return f"Dataset({self.path!r}, {len(self._shards)} shards, {len(self)} records)"


class RecordIterator:
    """Iterates over a dataset's records (``Dataset.iter``); with ``errors="skip"`` it goes on
    past corrupt records and says how many it left out."""

    def __init__(self, ds: Dataset, skip: bool):
        self._ds = ds
        self._skip = skip
        self._pos = 0
        self.skipped = 0
        """Corrupt records left out so far."""
        self.problems: list[Problem] = []
        """A problem for each record left out: ``corrupt_record``, or ``missing_record`` for one
        a store lost (as ``verify`` and ``follow`` name them)."""

    def __iter__(self) -> RecordIterator:
        return self

    def __next__(self) -> Record:
        while self._pos < len(self._ds):
            pos = self._pos
            self._pos += 1
            try:
                return self._ds._record(pos)
            except CorruptRecordError as err:
                if not self._skip:
                    raise
                shard, i = self._ds._locate(pos)
                e = shard.entries[i]
                self.skipped += 1
                self.problems.append(record_problem(err, shard.path, e.frame_offset, e.key))
        raise StopIteration

    def __repr__(self) -> str:
        return f"RecordIterator({self._ds.path!r}, at {self._pos} of {len(self._ds)}, skipped {self.skipped})"


def _lost_note(s) -> Problem:
    """The ``lost_in_recovery`` note of a shard whose trailer says recovery left parts out."""
    n = s.lost_in_recovery
    indexed = sum(frame_header_len(len(e.key.encode("utf-8"))) + align8(e.stored_len) for e in s.entries)
    unindexed = s.data_end - s.header_len - indexed
    return Problem(
        s.path,
        None,
        None,
        ProblemKind.LOST_IN_RECOVERY,
        f"an earlier `layertap recover` left {n} damaged part{'s' if n != 1 else ''} (corrupt records, damaged "
        f"regions) out of this shard's index; {unindexed} bytes of it are not indexed",
    )


def progress_bar(shown: bool, total: int, desc: str, initial: int = 0) -> Any:
    """A tqdm bar on stderr counting records (from ``initial``), or (not ``shown``) one that shows nothing."""
    from tqdm import tqdm

    return tqdm(
        total=total, initial=initial, unit="rec", desc=desc, file=sys.stderr, dynamic_ncols=True, disable=not shown
    )


def record_problem(err: Exception, path: str, offset: int | None, key: str | None) -> Problem:
    """The problem of a record that could not be read: ``missing_record`` where a store lost
    it, else ``corrupt_record``."""
    kind = ProblemKind.MISSING_RECORD if isinstance(err, RecordMissingError) else ProblemKind.CORRUPT_RECORD
    return Problem(path, offset, key, kind, problem_message(err, path))


def problem_message(err: Exception, path: str) -> str:
    """An error's message without what the Problem it goes into names anyway: the shard path
    and, for a corrupt record, its offset and key."""
    text = str(err)
    offset, key = getattr(err, "offset", None), getattr(err, "key", None)
    if key is not None:
        prefix = str(CorruptRecordError.at(path, offset, key, ""))  # the message's words, without a reason
        if text.startswith(prefix):
            return text[len(prefix) :]
    return text[len(path) + 2 :] if text.startswith(path + ": ") else text


def _open_shards(cls, paths: list[str], shards: list, unreadable: list[Problem]) -> None:
    for p in paths:
        try:
            shards.append(cls(p))
        except FormatError as e:
            torn = _headerless(p)
            if torn is not None:
                shards.append(torn)
            else:
                unreadable.append(Problem(p, None, None, ProblemKind.NOT_A_SHARD, problem_message(e, p)))


def open(path: str | os.PathLike | list | tuple, backend: str = "auto", *, tensors: str = "auto") -> Dataset:
    """Opens a shard file, a dataset directory (its ``*.lts`` files, by file name), a dataset in
    Mooncake Store (``mooncake://MASTER_HOST:PORT/PREFIX``, docs/MOONCAKE.md), or a dataset
    of several parts: a directory holding a manifest (``layertap-dataset.json``), a manifest
    file, or a list of any of these (docs/FORMAT.md, "Datasets of several parts"). The records
    are the parts' in the order listed.

    ``backend``: ``"rust"`` (memory-mapped), ``"python"`` (reference implementation) or
    ``"auto"`` (Rust when the native extension is built). ``tensors``: what records hold,
    ``"torch"`` tensors, ``"numpy"`` arrays (bfloat16 as ``ml_dtypes.bfloat16``), or ``"auto"``:
    torch where it is installed. Raises FileNotFoundError for a missing path (or part),
    FormatError for a file that is not a shard, a directory without shards or a bad manifest,
    InvalidInputError for a part given twice."""
    from layertap.parts import resolve

    cls = backend_class(backend)
    tensor_maker(tensors)  # a bad value fails before any file is opened
    if isinstance(path, str) and path.startswith("mooncake://"):
        from layertap.mooncake.backend import open_address

        address, store_shards, problems = open_address(path, backend=backend)
        return Dataset(address.dataset, store_shards, problems, tensors=tensors)
    parts = resolve(path)
    single = len(parts.paths) == 1 and parts.manifest is None
    if single and not os.path.isdir(parts.paths[0]):
        path = parts.paths[0]
        try:
            return Dataset(parts.name, [cls(path)], tensors=tensors, parts=parts)
        except FormatError:
            torn = _headerless(path)
            if torn is None:
                raise
            return Dataset(parts.name, [torn], tensors=tensors, parts=parts)
    shards: list = []
    unreadable: list[Problem] = []
    found = 0
    try:
        for part in parts.paths:
            paths = shard_paths(part) if os.path.isdir(part) else [part]
            found += len(paths)
            _open_shards(cls, paths, shards, unreadable)
    except BaseException:
        for s in shards:
            s.close()
        raise
    where = "this directory" if single else f"any of its {len(parts.paths)} parts"
    if not found:
        raise FormatError(f"{parts.name}: no shards (*{SHARD_SUFFIX} files) in {where}", parts.name)
    if not shards:
        first = unreadable[0]
        others = (
            f" (and {len(unreadable) - 1} more *{SHARD_SUFFIX} files that are not shards)"
            if len(unreadable) > 1
            else ""
        )
        raise FormatError(
            f"{parts.name}: no shards in {where}: {first.shard} is not a layertap shard: {first.message}{others}",
            parts.name,
        )
    return Dataset(parts.name, shards, unreadable, tensors=tensors, parts=parts)


__all__ = ["Dataset", "Record", "RecordIterator", "open"]
