"""``layertap pull``'s work: a dataset in Mooncake Store drained into shards on disk, each
record's frame copied byte for byte (checked against its index entry and its CRC first), so
that the shards hold exactly what the writers framed and ``layertap verify`` checks them as any.

Each writer's records go into shards of its own writer id (``{writer_id}-{n:06}.lts``, numbered
on from the highest already in the directory), created, locked and completed as the writers do
(``_py.shardfile``). Records whose keys the directory already holds are skipped, so pulling
again (from a dataset still being written) adds only what is new."""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, field

from layertap._options import WriterOptions
from layertap._py.shardfile import ShardFile
from layertap._spec.format import CODECS, RawEntry, parse_shard_index, shard_file_name
from layertap._types import Problem
from layertap._version import __version__
from layertap.errors import CorruptRecordError, RecordMissingError
from layertap.mooncake.backend import StoreShard


@dataclass
class PullReport:
    records: int = 0
    bytes: int = 0
    skipped: int = 0
    """Records whose keys the directory already held."""
    shards: list[str] = field(default_factory=list)
    missing: list[Problem] = field(default_factory=list)
    corrupt: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.missing and not self.corrupt


class _Out:
    """The shards of one writer id being written in the directory."""

    def __init__(self, directory: str, shard: StoreShard, source: str, shard_bytes: int, report: PullReport):
        self.directory = directory
        self.writer_id = shard.head.writer_id
        self.user = shard.head.meta.get("user", {})
        self.writer = shard.head.meta.get("writer") or f"layertap-python {__version__}"
        self.source = source
        self.shard_bytes = shard_bytes
        self.report = report
        taken = [i for i in (parse_shard_index(n, self.writer_id) for n in os.listdir(directory)) if i is not None]
        self.next_index = max(taken, default=-1) + 1
        self.file: ShardFile | None = None

    def add(self, frame: bytes, e) -> None:
        f = self.file
        if f is not None and f.entries and f.offset + len(frame) > self.shard_bytes:
            self.finish()
            f = None
        if f is None:
            name = shard_file_name(self.writer_id, self.next_index)
            meta = {
                "writer_id": self.writer_id,
                "shard_index": self.next_index,
                "created_unix_ms": int(time.time() * 1000),
                "writer": self.writer,
                "user": self.user,
                "pulled_from": self.source,
            }
            f = self.file = ShardFile(os.path.join(self.directory, name), secrets.token_bytes(16), meta, sync_dir=True)
            self.report.shards.append(f.path)
            self.next_index += 1
        codec = CODECS.index(e.codec)
        f.entries.append(RawEntry(f.offset, e.stored_len, e.raw_len, e.num_tokens, e.payload_crc, codec, e.key))
        f.write([frame])

    def finish(self) -> None:
        if self.file is not None:
            self.file.finish(sync=True)
            self.file = None


def pull(
    shards: list[StoreShard], directory: str, have: set[str], source: str, shard_bytes: int | None = None
) -> PullReport:
    """Copies every record of ``shards`` whose key is not in ``have`` into shards in
    ``directory`` (which exists), cut at ``shard_bytes`` (None: the writers' default
    ``shard_size``). Missing and corrupt records are reported, not copied."""
    if shard_bytes is None:
        shard_bytes = WriterOptions().shard_size
    report = PullReport()
    for shard in shards:
        out = _Out(directory, shard, source, shard_bytes, report)
        try:
            for i, e in enumerate(shard.entries):
                if e.key in have:
                    report.skipped += 1
                    continue
                try:
                    frame = shard.frame(i)
                except RecordMissingError as err:
                    report.missing.append(Problem(shard.path, i, e.key, "missing_record", str(err)))
                    continue
                except CorruptRecordError as err:
                    report.corrupt.append(Problem(shard.path, i, e.key, "corrupt_record", str(err)))
                    continue
                out.add(frame, e)
                have.add(e.key)
                report.records += 1
                report.bytes += len(frame)
        finally:
            out.finish()
    return report


__all__ = ["PullReport", "pull"]
