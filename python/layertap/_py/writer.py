"""``PyShardWriter``: the pure-Python reference writer (docs/API.md, "Writers").

The caller's thread only checks input and queues; one background thread encodes (zstandard and
numpy release the GIL) and writes, records in submission order. The queue is bounded by
``max_inflight_bytes`` of raw bytes: ``submit`` waits past it.
"""

from __future__ import annotations

import collections
import math
import os
import secrets
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from layertap._keys import KeyWindow
from layertap._options import WriterOptions, check_utf8, python_writer_problem
from layertap._py.encode import Encoder
from layertap._py.shardfile import ShardFile, io_error
from layertap._py.version import package_version
from layertap._sink import BufferRecord
from layertap._spec.blob import build_header
from layertap._spec.dtypes import ITEMSIZE, TWO_BYTE
from layertap._spec.format import (
    CODECS,
    KIND_RECORD,
    RawEntry,
    align8,
    crc32c,
    encode_frame_header,
    key_problem,
    parse_shard_index,
    shard_file_name,
)
from layertap._types import Completion
from layertap.errors import (
    DuplicateKeyError,
    InvalidInputError,
    LayertapError,
    WriterClosedError,
)


class _Job:
    """One queued record; holds the caller's buffers until it is written."""

    __slots__ = ("seq", "key", "header", "tensors", "num_tokens", "raw_len")

    def __init__(self, seq, key, header, tensors, num_tokens, raw_len):
        self.seq = seq
        self.key = key
        self.header = header
        self.tensors = tensors
        self.num_tokens = num_tokens
        self.raw_len = raw_len


class _Sync:
    """A flush request in the queue: write everything before it, fsync, then tick."""

    __slots__ = ("ticket",)

    def __init__(self, ticket: int):
        self.ticket = ticket


