"""The worker half of the connector: owns the host pool, the shard writer and the hot path
(``transfer.py``), on tensor-parallel rank 0 only; the other ranks do nothing."""

from __future__ import annotations

import logging
import time
from typing import Any

from layertap._sink import RecordSink
from layertap.vllm import registry
from layertap.vllm.config import ConfigError, ConnectorOptions, default_pool_bytes, writer_options_for
from layertap.vllm.engine import EngineFacts, read_engine_facts
from layertap.vllm.gather import HiddenStatesCache
from layertap.vllm.metadata import LayertapMetadata
from layertap.vllm.pool import HostPool
from layertap.vllm.stats import ConnectorStats, describe, write_json
from layertap.vllm.transfer import HiddenStatesSaver, region_bytes

logger = logging.getLogger("vllm.layertap")  # under vLLM's logging configuration


def open_writer(options: ConnectorOptions, facts: EngineFacts, pool_bytes: int, dtype: str | None = None) -> RecordSink:
    """The shard writer the options ask for, with what the connector adds to the shard header
    (``dtype``: the hidden states' dtype, as torch names it, when known)."""
    import json

    if options.writer == "python":
        from layertap import PyShardWriter as writer_class
    else:
        from layertap import ShardWriter as writer_class
    shard_meta = {"source": "layertap.vllm", "model": facts.model, "layer_ids": json.dumps(list(facts.layer_ids))}
    if dtype is not None:
        shard_meta["dtype"] = dtype
    writer_options = writer_options_for(options, facts.writer_id, pool_bytes, shard_meta)
    try:
        return writer_class(options.output_dir, options=writer_options)
    except ImportError as e:  # the Rust writer without its compiled extension
        raise ConfigError(
            "writer", f"the Rust writer is not available ({e}); build the extension or use writer='python'"
        ) from e


class WorkerSide:
    """Everything the connector does in a worker process."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, options: ConnectorOptions):
        self.options = options
        self.facts = read_engine_facts(vllm_config, kv_cache_config, options)
        self.vllm_config = vllm_config
        self.stats = ConnectorStats()
        self.saver: HiddenStatesSaver | None = None
        self._closed = False

    # -- start-up -----------------------------------------------------------------------------

    def _hidden_states_layer(self, kv_caches: dict) -> str:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        names = list(get_layers_from_vllm_config(self.vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(names) != 1:
            if self.options.capture == "in-model":
                from layertap.vllm.models import missing_cache_layer

                raise missing_cache_layer(self.vllm_config.model_config.architectures, names)
            raise ConfigError(
                "speculative_config",
                f"expected one extract_hidden_states cache layer among the KV caches, found {names}",
            )
        return names[0]

    def register_kv_caches(self, kv_caches: dict) -> None:
        """Finds the hidden-states cache; on TP rank 0 allocates the pool and opens the writer."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() != 0:
            return
        facts = self.facts
        name = self._hidden_states_layer(kv_caches)
        cache = HiddenStatesCache(kv_caches[name], len(facts.layer_ids), facts.hidden_size, facts.block_size)
        largest = region_bytes(facts.max_model_len, cache)
        pool_bytes = self.options.pool_bytes or default_pool_bytes(
            largest, region_bytes(facts.max_num_batched_tokens, cache)
        )
        if pool_bytes < largest:
            raise ConfigError(
                "pool_bytes",
                f"{pool_bytes} bytes cannot hold the largest possible request: max_model_len "
                f"{facts.max_model_len} x {cache.num_layers} layers x hidden {cache.hidden_size} x "
                f"{cache.dtype.itemsize} bytes ({str(cache.dtype).removeprefix('torch.')}), plus token ids "
                f"and gather indices, needs {largest} bytes; raise pool_bytes or lower max_model_len",
            )
        pool = HostPool(pool_bytes, pin=cache.is_cuda)
        writer = open_writer(self.options, facts, pool_bytes, str(cache.dtype).removeprefix("torch."))
        self.saver = HiddenStatesSaver(cache, writer, pool, facts, self.stats, self.options.output_dir)
        logger.info(
            "layertap: writing hidden states of layers %s (%s, cache %s strides %s, token axis %d, "
            "block %d/%d, gather by %s) to %s as writer %s (%s writer, %s; pool %.0f MiB%s)",
            list(facts.layer_ids),
            str(cache.dtype).removeprefix("torch."),
            list(cache.kv.shape),
            list(cache.kv.stride()),
            cache.axis,
            cache.tensor_block_size,
            facts.block_size,
            "rows" if cache.by_rows else "blocks",
            self.options.output_dir,
            facts.writer_id,
            self.options.writer,
            writer.backend,
            pool_bytes / 2**20,
            " pinned" if pool.pinned else "",
        )

    # -- every step ---------------------------------------------------------------------------

    def get_finished(self, metadata: Any) -> set[str] | None:
        """Starts saving the requests of ``metadata`` and returns those whose KV blocks may be
        freed now. Times itself: this is the connector's work on the engine thread."""
        saver = self.saver
        if saver is None:
            return None
        t0 = time.perf_counter()
        if isinstance(metadata, LayertapMetadata) and metadata.saves:
            saver.start(metadata.saves)
        done = saver.collect()
        self.stats.hook.add(time.perf_counter() - t0)
        return set(done) if done else None

    # -- end ----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Saves what an in-process scheduler still holds, writes everything, closes the writer,
        and reports the statistics."""
        if self._closed:
            return
        self._closed = True
        saver = self.saver
        if saver is None:
            return
        try:
            # An in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) stops stepping when its last
            # outputs are returned, before the scheduler hands the last finished requests over;
            # their blocks are still held, so save them from here.
            leftover = registry.take_unsent(self.facts.engine_id)
            if leftover:
                self.stats.saved_at_shutdown += len(leftover)
                saver.start(leftover)
            saver.close()
        finally:
            self._report()

    def summary(self) -> dict:
        """The statistics as a JSON-able dict (see docs/CONNECTOR.md)."""
        saver = self.saver
        return self.stats.summary(
            pool=saver.pool if saver else None,
            writer=saver.writer if saver else None,
            extra={"writer_id": self.facts.writer_id, "output_dir": self.options.output_dir},
        )

    def _report(self) -> None:
        summary = self.summary()
        logger.info("layertap: %s", describe(summary))
        if self.options.stats_path:
            write_json(self.options.stats_path, summary)
