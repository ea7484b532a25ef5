"""How the hot path hands a step's records, lying in a pool region, to the writer, and learns
which regions it no longer needs. Both take a ``StepSaves`` and absolute offsets in the pool.

- ``NativeSink``: a few calls into Rust per step whatever the number of records
  (``_native.NativeRegionSink``: ids, indices and metadata filled there, regions back as soon as
  their records are encoded).
- ``BufferSink``: byte views of the region through ``submit_buffers``, a region back once all its
  records are written; ``compress_on="gpu"`` hands its exp-huf blocks this way.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from layertap._spec.record import (
    DTYPE,
    HIDDEN_STATES,
    LAYER_IDS,
    LOSS_MASK,
    MODEL,
    NUM_PROMPT_TOKENS,
    NUM_TOKENS,
    REQUEST_ID,
    TOKEN_IDS,
)
from layertap._tensors import dtype_name
from layertap._writer_protocol import RecordSink
from layertap.errors import InvalidInputError
from layertap.vllm.engine_facts import EngineFacts
from layertap.vllm.gather import HiddenStatesCache
from layertap.vllm.metadata import StepSaves
from layertap.vllm.pool import HostPool, Region

logger = logging.getLogger("vllm.layertap")  # under vLLM's logging configuration


def record_template(facts: EngineFacts, cache: HiddenStatesCache) -> dict[str, str]:
    """The metadata every record of this engine carries."""
    return {
        LAYER_IDS: json.dumps(list(facts.layer_ids)),
        MODEL: facts.model,
        DTYPE: str(cache.dtype).removeprefix("torch."),
    }


class NativeSink:
    def __init__(self, writer: Any, pool: HostPool, cache: HiddenStatesCache, facts: EngineFacts):
        from layertap._native import NativeRegionSink

        steps, layer_rows = cache.row_layout()
        self._native = NativeRegionSink(
            writer.native,
            pool.buffer.numpy(),
            dtype=dtype_name(cache.dtype),
            row_shape=[cache.num_layers, cache.hidden_size],
            metadata=record_template(facts, cache),
            block_size=cache.block_size,
            tensor_block_size=cache.tensor_block_size,
            row_steps=steps,
            layer_rows=layer_rows,
        )

    def fill(self, saves: StepSaves, ids_offset: int, index_offset: int) -> None:
        self._native.fill(ids_offset, index_offset, saves.token_ids, saves.num_tokens, saves.block_ids)

    def submit(self, region: Region, ids_offset: int, saves: StepSaves) -> list[tuple[int, str]]:
        return self._native.submit(
            region.id,
            region.offset,
            region.nbytes,
            region.offset,
            ids_offset,
            saves.keys,
            saves.req_ids,
            saves.num_tokens,
            saves.num_prompt_tokens,
            saves.extras,
        )

    def reap(self, timeout: float | None = 0.0) -> tuple[list[int], int]:
        return self._native.reap(timeout)

    def use_cache(self, cache: HiddenStatesCache | None) -> None:
        """The native sink holds the layout only, unchanged across sleep."""


class BufferSink:
    """Records as byte views of the pool (ids and indices filled by a ``NativeSink``)."""

    def __init__(self, writer: RecordSink, pool: HostPool, cache: HiddenStatesCache, facts: EngineFacts):
        self.writer = writer
        self._pool = memoryview(pool.buffer.numpy())
        self._template = record_template(facts, cache)
        self._dtype = dtype_name(cache.dtype)
        self._row_shape = [cache.num_layers, cache.hidden_size]
        self._region_of_seq: dict[int, Region] = {}
        self._released: list[int] = []

    def records(self, region: Region, ids_offset: int, saves: StepSaves, hidden: list[tuple[int, int]]) -> list:
        """A batch's ``submit_buffers`` records; ``hidden``: each one's exp-huf block (offset, length)."""
        pool = self._pool
        records = []
        at = 0
        for i, (key, req_id, n, prompt) in enumerate(
            zip(saves.keys, saves.req_ids, saves.num_tokens, saves.num_prompt_tokens)
        ):
            meta = {**self._template, NUM_TOKENS: str(n), REQUEST_ID: req_id, NUM_PROMPT_TOKENS: str(prompt)}
            t = ids_offset + at * 8
            h, length = hidden[i]
            states = (HIDDEN_STATES, pool[h : h + length], self._dtype, [n, *self._row_shape], "exp-huf")
            parts = [states, (TOKEN_IDS, pool[t : t + n * 8], "I64", [n])]
            extras = saves.extras.get(i)
            if extras is not None:
                if extras[0]:
                    meta.update(extras[0])  # the scheduler refused the connector's names
                if extras[1] is not None:
                    parts.append((LOSS_MASK, memoryview(extras[1]), "U8", [n]))
            records.append((key, parts, meta, n))
            at += n
        return records

    def hand_over(self, region: Region, records: list) -> list[tuple[int, str]]:
        """Submits ``records``; returns ``(index, reason)`` of those the writer refused."""
        failures: list[tuple[int, str]] = []
        try:
            seqs: list[int | None] = list(self.writer.submit_buffers(records))
        except InvalidInputError:
            # All or none: find the bad records one by one and write the others.
            seqs = []
            for i, record in enumerate(records):
                try:
                    seqs.append(self.writer.submit_buffers([record])[0])
                except InvalidInputError as err:
                    failures.append((i, str(err)))
                    seqs.append(None)
        for seq in seqs:
            if seq is not None:
                self._region_of_seq[seq] = region
                region.records += 1
        if region.records == 0:
            self._released.append(region.id)
        return failures

    def reap(self, timeout: float | None = 0.0) -> tuple[list[int], int]:
        done = self.writer.poll(timeout) if self._region_of_seq else []
        for c in done:
            region = self._region_of_seq.pop(c.seq)
            region.records -= 1
            if region.records == 0:
                self._released.append(region.id)
        released, self._released = self._released, []
        return released, len(done)

    def use_cache(self, cache: HiddenStatesCache | None) -> None:
        """The records are views of the pool only."""
