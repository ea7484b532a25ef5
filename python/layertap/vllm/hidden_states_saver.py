"""The hot path of the worker half: gather finished requests' hidden states into the host pool,
hand them to the writer without a copy, and tell which requests' KV blocks can be freed.

Per engine step that finished requests, for all of them at once: one pool region, one fill of
token ids and gather indices, one gather, one device-to-host copy, one hand-over to the writer
(each one call into Rust, ``region_sinks.py``). On CUDA the gather and copy run on a side stream
behind the model's work; the engine thread only polls their event at later steps, never waits.

What does not fit the pool waits, KV blocks held, for later steps as the writer hands regions
back, as long as the engine keeps stepping while the connector holds blocks (an engine in its own
process does). An in-process engine is only stepped by ``generate()``: there the connector waits.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from typing import Any

import torch

from layertap._tensors import dtype_name
from layertap._writer_protocol import RecordSink
from layertap.errors import InvalidInputError, LayertapError
from layertap.vllm.engine_facts import EngineFacts
from layertap.vllm.errors import ConnectorError
from layertap.vllm.gather import HiddenStatesCache
from layertap.vllm.gpu_compress import GpuCompressor, region_slack
from layertap.vllm.metadata import StepSaves
from layertap.vllm.online import leave_error_marker
from layertap.vllm.pool import HostPool, Region, align_up
from layertap.vllm.region_sinks import NativeSink
from layertap.vllm.stats import WorkerStats
from layertap.vllm.window_gather import gather as gather_rows

logger = logging.getLogger("vllm.layertap")  # under vLLM's logging configuration


def region_bytes(num_tokens: int, cache: HiddenStatesCache, slack: int = 0) -> int:
    """Pool bytes for ``num_tokens`` tokens: hidden states (plus ``slack``, for encoded records:
    ``gpu_compress.region_slack``), token ids and gather indices."""
    return (
        align_up(num_tokens * cache.row_bytes + slack)
        + align_up(num_tokens * 8)
        + align_up(num_tokens * cache.index_width * 8)
    )


def _geometry(cache: HiddenStatesCache) -> tuple:
    """What the pool, sink and records were set up for: the cache after sleep must match it."""
    layout = (cache.row_layout(), cache.block_size, cache.tensor_block_size, cache.index_width)
    return cache.row_bytes, dtype_name(cache.dtype), cache.device, layout


class _Batch:
    __slots__ = ("region", "saves", "ids_offset", "event", "keep", "staged")

    def __init__(self, region: Region, saves: StepSaves, ids_offset: int):
        self.region = region
        self.saves = saves
        self.ids_offset = ids_offset
        self.event: Any = None
        self.keep: tuple = ()
        self.staged: torch.Tensor | None = None  # compress_on="gpu": the gathered rows, on the device


class HiddenStatesSaver:
    """Moves finished requests from the KV cache through the pool into the writer.
    ``wait_when_full``: wait for the writer when the pool is full (an engine not stepped while
    the connector holds blocks) rather than leave the requests for later steps."""

    def __init__(
        self,
        cache: HiddenStatesCache,
        writer: RecordSink,
        pool: HostPool,
        facts: EngineFacts,
        stats: WorkerStats,
        dataset: str,
        *,
        wait_when_full: bool = True,
        compress_on_gpu: bool = False,
    ):
        self.cache: HiddenStatesCache | None = cache
        """None while vLLM's KV cache is unregistered (sleep mode: ``drop_cache``)."""
        self.writer = writer
        self.pool = pool
        self.stats = stats
        self.dataset = dataset
        self.writer_id = facts.writer_id
        self.row_bytes = cache.row_bytes
        self._geometry = _geometry(cache)
        self.wait_when_full = wait_when_full
        self.compressor: GpuCompressor | None = None
        """``compress_on="gpu"``: encodes gathered batches and hands them to the writer itself."""
        if compress_on_gpu:
            self.compressor = GpuCompressor(writer, pool, cache, facts)
            self.sink = self.compressor
        else:
            self.sink = NativeSink(writer, pool, cache, facts)
        self._regions: dict[int, Region] = {}
        self._pending: collections.deque[StepSaves] = collections.deque()  # waiting for room
        self._inflight: collections.deque[_Batch] = collections.deque()
        self._copied: list[list[str]] = []
        self._stream = torch.cuda.Stream(device=cache.device) if cache.is_cuda else None
        self.failed: BaseException | None = None

    # -- the engine step ----------------------------------------------------------------------

    def start(self, saves: StepSaves) -> None:
        """Gathers ``saves``, as many as fit; the others wait for room (``wait_when_full``)."""
        self._reap()
        self._pending.append(saves)
        self._launch_pending()

    def collect(self, wait: float = 0.0) -> set[str]:
        """Request ids whose hidden states are now in host memory (their blocks may be freed);
        also reclaims regions and gathers waiting saves that fit now. ``wait``: seconds to wait
        for the writer to hand a region back (a step the engine takes only for the writer)."""
        while self._inflight and self._inflight[0].event.query():
            self._submit(self._inflight.popleft())
        self._reap(timeout=wait)  # takes the compressor's results too
        if self._pending:
            self._launch_pending()
        if not self._copied:
            return set()
        done = set(itertools.chain.from_iterable(self._copied))
        self._copied = []
        return done

    @property
    def pending(self) -> int:
        return sum(len(s) for s in self._pending)

    # -- pool ---------------------------------------------------------------------------------

    def _launch_pending(self) -> None:
        stalled_since = None
        while self._pending:
            saves = self._pending[0]
            region, n = self._alloc_prefix(saves)
            if region is None:
                if not self.wait_when_full:
                    self.stats.pool_deferrals += 1
                    break
                if stalled_since is None:
                    stalled_since = time.perf_counter()
                    self.stats.pool_stalls += 1
                self._wait_for_room()
                continue
            if stalled_since is not None:
                self.stats.pool_stall_seconds += time.perf_counter() - stalled_since
                stalled_since = None
            self._launch(region, self._pending.popleft() if n == len(saves) else saves.split(n))

    def _alloc_prefix(self, saves: StepSaves) -> tuple[Region | None, int]:
        """The longest prefix of ``saves`` the pool has room for now, and its region (bisected)."""
        room = self.pool.largest_free()
        total = sum(saves.num_tokens)
        if self._region_bytes(total, len(saves)) <= room:
            return self.pool.try_alloc(self._region_bytes(total, len(saves))), len(saves)
        prefix = list(itertools.accumulate(saves.num_tokens))
        lo, hi = 0, len(prefix)  # the answer n: region_bytes of the first n records <= room
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._region_bytes(prefix[mid - 1], mid) <= room:
                lo = mid
            else:
                hi = mid - 1
        if lo == 0:
            return None, 0
        return self.pool.try_alloc(self._region_bytes(prefix[lo - 1], lo)), lo

    def _region_bytes(self, tokens: int, records: int) -> int:
        slack = region_slack(records) if self.compressor is not None else 0
        return region_bytes(tokens, self.cache, slack)

    def _wait_for_room(self) -> None:
        """Hands the copies in flight to the writer, then waits for a region back."""
        if self.pool.live_regions == 0:
            raise ConnectorError(
                f"layertap connector: a request does not fit the empty pool of {self.pool.nbytes} "
                "bytes; raise pool_bytes"
            )
        self._finish_inflight()
        self._reap(timeout=None)

    def _finish_inflight(self) -> None:
        while self._inflight:
            batch = self._inflight.popleft()
            batch.event.synchronize()
            self._submit(batch)

    # -- gather and submit --------------------------------------------------------------------

    def _launch(self, region: Region, saves: StepSaves) -> None:
        t0 = time.perf_counter()
        total = sum(saves.num_tokens)
        slack = region_slack(len(saves)) if self.compressor is not None else 0
        hidden_bytes = align_up(total * self.row_bytes + slack)
        ids_offset = region.offset + hidden_bytes
        index_offset = ids_offset + align_up(total * 8)
        self.sink.fill(saves, ids_offset, index_offset)
        cache = self.cache
        hidden = region.carve(0, total * self.row_bytes, cache.dtype, (total, cache.num_layers, cache.hidden_size))
        width = cache.index_width
        index = region.carve(index_offset - region.offset, total * width * 8, torch.int64, (total, width))
        batch = _Batch(region, saves, ids_offset)
        self.stats.gathers += 1
        if self._stream is None:
            if self.compressor is not None:  # compress_on="gpu" run on the CPU (tests)
                hidden = batch.staged = torch.empty(hidden.shape, dtype=cache.dtype, device=cache.device)
            gather_rows(cache, saves, index, hidden)  # cache.gather, or only a window's rows
            self._submit(batch)
            # Without a copy stream the launch submits too, which counts its own part.
            self.stats.hook_parts["launch"] += time.perf_counter() - t0
            return
        # The copy stream starts after the work the model has queued so far (which wrote these
        # hidden states); the engine thread goes on at once.
        self._stream.wait_stream(torch.cuda.current_stream(cache.device))
        with torch.cuda.stream(self._stream):
            if self.compressor is not None:
                # The rows stay on the device, for the compressor: only their blocks are copied out.
                hidden = batch.staged = torch.empty(hidden.shape, dtype=cache.dtype, device=cache.device)
            batch.keep = gather_rows(cache, saves, index, hidden)
            batch.event = torch.cuda.Event()
            batch.event.record(self._stream)
        self._inflight.append(batch)
        self.stats.hook_parts["launch"] += time.perf_counter() - t0

    def _submit(self, batch: _Batch) -> None:
        t0 = time.perf_counter()
        batch.keep = ()
        saves, region = batch.saves, batch.region
        self._regions[region.id] = region
        if self.compressor is not None:
            # The rows are on the device, gathered: the KV blocks may go. The compressor hands
            # the records to the writer; the counters follow when it is done (_take_results).
            staged, batch.staged = batch.staged, None
            self._writer_call(self.compressor.put, batch, staged)
        else:
            self._account(batch, self._writer_call(self.sink.submit, region, batch.ids_offset, saves))
        self._copied.append(saves.req_ids)
        self.stats.hook_parts["submit"] += time.perf_counter() - t0

    def _take_results(self) -> None:
        """Counts the batches the compressor handed to the writer since the last call."""
        if self.compressor is None:
            return
        self._writer_call(self.compressor.check)
        for batch, failures in self.compressor.results():
            self._account(batch, failures)

    def _account(self, batch: _Batch, failures: list[tuple[int, str]]) -> None:
        saves = batch.saves
        for i, message in failures:
            # The scheduler checked the key already; anything left is a bug worth a log line,
            # not a reason to stop the engine.
            logger.error("layertap: record %r of request %s not written: %s", saves.keys[i], saves.req_ids[i], message)
        self.stats.submitted(saves, [i for i, _ in failures], self.row_bytes)

    def _reap(self, timeout: float | None = 0.0) -> None:
        """Returns the regions the writer is done with to the pool (waiting up to ``timeout``)."""
        t0 = time.perf_counter()
        released, written = self._writer_call(self.sink.reap, timeout)
        if not timeout:  # a wait for the writer is not the hook's work
            self.stats.hook_parts["reap"] += time.perf_counter() - t0
        # The compressor's batches handed to the writer by now, those of the records just
        # counted among them: accounted (stats.submitted) before they count as written.
        self._take_results()
        self.stats.written(written)
        for region_id in released:
            self.pool.release(self._regions.pop(region_id))

    def _writer_call(self, fn, *args):
        """Calls the writer; an I/O failure stops the engine (no silent data loss) after leaving
        an error file that ``fetch`` reports to waiting clients."""
        try:
            return fn(*args)
        except InvalidInputError:
            raise
        except LayertapError as err:
            self.failed = err
            try:
                leave_error_marker(self.dataset, self.writer_id, f"{type(err).__name__}: {err}")
            except OSError:
                pass
            raise ConnectorError(f"layertap connector: the shard writer failed: {err}") from err

    # -- sleep mode ---------------------------------------------------------------------------

    def finish_copies(self) -> None:
        """Gathers every waiting save and finishes every copy: afterwards nothing reads the KV cache."""
        wait_when_full, self.wait_when_full = self.wait_when_full, True
        try:
            self._launch_pending()
        finally:
            self.wait_when_full = wait_when_full
        self._finish_inflight()
        if self.compressor is not None:
            self._writer_call(self.compressor.drain)
            self._take_results()

    def drop_cache(self) -> None:
        """Forgets the KV cache tensor (vLLM frees or remaps it) once nothing reads it; records in
        the pool go on to disk."""
        self.finish_copies()
        self.cache = None
        self.sink.use_cache(None)

    def use_cache(self, cache: HiddenStatesCache) -> None:
        """Takes the KV cache tensor vLLM holds after waking up (same geometry as before)."""
        if _geometry(cache) != self._geometry:
            raise ConnectorError(
                f"layertap connector: after wake-up the hidden-states cache has rows of {cache.row_bytes} "
                f"bytes of {cache.dtype} on {cache.device} laid out as {_geometry(cache)[3]}; before sleep: "
                f"{self._geometry}"
            )
        self.cache = cache
        self.sink.use_cache(cache)

    # -- end ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Writes everything and closes the writer; after a writer failure there is nothing to do."""
        if self.failed is not None:
            return
        self.finish_copies()
        if self.compressor is not None:
            self.compressor.close()
        self._writer_call(self.writer.close)
        self._reap()
