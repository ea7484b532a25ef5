"""Online use: the record of a finished request, read as soon as its writer has written it.

``fetch`` waits on ``layertap.follow.DatasetTail`` (inotify, new frame headers only), so it needs
Linux and a dataset directory whose changes the server's writes report to this process (a local
file system; NFS does not). This module does not import vLLM.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from layertap._files import write_atomic
from layertap._spec.format import key_problem, writer_id_problem
from layertap._tensors import tensor_maker
from layertap.errors import InvalidInputError, LayertapError
from layertap.follow import DatasetTail

#: The entry of a response's kv_transfer_params that the connector fills.
PARAMS_KEY = "layertap"


def error_marker_path(dataset: str, writer_id: str) -> str:
    """Where a worker whose writer failed leaves the error, for waiting ``fetch`` calls."""
    return os.path.join(dataset, f"{writer_id}.error")


def leave_error_marker(dataset: str, writer_id: str, text: str) -> None:
    """Leaves ``text`` in the writer's error file, atomically: an empty file seen between open and
    write once made a waiting ``fetch`` report a failure with no reason."""
    write_atomic(error_marker_path(dataset, writer_id), text.rstrip("\n") + "\n")


@dataclass(frozen=True)
class RecordLocation:
    """Where the connector writes a request's record."""

    dataset: str
    """The dataset directory (absolute, as the server sees it)."""
    writer_id: str
    key: str
    num_tokens: int | None = None
    store: str | None = None
    """With the connector's ``mooncake`` option: the dataset in Mooncake Store (docs/MOONCAKE.md)."""
    request_id: str | None = None
    """A key is put into the store once, so ``fetch`` checks the record under it is this request's."""


def record_location(kv_transfer_params: Mapping[str, Any] | None) -> RecordLocation:
    """Reads a response's ``kv_transfer_params`` (or its ``"layertap"`` entry); raises with the
    server's message if it did not save the request (``InvalidInputError``: it refused it)."""
    if kv_transfer_params is None:
        raise InvalidInputError(
            "the response has no kv_transfer_params: the server does not run the layertap connector, "
            "the request did not finish normally (aborted requests are not saved), or the connector "
            'saves only requests that ask (its option save is "requested"): send "save": true or a '
            '"sample_id" in the request\'s kv_transfer_params'
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
    store = entry.get("store")
    if store is not None and not (isinstance(store, str) and store.startswith("mooncake://")):
        raise InvalidInputError(f"store {store!r} is not a Mooncake address")
    request_id = entry.get("request_id")
    return RecordLocation(
        dataset,
        writer_id,
        key,
        num_tokens if isinstance(num_tokens, int) else None,
        store,
        request_id if isinstance(request_id, str) else None,
    )


def _check_same_store(store: str, theirs: str | None) -> None:
    from layertap.mooncake.address import parse_address

    if theirs is None:
        raise InvalidInputError(
            f"fetch(store={store!r}): this response's record is not in Mooncake Store (the connector has no mooncake "
            "option): leave store out"
        )
    mine = parse_address(store).dataset
    if mine != parse_address(theirs).dataset:
        raise InvalidInputError(f"fetch(store={store!r}): the response's record is in {theirs}, not {mine}")


def fetch(
    kv_transfer_params: Mapping[str, Any] | RecordLocation,
    timeout: float | None = None,
    durable: bool = True,
    store: str | None = None,
):
    """The ``layertap.Record`` of a finished request, once its writer has written it (docs/CONNECTOR.md).

    ``kv_transfer_params``: the response's, or a ``RecordLocation``. Raises ``TimeoutError`` past
    ``timeout`` seconds (None: no limit), ``LayertapError`` if the server's writer failed. With
    ``durable`` the shard is fsynced first, whatever the connector's ``durability``. With the
    ``mooncake`` option the record is read from the store (``durable`` does not apply); ``store``:
    that dataset's address with options to read it through (docs/MOONCAKE.md, "Addresses")."""
    loc = kv_transfer_params if isinstance(kv_transfer_params, RecordLocation) else record_location(kv_transfer_params)
    if store is not None:
        _check_same_store(store, loc.store)
    if loc.store is not None:
        from layertap.vllm.mooncake_forwarder import fetch_from_store

        return fetch_from_store(
            store or loc.store,
            loc.writer_id,
            loc.key,
            timeout,
            tensor_maker("auto"),
            request_id=loc.request_id,
            num_tokens=loc.num_tokens,
        )
    deadline = None if timeout is None else time.monotonic() + timeout
    marker = error_marker_path(loc.dataset, loc.writer_id)
    make = tensor_maker("auto")
    with DatasetTail(loc.dataset, writer_id=loc.writer_id) as tail:
        while True:
            reason = read_error_marker(marker)
            if reason:
                raise LayertapError(f"writer {loc.writer_id} failed and writes no more: {reason}")
            record = tail.find(loc.key, make)
            if record is not None:
                if durable:
                    _fsync(record.shard)
                return record
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(
                    f"record {loc.key!r} of writer {loc.writer_id} did not appear in {loc.dataset} within {timeout} s"
                )
            tail.wait(remaining, also=os.path.basename(marker))


def read_error_marker(marker: str) -> str:
    """The failure a writer's error file holds; "" while none (or still empty: its write wakes the wait)."""
    try:
        with open(marker, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def _fsync(path: str) -> None:
    """fsync works on a read-only descriptor: a client can make a record durable by itself."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["RecordLocation", "error_marker_path", "fetch", "leave_error_marker", "read_error_marker", "record_location"]
