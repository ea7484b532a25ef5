"""``layertap generate --out mooncake://...`` (docs/MOONCAKE.md): the run writes its shards into a
spool directory as any run, with the connector's ``mooncake`` option, so that each record is also
put into Mooncake Store as soon as it is written. The spool is ``--also-dir`` (kept), else a
temporary directory.

After the run the store is compared with the spool (``check_store``): a record whose put failed,
was refused (another record under its key) or was evicted since makes the run incomplete, and the
spool is then kept whatever ``--also-dir`` said, so that the dataset is never only partly in
memory and nowhere else. A rerun with ``--also-dir`` set to the kept spool generates what is
left, then puts the records that the store does not list (``put_missing``)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from layertap._spec.format import FormatProblem, writer_and_index
from layertap.errors import FormatError, InvalidInputError, StoreUnavailableError
from layertap.generate.errors import GenerateError
from layertap.generate.summary import Summary
from layertap.mooncake.address import parse_address, refuse_node
from layertap.mooncake.backend import local_frame
from layertap.mooncake.client import check_master, connect
from layertap.mooncake.layout import decode_head, head_name, record_name
from layertap.mooncake.publisher import StorePublisher
from layertap.parts import MANIFEST_NAME
from layertap.reader import open as open_dataset

logger = logging.getLogger("layertap")


@dataclass
class Spool:
    """Where a run into the store writes its shards; ``keep``: left on disk after the run."""

    path: str
    keep: bool


@contextlib.contextmanager
def store_output(out: str, also_dir: str | None, connector_args: dict) -> Iterator[tuple[Spool, dict]]:
    """``(spool, connector arguments)`` for a run into the store ``out``, once the master answers.
    A temporary spool is removed afterwards unless the caller set its ``keep``."""
    try:
        address = parse_address(out)
        refuse_node(address, out)
        check_master(address)
    except (InvalidInputError, StoreUnavailableError) as e:
        raise GenerateError(str(e)) from None
    if "mooncake" in connector_args:
        raise GenerateError("--connector-args: mooncake is set by --out mooncake://...; leave it out")
    # The run reads its shards back for the summary (and resumes from them): they stay.
    args = {**connector_args, "mooncake": out, "mooncake_keep_shards": True}
    if also_dir is not None:
        yield Spool(os.path.abspath(also_dir), keep=True), args
        return
    spool = Spool(tempfile.mkdtemp(prefix="layertap-spool-"), keep=False)
    try:
        yield spool, args
    finally:
        if not spool.keep:
            shutil.rmtree(spool.path, ignore_errors=True)


def _record(e) -> tuple:
    """What tells one record from another under the same key: its frame header's fields."""
    return (e.stored_len, e.raw_len, e.num_tokens, e.codec, e.payload_crc)


def _entries(dataset: str) -> dict[str, tuple]:
    """The dataset's records by key (the first of a key, as the readers take it)."""
    out: dict[str, tuple] = {}
    with open_dataset(dataset) as ds:
        for backend in ds.backends:
            for e in backend.entries:
                out.setdefault(e.key, _record(e))
    return out


def _spool_entries(spool: str) -> dict[str, tuple]:
    """The spool's records (a parallel run's spool is a dataset of parts, its shards in them)."""
    names = os.listdir(spool)
    if MANIFEST_NAME not in names and not any(n.endswith(".lts") for n in names):
        return {}
    return _entries(spool)


def _store_entries(out: str) -> dict[str, tuple]:
    try:
        return _entries(out)
    except FormatError:
        return {}  # no writer has registered: nothing is listed


@dataclass
class StoreCheck:
    """What the store holds of a spool's records, looked at once the run is over."""

    not_listed: set[str]
    """No writer lists them: their puts failed (the master gone, the store full)."""
    refused: set[str]
    """Listed as another record: the store had one under the key first."""
    evicted: set[str]
    """Listed as this run's, but no longer in the store (evicted, or lost with its node)."""

    @property
    def missing(self) -> set[str]:
        return self.not_listed | self.evicted

    @property
    def all_there(self) -> bool:
        return not (self.not_listed or self.refused or self.evicted)


def check_store(out: str, spool: str) -> StoreCheck | None:
    """What the store ``out`` holds of the spool's records (None: it cannot be reached). Each
    listed record's object is asked for: a run's first records may be evicted by its last."""
    try:
        local = _spool_entries(spool)
        listed = _store_entries(out)
        address = parse_address(out)
        mine = [k for k, e in local.items() if listed.get(k) == e]
        there = connect(address).exist_many([record_name(address.prefix, k) for k in mine]) if mine else []
    except StoreUnavailableError:
        return None
    if there is None:
        return None
    return StoreCheck(
        not_listed={k for k in local if k not in listed},
        refused={k for k, e in local.items() if k in listed and listed[k] != e},
        evicted={k for k, ok in zip(mine, there, strict=True) if not ok},
    )


def put_missing(out: str, spool: str, keys: set[str]) -> int:
    """Puts the spool's records ``keys`` into the store, each under the writer that wrote it
    (its index and head go on from where that writer's left off); returns how many went in."""
    address = parse_address(out)
    client = connect(address)
    put = 0
    with open_dataset(spool) as ds:
        for backend in ds.backends:
            todo = [e for e in backend.entries if e.key in keys]
            parsed = writer_and_index(os.path.basename(backend.path))
            if not todo or parsed is None:
                continue
            writer_id = parsed[0]
            old = client.get(head_name(address.prefix, writer_id))
            meta = decode_head(old).meta if old is not None else {k: backend.meta.get(k) for k in ("writer", "user")}
            publisher = StorePublisher(client, address, writer_id, meta)
            fd = os.open(backend.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                for e in todo:
                    try:
                        entry, frame = local_frame(fd, e, backend.path)
                    except FormatProblem as problem:
                        logger.error("layertap generate: record %r of %s not put: %s", e.key, backend.path, problem)
                        continue
                    put += publisher.publish(entry, frame)
            finally:
                os.close(fd)
                publisher.close()
    return put


def settle_store_run(summary: Summary, out: str, spool: Spool) -> Summary:
    """The summary of a run into the store ``out``: what the store does not list of the spool is
    put (a rerun over a kept spool, a master that came back), then what it lacks is counted. The
    run is complete only when the store holds every record of the spool; else the spool is kept."""
    check = check_store(out, spool.path)
    if check is not None and check.not_listed:
        try:
            put_missing(out, spool.path, check.not_listed)
        except StoreUnavailableError:
            pass  # counted as missing below
        check = check_store(out, spool.path)
    if check is None or not check.all_there:
        spool.keep = True
    return {
        **summary,
        "out": out,
        "also_dir": spool.path if spool.keep else None,
        "store_missing": None if check is None else len(check.missing),
        "store_evicted": None if check is None else len(check.evicted),
        "store_refused": None if check is None else len(check.refused),
        "complete": summary["complete"] and check is not None and check.all_there,
    }
