"""Plain result types shared by the Rust and the pure-Python implementations."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple, Protocol, TypeVar, runtime_checkable

_Self = TypeVar("_Self", bound="ClosedOnExit")


class ClosedOnExit:
    """A ``with`` block closes it (``close()``) at its end."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Completion(NamedTuple):
    """A record a writer has written (returned by ``poll()``)."""

    seq: int
    """What ``submit()`` returned for it."""
    key: str
    shard: str
    """Path of the shard file."""
    offset: int
    """Offset of the record's frame in the shard."""
    stored_len: int
    raw_len: int


class IndexEntry(NamedTuple):
    """Where a record is in its shard and what it holds, as the index (or a scan) says."""

    key: str
    frame_offset: int
    stored_len: int
    raw_len: int
    num_tokens: int
    codec: str
    payload_crc: int


class ProblemKind(str, Enum):
    """What a ``Problem`` is. A ``str`` too, equal to its value (``ProblemKind.TORN_TAIL ==
    "torn_tail"``), which JSON reports print and both readers and the Rust core use."""

    CORRUPT_RECORD = "corrupt_record"
    """A record failed its checksum or could not be decoded."""
    DAMAGED_REGION = "damaged_region"
    """Bytes between records that are no record frame (a scan skipped them)."""
    TORN_TAIL = "torn_tail"
    """The end of a shard whose writer stopped mid-record (or is still writing)."""
    DUPLICATE_KEY = "duplicate_key"
    """A key that another record of the dataset has too."""
    BAD_INDEX = "bad_index"
    """A complete shard whose index (footer) is damaged; its records were found by a scan."""
    NOT_A_SHARD = "not_a_shard"
    """A file among the shards that is not one."""
    MISSING_RECORD = "missing_record"
    """A record a store's index lists and the store does not hold (docs/MOONCAKE.md)."""
    LOST_IN_RECOVERY = "lost_in_recovery"
    """A note of ``VerifyReport``: damaged parts an earlier ``recover`` left out of an index."""

    # The value, not "ProblemKind.TORN_TAIL", wherever a kind is printed (Python 3.10 and 3.12
    # format mixed-in enums differently).
    __str__ = str.__str__
    __format__ = str.__format__


class Problem(NamedTuple):
    """Something wrong found in a shard or dataset."""

    shard: str
    offset: int | None
    key: str | None
    kind: ProblemKind
    """What it is (a ``ProblemKind``, equal to its string value)."""
    message: str


@runtime_checkable
class ShardBackend(Protocol):
    """One shard as a reader backend opens it: ``RustShardReader`` (``layertap._rust_reader``,
    memory-mapped), ``PyShardReader`` (``layertap._py.reader``, the reference), or the reader's
    stand-in for a torn empty shard. ``layertap.open`` and ``layertap.follow`` take any of them."""

    path: str
    complete: bool
    """The shard has its index and trailer (else its records were found by a scan)."""
    meta: dict
    """The shard metadata JSON object of its header."""
    file_bytes: int
    torn_tail_bytes: int
    being_written: bool
    """Another process held the shard's flock (a live writer) when it was opened."""
    lost_in_recovery: int
    scan_problems: list[Problem]
    """What opening it found: a torn tail, damaged regions, a bad index, corrupt records."""
    entries: list[IndexEntry]
    """Its records, in file order."""

    def read(self, i: int, verify: bool = True) -> tuple[dict[str, str], list[tuple[str, str, tuple[int, ...], Any]]]:
        """Record ``i``'s metadata and tensors ``(name, dtype, shape, buffer)``; with ``verify``
        its checksum is checked first (``CorruptRecordError``)."""
        ...

    def check(self, i: int) -> None:
        """Checks record ``i`` (checksum, decoding) without handing it out."""
        ...

    def close(self) -> None: ...


@dataclass
class ShardInfo:
    """Summary of one shard, read from its index (or scan) without decoding payloads."""

    path: str
    complete: bool
    records: int
    tokens: int
    raw_bytes: int
    stored_bytes: int
    file_bytes: int
    torn_tail_bytes: int
    codecs: dict[str, int] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    being_written: bool = False
    """Another process held the shard's lock (a live writer) when the dataset was opened."""
    lost_in_recovery: int = 0
    """Damaged parts (corrupt records, damaged regions) that ``recover`` left out of this
    shard's index when it completed it, as the trailer says (docs/FORMAT.md, "Trailer")."""


@dataclass
class VerifyReport:
    """What ``Dataset.verify()`` found."""

    records_ok: int = 0
    records_bad: int = 0
    problems: list[Problem] = field(default_factory=list)
    duplicates: list[Problem] = field(default_factory=list)
    """Duplicate keys allowed by ``verify(allow_duplicates=True)`` (else they are problems)."""
    notes: list[Problem] = field(default_factory=list)
    """What is not a problem of the dataset as it is but worth knowing: a ``lost_in_recovery``
    entry for each shard from which an earlier ``recover`` left damaged parts out."""

    lost_in_recovery: int = 0
    """Damaged parts that earlier recoveries left out, summed over the shards."""

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class RecoverReport:
    """What ``recover()`` did to a shard."""

    path: str
    was_complete: bool
    records: int
    """Records indexed in the recovered shard."""
    truncated_bytes: int
    """Torn tail cut off."""
    problems: list[Problem] = field(default_factory=list)
    """Corrupt records and damaged regions left unindexed (their number is kept in the
    trailer: ``ShardInfo.lost_in_recovery``)."""
    removed: bool = False
    """The file was a torn empty shard (shorter than its header, no records) and was removed."""
