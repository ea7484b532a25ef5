"""The connector's Mooncake forwarder (option ``mooncake``, docs/MOONCAKE.md): the writer writes
records into a local spool as always (the engine thread's work is unchanged), and the forwarder's
thread reads each frame back once written (``DatasetTail``) and puts it into Mooncake Store.

With ``mooncake_keep_shards`` the spool's shards stay, else each goes once forwarded. A record the
store refuses or loses is counted, logged and stays in the spool; the engine never waits for it.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from layertap._spec.format import FormatProblem
from layertap._spec.lock import is_locked
from layertap.follow import DatasetTail, ShardTail
from layertap.mooncake.address import StoreAddress
from layertap.mooncake.backend import local_frame
from layertap.mooncake.client import BufferTooSmallError, connect
from layertap.mooncake.publisher import INDEX_INTERVAL, StorePublisher

logger = logging.getLogger("vllm.layertap")

#: Seconds ``Forwarder.close`` waits by default: vLLM kills a worker 5 s into its shutdown, and the
#: writer's close, this wait and the statistics' report must fit; what a late forwarder did not
#: put stays in the spool, and its statistics say so.
CLOSE_TIMEOUT = 3.0


class Forwarder:
    """Puts the records of writer ``writer_id``'s shards in ``directory`` into the store, on its
    own thread, until ``close``. ``stats["state"]``: ``"forwarding"``, ``"closed"``, ``"failed"``
    (``stats["error"]`` says why) or ``"closing"`` (still at work when ``close`` stopped waiting)."""

    def __init__(self, address: StoreAddress, directory: str, writer_id: str, meta: dict, keep_shards: bool):
        self.address = address
        self.directory = directory
        self.writer_id = writer_id
        self.keep_shards = keep_shards
        self.publisher = StorePublisher(connect(address), address, writer_id, meta)
        self.stats = self.publisher.stats
        self.stats.update(records_unreadable_in_spool=0, spool_shards_removed=0, state="forwarding")
        self._fds: dict[str, int] = {}
        self._closing = threading.Event()
        self._tail = DatasetTail(directory, writer_id=writer_id)
        self._thread = threading.Thread(target=self._run, name="layertap-mooncake", daemon=True)
        self.error: BaseException | None = None
        self._thread.start()

    # -- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                closing = self._closing.is_set()
                self._forward_new()
                if self.publisher.index_due():
                    self.publisher.flush_index()
                if closing:
                    break
                self._tail.wait(INDEX_INTERVAL / 2)
            self.publisher.close()
            self.stats["state"] = "closed"
        except BaseException as e:
            self.error = e
            # The connector's statistics carry these: a forwarder that stopped is seen there,
            # not only in one log line among the engine's.
            self.stats.update(state="failed", error=f"{type(e).__name__}: {e}")
            logger.exception("layertap mooncake: the forwarder stopped; records are no longer put into the store")
        finally:
            self._tail.close()
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def _forward_new(self) -> None:
        for shard in self._tail.shards():
            self._tail.refresh(shard)
            while shard.consumed < len(shard.entries):
                got = self._frame(shard, shard.consumed)
                if got is None:
                    break  # not all written yet
                if got is not False:
                    self.publisher.publish(*got)
                shard.consumed += 1
            if shard.done and shard.consumed == len(shard.entries):
                self._finished(shard)

    def _frame(self, shard: ShardTail, i: int):
        """``(entry, frame)`` of record ``i``; None while being written; False if damaged (counted)."""
        e = shard.entries[i]
        fd = self._fds.get(shard.path)
        if fd is None:
            fd = self._fds[shard.path] = os.open(shard.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return local_frame(fd, e, shard.path)
        except FormatProblem:
            if is_locked(shard.path):
                return None  # writes may land out of order; the writer is still on it
            self.stats["records_unreadable_in_spool"] += 1
            logger.error("layertap mooncake: record %r of %s is damaged in the spool; not put", e.key, shard.path)
            return False

    def _finished(self, shard: ShardTail) -> None:
        self._tail.forget(shard)  # a served engine forwards for weeks: keep no finished shard
        fd = self._fds.pop(shard.path, None)
        if fd is not None:
            os.close(fd)
        if not self.keep_shards:
            try:
                os.unlink(shard.path)
                self.stats["spool_shards_removed"] += 1
            except FileNotFoundError:
                pass

    # -- the owner --------------------------------------------------------------------------------

    def close(self, timeout: float | None = CLOSE_TIMEOUT) -> None:
        """Forwards what the closed writer left, publishes the index and closes the writer in the
        store, waiting up to ``timeout`` seconds (None: no limit); the thread goes on past it."""
        self._closing.set()
        t0 = time.monotonic()
        self._thread.join(timeout)
        self.stats["close_seconds"] = time.monotonic() - t0
        if self._thread.is_alive() and self.stats["state"] == "forwarding":  # (not "closed" just now)
            self.stats["state"] = "closing"
            logger.warning(
                "layertap mooncake: the forwarder did not finish within %.1f s (a backlog, or %s answers slowly); "
                "the records it has not put stay in the spool %s",
                timeout,
                self.address,
                self.directory,
            )


__all__ = ["CLOSE_TIMEOUT", "Forwarder"]


# -- the connector's use ---------------------------------------------------------------------------


def connect_store(options) -> StoreAddress | None:
    """The ``mooncake`` option's store, connected (None without it): an unreachable master is a
    ``ConfigError`` before the engine serves."""
    if options.mooncake is None:
        return None
    from layertap.errors import StoreUnavailableError
    from layertap.mooncake.address import parse_address
    from layertap.vllm.config import ConfigError

    address = parse_address(options.mooncake)
    try:
        connect(address)  # made once a process: the forwarder's
    except StoreUnavailableError as e:
        raise ConfigError("mooncake", str(e)) from None
    return address


#: ``fetch`` looks for a record this often at first, then less often up to ``FETCH_MAX_POLL``
#: (Mooncake Store tells no one when an object appears).
FETCH_FIRST_POLL = 0.005
FETCH_MAX_POLL = 0.1


def fetch_from_store(
    store: str,
    writer_id: str,
    key: str,
    timeout: float | None,
    make,
    *,
    request_id: str | None = None,
    num_tokens: int | None = None,
):
    """The record ``key`` once the forwarder has put it into ``store``; TimeoutError past
    ``timeout``. A key is put once: a record under it with another ``request_id`` or
    ``num_tokens`` than the response's is another request's (DuplicateKeyError)."""
    from layertap.errors import DuplicateKeyError, RecordMissingError, StoreUnavailableError
    from layertap.mooncake.address import parse_address
    from layertap.mooncake.backend import read_object, writer_path
    from layertap.mooncake.layout import record_name
    from layertap.reader import Record

    address = parse_address(store)
    client = connect(address)
    name = record_name(address.prefix, key)
    path = writer_path(address, writer_id)
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = FETCH_FIRST_POLL
    unavailable = (
        f"{address}: cannot look for record {key!r}: {client.who()} does not answer; check that they run, then fetch "
        "again"
    )
    # A response's record is most often in the store by the time it is fetched: it is read at
    # once (one lookup in the master, where a look first took two), and looked for with the
    # existence check, which moves no data, only while it is not there.
    while True:
        try:
            metadata, tensors = read_object(client, address, key, None, path, 0)
            break
        except RecordMissingError:
            pass
        except BufferTooSmallError:
            raise  # it says what to change; the store answers
        except StoreUnavailableError:
            raise StoreUnavailableError(unavailable) from None
        while not (there := client.exists(name)):
            if there is None:
                raise StoreUnavailableError(unavailable)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"record {key!r} of writer {writer_id} did not appear in {address} within {timeout} s"
                )
            time.sleep(pause)
            pause = min(FETCH_MAX_POLL, pause * 2)
    tokens = int(metadata.get("num_tokens", "0"))
    theirs = metadata.get("request_id")
    if (request_id is not None and theirs != request_id) or (num_tokens is not None and tokens != num_tokens):
        ours = [f"request {request_id!r}"] if request_id is not None else []
        ours += [f"{num_tokens} tokens"] if num_tokens is not None else []
        raise DuplicateKeyError(
            f"{address}: the record under key {key!r} is another request's (request {theirs!r}, {tokens} tokens, not "
            f"{', '.join(ours)}): the key was put before and this request's record was refused; give each request "
            "its own sample_id, or write under a new prefix"
        )
    tensors_made = {name: make(buf, dtype, shape) for name, dtype, shape, buf in tensors}
    return Record(key, tensors_made, metadata, path, 0, tokens)
