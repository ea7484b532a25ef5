"""Putting records into Mooncake Store (docs/MOONCAKE.md, "Writing"): ``StorePublisher`` puts
each record's frame (as the shard writer framed it) under its key, and publishes the index
chunks and head that let readers list them. One thread calls it (the connector's forwarder).

Nothing here raises into its caller for what the store does: a put refused or lost (the master
gone, the store full) is counted in ``stats`` and logged, and the caller goes on; the records
stay in the shards they were read from."""

from __future__ import annotations

import itertools
import logging
import time

from layertap.errors import StoreUnavailableError
from layertap.mooncake.address import StoreAddress
from layertap.mooncake.client import StoreClient
from layertap.mooncake.layout import (
    MAX_CHUNK_RECORDS,
    Head,
    LayoutProblem,
    StoreEntry,
    chunk_name,
    decode_head,
    decode_slot,
    encode_chunk,
    encode_head,
    encode_slot,
    head_name,
    record_name,
    writer_slot_name,
)

logger = logging.getLogger("vllm.layertap")  # under vLLM's logging configuration when in an engine

#: A published record waits at most this long (seconds) for its index chunk: readers that list
#: the dataset (``follow``) see it then; ``fetch`` reads a record by its key without the index.
INDEX_INTERVAL = 0.2
#: At most this many log lines per cause of failure (each counted in ``stats`` anyway).
MAX_LOGGED = 5


def claim_slot(client: StoreClient, address: StoreAddress, writer_id: str) -> int:
    """Takes the first free slot of the dataset's writer list (or finds the writer's own: a
    writer id that comes back, as a resumed run's, keeps its slot). Mooncake keeps the first put
    of a name and ignores later ones, so reading the slot back tells which writer got it."""
    for slot in itertools.count():
        name = writer_slot_name(address.prefix, slot)
        data = client.get(name)
        if data is None:
            client.put(name, encode_slot(writer_id), pinned=True)
            data = client.get(name)
            if data is None:
                raise StoreUnavailableError(f"{address}: cannot register writer {writer_id}: the store took no object")
        try:
            if decode_slot(data) == writer_id:
                return slot
        except LayoutProblem as p:
            raise StoreUnavailableError(
                f"{address}: writer slot {slot} is not layertap's ({p}): choose another prefix"
            ) from None
    raise AssertionError("unreachable")


class StorePublisher:
    """One writer's records into the store. ``meta``: the writer's shard metadata, which the
    head carries (what a shard's header would)."""

    def __init__(self, client: StoreClient, address: StoreAddress, writer_id: str, meta: dict):
        self.client = client
        self.address = address
        self.writer_id = writer_id
        self.slot = claim_slot(client, address, writer_id)
        old = client.get(head_name(address.prefix, writer_id))
        head = decode_head(old) if old is not None else Head(writer_id, 0, 0, False, 0, meta)
        self._head = head._replace(closed=False, meta=meta)
        self._pending: list[StoreEntry] = []
        self._pending_since = 0.0
        self._logged: dict[str, int] = {}
        self.stats = {
            "records_put": 0,
            "bytes_put": 0,
            "records_failed": 0,
            "duplicates_refused": 0,
            "index_chunks": head.chunks,
            "index_failures": 0,
            "put_seconds": 0.0,
        }
        self._write_head()

    def _log(self, cause: str, message: str, *args) -> None:
        n = self._logged.get(cause, 0)
        self._logged[cause] = n + 1
        if n < MAX_LOGGED:
            logger.error(
                "layertap mooncake: " + message + (" (further ones only counted)" if n == MAX_LOGGED - 1 else ""), *args
            )

    def publish(self, entry: StoreEntry, frame) -> bool:
        """Puts one record's frame; whether it is in the store now."""
        name = record_name(self.address.prefix, entry.key)
        t0 = time.perf_counter()
        there = self.client.exists(name)
        if there:
            self.stats["duplicates_refused"] += 1
            self._log("duplicate", "record %r not put: the store already has a record with this key", entry.key)
            return False
        status = self.client.put(name, frame) if there is not None else None
        self.stats["put_seconds"] += time.perf_counter() - t0
        if status != 0:
            self.stats["records_failed"] += 1
            self._head = self._head._replace(failed=self._head.failed + 1)
            self._log("put", "record %r not put into %s: status %s", entry.key, self.address, status)
            return False
        self.stats["records_put"] += 1
        self.stats["bytes_put"] += len(frame)
        if not self._pending:
            self._pending_since = time.monotonic()
        self._pending.append(entry)
        if len(self._pending) >= MAX_CHUNK_RECORDS:
            self.flush_index()
        return True

    def index_due(self) -> bool:
        return bool(self._pending) and time.monotonic() - self._pending_since >= INDEX_INTERVAL

    def flush_index(self) -> None:
        """Publishes the records put since the last call as an index chunk, then the head."""
        if self._pending:
            c = self._head.chunks
            chunk = encode_chunk(self.writer_id, c, self._pending)
            if self.client.put(chunk_name(self.address.prefix, self.writer_id, c), chunk, pinned=True) != 0:
                self.stats["index_failures"] += 1
                self._log("index", "index chunk %d of writer %s not put; retried with the next", c, self.writer_id)
                return  # kept, tried again next time
            self._head = self._head._replace(chunks=c + 1, records=self._head.records + len(self._pending))
            self.stats["index_chunks"] = c + 1
            self._pending = []
        self._write_head()

    def _write_head(self) -> None:
        if self.client.upsert(head_name(self.address.prefix, self.writer_id), encode_head(self._head)) != 0:
            self.stats["index_failures"] += 1
            self._log("head", "head of writer %s not updated", self.writer_id)

    def close(self) -> None:
        """Publishes what is left and marks the writer closed (readers: it adds no more)."""
        self._head = self._head._replace(closed=True)
        self.flush_index()


__all__ = ["INDEX_INTERVAL", "StorePublisher", "claim_slot"]