class _State:
    """Everything the caller's thread and the background thread share, under ``cond``.

    Kept apart from ``PyShardWriter`` so that the thread does not keep the writer alive: a
    writer that is dropped without ``close()`` is closed by its finalizer."""

    def __init__(self, directory, writer_id, codec, level, shard_size, durability, batch_bytes, user_meta, first_index):
        self.cond = threading.Condition()
        self.queue: collections.deque = collections.deque()
        self.completions: list[Completion] = []
        self.directory = directory
        self.writer_id = writer_id
        self.codec = codec
        self.level = level
        self.shard_size = shard_size
        self.durability = durability
        self.batch_bytes = batch_bytes
        self.user_meta = user_meta
        self.next_index = first_index
        self.shard: ShardFile | None = None
        self.identity = None  # the writer's _shard_identity, bound by PyShardWriter
        self.software = ""
        # Counters (under cond).
        self.inflight_bytes = 0
        self.queue_depth = 0
        self.records_written = 0
        self.bytes_in = 0
        self.bytes_stored = 0
        self.shards_closed = 0
        self.encode_seconds = 0.0  # only the writer's thread adds to it
        self.synced_ticket = 0
        self.closing = False
        self.done = False
        self.error: LayertapError | None = None
        self.thread: threading.Thread | None = None

    # -- shards (background thread, or the constructor for the first one) -------------------

    def open_shard(self) -> None:
        index = self.next_index
        name = shard_file_name(self.writer_id, index)
        shard_id, created_ms = self.identity(index)
        meta = {
            "writer_id": self.writer_id,
            "shard_index": index,
            "created_unix_ms": created_ms,
            "writer": self.software,
            "user": self.user_meta,
        }
        self.shard = ShardFile(os.path.join(self.directory, name), shard_id, meta, self.durability != "none")
        self.next_index = index + 1

    def close_shard(self) -> None:
        shard, self.shard = self.shard, None
        if shard is None:
            return
        try:
            shard.finish(sync=self.durability != "none")
        finally:
            shard.release()  # also when writing the footer failed: the lock must go
        with self.cond:
            self.shards_closed += 1

    # -- the background thread --------------------------------------------------------------

    def run(self) -> None:
        try:
            encoder = Encoder(self.codec, self.level)
            while True:
                with self.cond:
                    while not self.queue and not self.closing:
                        self.cond.wait()
                    if not self.queue:
                        break
                    item = self.queue.popleft()
                if isinstance(item, _Sync):
                    if self.shard is not None and self.durability != "none":
                        self.shard.fsync()
                    with self.cond:
                        self.synced_ticket = item.ticket
                        self.cond.notify_all()
                else:
                    self.write_batch(encoder, item)
            self.close_shard()
        except Exception as e:  # handed to the caller at its next call
            self.fail(e)
        finally:
            with self.cond:
                self.done = True
                self.cond.notify_all()

    def write_batch(self, encoder: Encoder, job: _Job) -> None:
        """Encodes ``job`` and the records queued right behind it (up to ``batch_bytes``) and
        writes them with one system call per shard. A record that would take the shard past
        ``shard_size`` goes to the next shard; a shard holds at least one record (the same rule
        as the Rust writer, so both split a dataset into the same shards)."""
        encoded = []
        pending = 0
        while True:
            started = time.perf_counter()
            frame, entry = self.encode(encoder, job)
            self.encode_seconds += time.perf_counter() - started
            encoded.append((job, frame, entry))
            pending += entry.frame_len
            if pending >= self.batch_bytes:
                break
            with self.cond:
                if not self.queue or not isinstance(self.queue[0], _Job):
                    break
                job = self.queue.popleft()
        run: list = []
        for item in encoded:
            if self.shard is None:
                self.open_shard()
            end = self.shard.offset + sum(e.frame_len for _, _, e in run)
            if (self.shard.entries or run) and end + item[2].frame_len > self.shard_size:
                self.write_run(run)
                run = []
                self.close_shard()
                self.open_shard()
            run.append(item)
        self.write_run(run)

    def write_run(self, run: list) -> None:
        """Writes encoded records at the end of the current shard and reports them done."""
        if not run:
            return
        shard = self.shard
        buffers: list = []
        done = []
        offset = shard.offset
        for job, frame, entry in run:
            buffers += frame
            done.append((job, entry._replace(frame_offset=offset)))
            offset += entry.frame_len
        shard.write(buffers)
        shard.entries += [entry for _, entry in done]
        if isinstance(self.durability, int) and shard.offset - shard.synced_to >= self.durability:
            shard.fsync()
        with self.cond:
            for job, entry in done:
                self.inflight_bytes -= job.raw_len
                self.queue_depth -= 1
                self.records_written += 1
                self.bytes_in += entry.raw_len
                self.bytes_stored += entry.stored_len
                self.completions.append(
                    Completion(job.seq, job.key, shard.path, entry.frame_offset, entry.stored_len, entry.raw_len)
                )
            self.cond.notify_all()

    def encode(self, encoder: Encoder, job: _Job) -> tuple[list, RawEntry]:
        """The frame of ``job`` (header, payload pieces, padding) and its index entry, whose
        ``frame_offset`` is filled in when the frame is placed."""
        two_byte = [(view, dtype in TWO_BYTE) for _, view, dtype, _ in job.tensors]
        payload = encoder.encode(job.header, two_byte)
        stored_len = sum(memoryview(p).nbytes for p in payload)
        crc = 0
        for p in payload:
            crc = crc32c(p, crc)
        key = job.key.encode("utf-8")
        head = encode_frame_header(KIND_RECORD, self.codec, key, stored_len, job.raw_len, job.num_tokens, crc)
        pad = bytes(align8(stored_len) - stored_len)
        entry = RawEntry(0, stored_len, job.raw_len, job.num_tokens, crc, self.codec, job.key)
        return [head, *payload, pad], entry

    def fail(self, e: Exception) -> None:
        if isinstance(e, LayertapError):
            error = e
        elif isinstance(e, OSError):
            error = io_error(e, self.shard.path if self.shard else self.directory, "write")
        else:
            error = LayertapError(f"the writer's background thread failed: {e!r}")
            error.__cause__ = e
        if self.shard is not None:
            # Left open (no footer): `layertap recover` completes it.
            self.shard.release()
            self.shard = None
        with self.cond:
            self.error = error
            self.queue.clear()  # drops the references to the callers' buffers
            self.inflight_bytes = 0
            self.queue_depth = 0
            self.cond.notify_all()

    def shutdown(self) -> None:
        """Asks the thread to finish the queue and close the shard, and waits for it."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()
        elif self.thread is None and self.shard is not None:
            self.close_shard()


class PyShardWriter:
    """Writes records into shards of a dataset directory, in pure Python.

    Same constructor, methods and behaviour as ``layertap.ShardWriter`` (docs/API.md); for codec
    ``none`` both write byte-identical records. ``threads`` is accepted for compatibility: this
    writer encodes on its one background thread. ``io`` may be ``"auto"`` or ``"pwrite"``
    (``"uring"`` asks for io_uring, which this writer does not have, and is refused), and
    ``direct`` only ``False`` (it writes through the page cache)."""

    _software = f"layertap-python {package_version()}"

    def __init__(self, path: str | os.PathLike, *, options: WriterOptions | None = None, **overrides: Any):
        """Opens a writer on the dataset directory ``path``, as ``ShardWriter`` does."""
        options = WriterOptions.of(options, overrides)
        problem = python_writer_problem(options)
        if problem is not None:
            raise problem
        codec_id = CODECS.index(options.codec)
        writer_id = options.writer_id if options.writer_id is not None else secrets.token_hex(6)
        try:
            directory = os.fspath(path)
        except TypeError:
            raise InvalidInputError(f"path must be a str or os.PathLike, not {type(path).__name__}") from None
        try:
            os.makedirs(directory, exist_ok=True)
            names = os.listdir(directory)
        except OSError as e:
            raise io_error(e, directory, "create directory") from None
        taken = [i for i in (parse_shard_index(n, writer_id) for n in names) if i is not None]

        self.options = options
        """The checked options this writer was opened with."""
        self._path = directory
        self._writer_id = writer_id
        self._max_inflight = options.max_inflight_bytes
        self._keys = KeyWindow(options.key_memory)
        self._next_seq = 0
        self._blocked = 0.0
        self._flush_tickets = 0
        self._closed = False
        self._error_raised = False
        state = _State(
            directory,
            writer_id,
            codec_id,
            options.level,
            options.shard_size,
            options.durability,
            options.batch_bytes,
            dict(options.metadata),
            max(taken) + 1 if taken else 0,
        )
        cls = type(self)
        state.identity = lambda index: cls._shard_identity(writer_id, index)
        state.software = cls._software
        # The first shard is created here, so that a clash of writer ids fails at once.
        state.open_shard()
        self._state = state
        state.thread = threading.Thread(target=state.run, name=f"layertap-writer-{writer_id}", daemon=True)
        state.thread.start()
        # Closes (flush, footer, unlock) a writer that is dropped or still open at exit.
        self._finalizer = weakref.finalize(self, state.shutdown)

    # -- hooks --------------------------------------------------------------------------------

    @classmethod
    def _shard_identity(cls, writer_id: str, index: int) -> tuple[bytes, int]:
        """``(shard_id, created_unix_ms)`` of a new shard. Private hook: the test-vector
        generator overrides it to make files that are the same on every run. A class method, so
        that the background thread holds no reference to the writer."""
        return secrets.token_bytes(16), time.time_ns() // 1_000_000

    # -- errors -------------------------------------------------------------------------------

    def _raise_pending(self) -> None:
        """Raises the background thread's error once; the writer is closed to work after it."""
        state = self._state
        if state.error is not None and not self._error_raised:
            self._error_raised = True
            self._closed = True
            raise state.error

    def _check_open(self) -> None:
        self._raise_pending()
        if self._closed:
            reason = f": it failed earlier ({self._state.error})" if self._state.error else ""
            raise WriterClosedError(f"writer is closed{reason}")

    # -- the API ------------------------------------------------------------------------------

    def submit(self, key: str, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> int:
        """Queues one record; returns its sequence number. See docs/API.md."""
        self._check_open()
        self._check_key(key, set())
        # Imported here: it imports torch, which the readers and the command line do without.
        from layertap._tensors import check_metadata, normalize

        if self.options.lossy is not None:
            from layertap.fp8 import quantize_record

            tensors, metadata = quantize_record(tensors, metadata)
        parts, num_tokens = normalize(tensors)
        return self._queue([(key, parts, check_metadata(metadata), num_tokens)])[0]

    def submit_many(self, records: Iterable[tuple]) -> list[int]:
        """Queues several records at once; all or none. See docs/API.md."""
        self._check_open()
        from layertap._tensors import prepare_record
        from layertap.fp8 import lossy_records

        return self._queue([prepare_record(r) for r in lossy_records(self.options.lossy, records)])

    def submit_buffers(self, records: list[BufferRecord]) -> list[int]:
        """Queues records given as byte buffers, ``(key, [(name, buffer, dtype, shape)],
        metadata or None, num_tokens)``; all or none. See docs/API.md and ``RecordSink``."""
        self._check_open()
        from layertap._tensors import check_buffer_record

        if not isinstance(records, list):
            raise InvalidInputError(f"records must be a list, not {type(records).__name__}")
        if self.options.lossy is not None:
            from layertap.fp8 import quantize_buffer_record

            records = [quantize_buffer_record(r) for r in records]
        return self._queue([check_buffer_record(r) for r in records])

    def _check_key(self, key: Any, batch_keys: set[str]) -> None:
        problem = key_problem(key)
        if problem:
            raise InvalidInputError(problem)
        if key in self._keys or key in batch_keys:
            raise DuplicateKeyError(f"duplicate key {key!r}: this writer already wrote a record with this key", key)

    def _queue(self, records: list) -> list[int]:
        """Queues records in normalized form (``layertap._tensors.Prepared``); the keys and
        what only the writer can check are checked here, for all before any is queued."""
        self._check_open()
        jobs = []
        batch_keys: set[str] = set()
        for key, parts, metadata, num_tokens in records:
            self._check_key(key, batch_keys)
            batch_keys.add(key)
            meta = dict(metadata or {})
            for k, v in meta.items():
                check_utf8("metadata entry", k, v)
            meta["key"] = key
            for name, view, dtype, shape in parts:
                check_utf8("tensor name", name)
                if view.nbytes != math.prod(shape) * ITEMSIZE[dtype]:
                    raise InvalidInputError(
                        f"tensor {name!r}: {view.nbytes} bytes, but {dtype} {list(shape)} needs "
                        f"{math.prod(shape) * ITEMSIZE[dtype]}"
                    )
            header = build_header([(name, dtype, tuple(shape)) for name, _, dtype, shape in parts], meta)
            raw_len = len(header) + sum(view.nbytes for _, view, _, _ in parts)
            jobs.append((key, header, parts, num_tokens, raw_len))

        state = self._state
        seqs = []
        with state.cond:
            for key, header, parts, num_tokens, raw_len in jobs:
                if state.inflight_bytes and state.inflight_bytes + raw_len > self._max_inflight:
                    start = time.perf_counter()
                    while (
                        state.inflight_bytes
                        and state.inflight_bytes + raw_len > self._max_inflight
                        and state.error is None
                    ):
                        state.cond.wait()
                    self._blocked += time.perf_counter() - start
                if state.error is not None:
                    self._raise_pending()
                seq = self._next_seq
                self._next_seq += 1
                self._keys.add_new(key)
                state.queue.append(_Job(seq, key, header, parts, num_tokens, raw_len))
                state.inflight_bytes += raw_len
                state.queue_depth += 1
                state.cond.notify_all()
                seqs.append(seq)
        return seqs

    def poll(self, timeout: float | None = 0.0) -> list[Completion]:
        """The records written since the last call, in sequence order. With ``timeout`` > 0
        (seconds) or ``None`` (no limit), first waits until at least one record is written,
        unless none is in flight."""
        if timeout is not None and not (isinstance(timeout, (int, float)) and 0 <= timeout < float("inf")):
            raise InvalidInputError(f"poll timeout must be >= 0 seconds or None, not {timeout!r}")
        state = self._state
        with state.cond:
            if timeout != 0:
                deadline = None if timeout is None else time.monotonic() + timeout
                while not state.completions and state.queue_depth > 0 and state.error is None:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    state.cond.wait(left)
        self._raise_pending()
        with state.cond:
            out, state.completions = state.completions, []
        return out

    def flush(self) -> None:
        """Waits until every submitted record is written (and fsynced unless durability is
        ``"none"``)."""
        self._check_open()
        state = self._state
        with state.cond:
            self._flush_tickets += 1
            ticket = self._flush_tickets
            state.queue.append(_Sync(ticket))
            state.cond.notify_all()
            while state.synced_ticket < ticket and state.error is None and not state.done:
                state.cond.wait()
        self._raise_pending()

    def close(self) -> None:
        """Flushes, completes each open shard (index and trailer), fsyncs per the policy and
        releases the shard locks. Idempotent."""
        if not self._closed:
            self._closed = True
            self._finalizer()  # runs state.shutdown once
        self._raise_pending()

    def __enter__(self) -> PyShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- properties ---------------------------------------------------------------------------

    @property
    def stats(self) -> dict:
        """Counters; see docs/API.md."""
        s = self._state
        with s.cond:
            return {
                "records_submitted": self._next_seq,
                "records_written": s.records_written,
                "bytes_in": s.bytes_in,
                "bytes_stored": s.bytes_stored,
                "ratio": s.bytes_in / s.bytes_stored if s.bytes_stored else 0.0,
                "queue_depth": s.queue_depth,
                "inflight_bytes": s.inflight_bytes,
                "blocked_seconds": self._blocked,
                "shards_closed": s.shards_closed,
                "backend": "python",
                "direct": False,
                "threads": 1,
                "encode_seconds": s.encode_seconds,
            }

    @property
    def backend(self) -> str:
        return "python"

    @property
    def writer_id(self) -> str:
        return self._writer_id

    @property
    def path(self) -> str:
        return self._path

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"PyShardWriter({self._path!r}, writer_id={self._writer_id!r}, {state})"


__all__ = ["PyShardWriter"]
