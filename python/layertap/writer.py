"""``ShardWriter``: the Rust writer (docs/API.md, "Writers").

A thin layer over ``layertap._native.NativeShardWriter``: it turns tensors into buffers (no copy,
``layertap._tensors``); the native writer checks each record, queues it and returns at once, and
its own threads quantize, compress, checksum and write, with the GIL released.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from layertap._options import WriterOptions, options_with
from layertap._tensors import prepare_record
from layertap._types import ClosedOnExit, Completion
from layertap._writer_protocol import BufferRecord
from layertap.errors import InvalidInputError, WriterClosedError


def _native_class():
    try:
        from layertap._native import NativeShardWriter
    except ImportError as e:  # pragma: no cover - depends on how the package was installed
        raise ImportError(
            "layertap.ShardWriter needs the compiled extension layertap._native (build it with `make build`)"
        ) from e
    return NativeShardWriter


class ShardWriter(ClosedOnExit):
    """Writes records into the shards of a dataset directory, with the Rust core.

    ``submit`` checks a record and queues it without copying its tensors; a pool of threads
    compresses and checksums records in parallel and one I/O thread writes them, in submission
    order, through io_uring (or ``pwritev``). With ``direct=True`` record data bypasses the page
    cache (``O_DIRECT``) where the file system allows it; ``stats["direct"]`` says whether it
    does. See docs/API.md for every option.
    """

    def __init__(self, path: str | os.PathLike, *, options: WriterOptions | None = None, **overrides: Any):
        """Opens a writer on the dataset directory ``path`` (created if missing) with
        ``options`` (a ``layertap.WriterOptions``; None: the defaults) and any of its fields given
        as keyword arguments (``codec="zstd"``...), which take precedence."""
        options = options_with(options, overrides)
        try:
            directory = os.fspath(path)
        except TypeError:
            raise InvalidInputError(f"path must be a str or os.PathLike, not {type(path).__name__}") from None
        self._closed = False
        self.options = options
        """The checked options this writer was opened with."""
        self._native = _native_class()(directory, options)

    def submit(self, key: str, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> int:
        """Queues one record and returns its sequence number (0, 1, 2...).

        ``tensors`` maps names to CPU ``torch.Tensor``s, ``numpy.ndarray``s (C-contiguous) or
        ``(buffer, dtype, shape)`` tuples, in the order they are stored. They are **not copied**:
        do not modify them until ``poll()`` reports the record (or ``flush()`` returns). Waits,
        with the GIL released, while ``max_inflight_bytes`` are in flight. Raises
        ``InvalidInputError`` (or ``DuplicateKeyError``) before anything is queued.
        """
        if self._closed:  # before the tensors are looked at
            raise WriterClosedError("writer is closed")
        return self._native.submit(*prepare_record((key, tensors, metadata)))

    def submit_many(self, records: Iterable[tuple]) -> list[int]:
        """Queues several records at once: ``(key, tensors)`` or ``(key, tensors, metadata)``
        tuples, each as ``submit`` takes them; returns their sequence numbers (consecutive).
        One call into the writer for all of them (the GIL released once). Bad input in any
        record, or a key given twice, refuses them all before anything is queued."""
        if self._closed:
            raise WriterClosedError("writer is closed")
        return self._native.submit_many([prepare_record(r) for r in records])

    def submit_buffers(self, records: list[BufferRecord]) -> list[int]:
        """Queues records given as byte buffers: a list of ``(key, [(name, buffer, dtype,
        shape)], metadata or None, num_tokens)``, ``dtype`` a safetensors name, ``num_tokens``
        the record's token count. No torch or numpy conversion: the vLLM connector's path
        (``layertap.RecordSink``). Checked like ``submit_many``, all or none."""
        return self._native.submit_many(records)

    def poll(self, timeout: float | None = 0.0) -> list[Completion]:
        """The records written since the last call, in sequence order. With ``timeout`` > 0
        (seconds) or ``None`` (no limit), first waits until at least one record is written,
        unless none is in flight."""
        return [Completion(*c) for c in self._native.poll(timeout)]

    def flush(self) -> None:
        """Waits until every submitted record is written (and fsynced, unless durability is
        ``"none"``)."""
        self._native.flush()

    def close(self) -> None:
        """Writes everything, completes each open shard (index and trailer), fsyncs per the
        policy and releases the shard locks. Idempotent."""
        self._closed = True
        self._native.close()

    @property
    def stats(self) -> dict:
        """Counters: ``records_submitted``, ``records_written``, ``bytes_in``, ``bytes_stored``,
        ``ratio``, ``queue_depth``, ``inflight_bytes``, ``blocked_seconds``, ``shards_closed``,
        ``backend``, ``direct``, ``threads``, ``encode_seconds`` (docs/API.md)."""
        return self._native.stats

    @property
    def backend(self) -> str:
        """``"io_uring"`` or ``"pwrite"``."""
        return self._native.backend

    @property
    def writer_id(self) -> str:
        """The writer id in this writer's shard names."""
        return self._native.writer_id

    @property
    def encoder_thread_ids(self) -> list[int]:
        """The OS thread ids of this writer's compression threads (Linux; empty elsewhere),
        waiting up to 2 s for threads still starting: for a caller that changes their
        scheduling (``layertap.vllm.threads.lower_encoder_priority``), which a search by
        thread name would do for every writer of the process at once."""
        return self._native.encoder_thread_ids

    @property
    def path(self) -> str:
        """The dataset directory."""
        return self._native.path

    @property
    def native(self) -> Any:
        """The ``layertap._native.NativeShardWriter`` this class wraps: for a caller that hands
        the Rust writer work without Python in between (the connector's ``NativeRegionSink``,
        ``layertap.vllm.region_sinks``). Its methods take already checked values; use this class's."""
        return self._native

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"ShardWriter({self.path!r}, writer_id={self.writer_id!r}, backend={self.backend!r}, {state})"


__all__ = ["ShardWriter"]
