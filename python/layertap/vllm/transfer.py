"""The hot path of the worker half: gather finished requests' hidden states into the host pool,
hand them to the writer without a copy, and tell which requests' KV blocks can be freed.

Per engine step that finished requests: one region of the pool, one set of index arrays, one
gather, one device-to-host copy, for all of them. On CUDA the gather and the copy run on a side
stream behind the model's work and an event marks the end of the copy; the engine thread only
polls the event (``event.query()``) at later steps and never waits on it, unless the pool is
full. On the CPU the gather writes straight into the pool and is done when it returns.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from typing import Any

import torch

from layertap._sink import RecordSink
from layertap._tensors import dtype_name
from layertap.errors import InvalidInputError, LayertapError
from layertap.vllm.counters import WorkerCounters
from layertap.vllm.engine import EngineFacts
from layertap.vllm.gather import HiddenStatesCache
from layertap.vllm.metadata import SaveRequest
from layertap.vllm.online import error_marker_path
from layertap.vllm.pool import HostPool, Region, align_up
from layertap.vllm.stats import ConnectorStats

logger = logging.getLogger("vllm.layertap")  # under vLLM's logging configuration


def region_bytes(num_tokens: int, cache: HiddenStatesCache) -> int:
    """Pool bytes for ``num_tokens`` tokens: hidden states, token ids and gather indices."""
    return (
        align_up(num_tokens * cache.row_bytes) + align_up(num_tokens * 8) + align_up(num_tokens * cache.index_width * 8)
    )


class _Batch:
    """The requests gathered together in one region."""

    __slots__ = ("region", "saves", "bounds", "hidden", "token_ids", "event", "keep")

    def __init__(
        self,
        region: Region,
        saves: list[SaveRequest],
        bounds: list[tuple[int, int]],
        hidden: torch.Tensor,
        token_ids: torch.Tensor,
    ):
        self.region = region
        self.saves = saves
        self.bounds = bounds
        self.hidden = hidden
        self.token_ids = token_ids
        self.event: Any = None
        self.keep: tuple = ()


class HiddenStatesSaver:
    """Moves finished requests from the KV cache through the pool into the writer."""

    def __init__(
        self,
        cache: HiddenStatesCache,
        writer: RecordSink,
        pool: HostPool,
        facts: EngineFacts,
        stats: ConnectorStats,
        dataset: str,
        counters: WorkerCounters | None = None,
    ):
        self.cache: HiddenStatesCache | None = cache
        """None while vLLM's KV cache is unregistered (sleep mode: ``drop_cache``)."""
        self.writer = writer
        self.pool = pool
        self.stats = stats
        self.counters = counters
        self.dataset = dataset
        self.writer_id = facts.writer_id
        self.row_bytes = cache.row_bytes
        self._row_shape = (cache.num_layers, cache.hidden_size)
        self._dtype_name = dtype_name(cache.dtype)
        self._geometry = (cache.row_bytes, self._dtype_name, cache.device)
        self._record_meta = {
            "layer_ids": json.dumps(list(facts.layer_ids)),
            "model": facts.model,
            "dtype": str(cache.dtype).removeprefix("torch."),
        }
        self._inflight: collections.deque[_Batch] = collections.deque()
        self._copied: list[str] = []
        self._region_of_seq: dict[int, Region] = {}
        self._stream = torch.cuda.Stream(device=cache.device) if cache.is_cuda else None
        self.failed: BaseException | None = None

    # -- the engine step ----------------------------------------------------------------------

    def start(self, saves: list[SaveRequest]) -> None:
        """Gathers ``saves`` (one batch if the pool has room for all, else as many as fit,
        waiting for the writer to hand regions back when nothing fits)."""
        i = 0
        stalled_since = None
        while i < len(saves):
            region, n = self._alloc_prefix(saves, i)
            if region is None:
                if stalled_since is None:
                    stalled_since = time.perf_counter()
                    self.stats.pool_stalls += 1
                self._wait_for_room()
                continue
            if stalled_since is not None:
                self.stats.pool_stall_seconds += time.perf_counter() - stalled_since
                stalled_since = None
            self._launch(region, saves[i : i + n])
            i += n

    def collect(self, wait: float = 0.0) -> list[str]:
        """Request ids whose hidden states are now in host memory (their KV blocks may be freed);
        also returns finished writes' regions to the pool, waiting up to ``wait`` seconds for
        the writer to finish one when records are in flight."""
        while self._inflight and self._inflight[0].event.query():
            self._submit(self._inflight.popleft())
        self._reap(timeout=wait)
        done, self._copied = self._copied, []
        return done

    # -- pool ---------------------------------------------------------------------------------

    def _alloc_prefix(self, saves: list[SaveRequest], start: int) -> tuple[Region | None, int]:
        """The largest run ``saves[start:start + n]`` the pool has room for now, and its region."""
        total = 0
        sizes = []
        for save in saves[start:]:
            total += save.num_tokens
            sizes.append(total)
        for n in range(len(sizes), 0, -1):
            region = self.pool.try_alloc(region_bytes(sizes[n - 1], self.cache))
            if region is not None:
                return region, n
        return None, 0

    def _wait_for_room(self) -> None:
        """Finishes the copies in flight, hands them to the writer, then waits until the writer
        has written at least one more record and returns the regions it no longer needs."""
        if self.pool.live_regions == 0:
            raise RuntimeError(
                f"layertap connector: a request does not fit the empty pool of {self.pool.nbytes} "
                "bytes; raise pool_bytes"
            )
        while self._inflight:
            batch = self._inflight.popleft()
            batch.event.synchronize()
            self._submit(batch)
        self._reap(timeout=None)

    # -- gather and submit --------------------------------------------------------------------

    def _launch(self, region: Region, saves: list[SaveRequest]) -> None:
        total = sum(s.num_tokens for s in saves)
        layers, hidden_size = self.cache.num_layers, self.cache.hidden_size
        hidden_bytes = align_up(total * self.row_bytes)
        ids_bytes = align_up(total * 8)
        hidden = region.carve(0, total * self.row_bytes, self.cache.dtype, (total, layers, hidden_size))
        token_ids = region.carve(hidden_bytes, total * 8, torch.int64, (total,))
        width = self.cache.index_width
        index = region.carve(hidden_bytes + ids_bytes, total * width * 8, torch.int64, (total, width))
        ids_np = token_ids.numpy()
        bounds = []
        at = 0
        for save in saves:
            end = at + save.num_tokens
            ids_np[at:end] = save.token_ids
            bounds.append((at, end))
            at = end
        self.cache.write_indices([(s.block_ids, s.num_tokens) for s in saves], index.numpy())
        batch = _Batch(region, saves, bounds, hidden, token_ids)
        self.stats.gathers += 1
        if self._stream is None:
            self.cache.gather(index, hidden)
            self._submit(batch)
            return
        # The copy stream starts after the work the model has queued so far (which wrote these
        # hidden states); the engine thread goes on at once.
        self._stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(self._stream):
            batch.keep = self.cache.gather(index, hidden)
            batch.event = torch.cuda.Event()
            batch.event.record(self._stream)
        self._inflight.append(batch)

    def _submit(self, batch: _Batch) -> None:
        """Hands the records of a gathered batch to the writer in one call: byte views of the
        pool region, built here rather than as torch views, because making and later freeing
        two tensors per record cost more engine-thread time than the rest of the step's work
        (benches/RESULTS.md)."""
        batch.keep = ()
        region = batch.region
        hidden = memoryview(batch.hidden.reshape(-1).view(torch.uint8).numpy())
        token_ids = memoryview(batch.token_ids.view(torch.uint8).numpy())
        row, row_shape, dtype = self.row_bytes, self._row_shape, self._dtype_name
        records = []
        for save, (s, e) in zip(batch.saves, batch.bounds):
            meta = dict(
                self._record_meta,
                num_tokens=str(e - s),
                request_id=save.req_id,
                num_prompt_tokens=str(save.num_prompt_tokens),
            )
            if save.record_metadata:
                meta.update(save.record_metadata)  # the scheduler refused the connector's names
            parts = [
                ("hidden_states", hidden[s * row : e * row], dtype, [e - s, *row_shape]),
                ("token_ids", token_ids[s * 8 : e * 8], "I64", [e - s]),
            ]
            if save.loss_mask is not None:
                # The scheduler's array, not the pool: the writer holds it until the record is written.
                parts.append(("loss_mask", memoryview(save.loss_mask), "U8", [e - s]))
            records.append((save.key, parts, meta, e - s))
        try:
            seqs = self._writer_call(self.writer.submit_buffers, records)
        except InvalidInputError:
            # All or none: find the bad records one by one and write the others.
            seqs = [self._submit_alone(record, save) for record, save in zip(records, batch.saves)]
        if self.counters is not None:
            self.counters.submitted(seqs, batch.saves, batch.bounds)
        for seq, (s, e) in zip(seqs, batch.bounds):
            if seq is None:
                continue
            self._region_of_seq[seq] = region
            region.records += 1
            self.stats.records_submitted += 1
            self.stats.tokens += e - s
            self.stats.bytes_submitted += (e - s) * (row + 8)
        self._copied.extend(save.req_id for save in batch.saves)
        if region.records == 0:
            self.pool.release(region)

    def _submit_alone(self, record: tuple, save: SaveRequest) -> int | None:
        try:
            return self._writer_call(self.writer.submit_buffers, [record])[0]
        except InvalidInputError as err:
            # The scheduler checked the key already; anything left is a bug worth a log line,
            # not a reason to stop the engine.
            self.stats.records_failed += 1
            logger.error("layertap: record %r of request %s not written: %s", save.key, save.req_id, err)
            return None

    def _reap(self, timeout: float | None = 0.0) -> None:
        """Returns the regions of records the writer has written (waiting up to ``timeout``
        for the first one: see ``ShardWriter.poll``)."""
        completions = self._writer_call(self.writer.poll, timeout)
        for done in completions:
            region = self._region_of_seq.pop(done.seq)
            region.records -= 1
            if region.records == 0:
                self.pool.release(region)
            self.stats.records_written += 1
        if completions and self.counters is not None:
            self.counters.written(completions)

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
                with open(error_marker_path(self.dataset, self.writer_id), "w") as f:
                    f.write(f"{type(err).__name__}: {err}\n")
            except OSError:
                pass
            raise RuntimeError(f"layertap connector: the shard writer failed: {err}") from err

    # -- sleep mode ---------------------------------------------------------------------------

    def finish_copies(self) -> None:
        """Waits for the device-to-host copies in flight and hands their records to the writer:
        afterwards nothing reads the KV cache."""
        while self._inflight:
            batch = self._inflight.popleft()
            batch.event.synchronize()
            self._submit(batch)

    def drop_cache(self) -> None:
        """Forgets the KV cache tensor (vLLM is about to free or remap it), after finishing the
        copies that read it. The pool and the writer stay: records in them go on to disk."""
        self.finish_copies()
        self.cache = None

    def use_cache(self, cache: HiddenStatesCache) -> None:
        """Takes the KV cache tensor vLLM holds after waking up. It must have the geometry the
        pool and the records were set up for."""
        if (cache.row_bytes, dtype_name(cache.dtype), cache.device) != self._geometry:
            raise RuntimeError(
                f"layertap connector: after wake-up the hidden-states cache has rows of {cache.row_bytes} "
                f"bytes of {cache.dtype} on {cache.device}; before sleep: {self._geometry}"
            )
        self.cache = cache

    # -- end ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Finishes every copy, closes the writer (all records on disk) and reclaims the pool.
        After a writer failure there is nothing left to write to."""
        if self.failed is not None:
            return
        self.finish_copies()
        self._writer_call(self.writer.close)
        self._reap()
