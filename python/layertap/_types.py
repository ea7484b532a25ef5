"""Plain result types shared by the Rust and the pure-Python implementations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


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


class Problem(NamedTuple):
    """Something wrong found in a shard or dataset."""

    shard: str
    offset: int | None
    key: str | None
    kind: str
    """One of: ``"corrupt_record"``, ``"damaged_region"``, ``"torn_tail"``, ``"duplicate_key"``,
    ``"bad_index"``, ``"not_a_shard"``; and ``"lost_in_recovery"`` for the notes of
    ``VerifyReport``."""
    message: str


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
