"""The worker half of the connector: owns the host pool, the shard writer and the hot path
(``hidden_states_saver.py``), on tensor-parallel rank 0 only; the other ranks do nothing."""

from __future__ import annotations

import logging
import time
from typing import Any

from layertap._spec.record import LAYER_IDS
from layertap._writer_protocol import RecordSink
from layertap.vllm import gpu_compress, registry
from layertap.vllm.config import (
    ConfigError,
    ConnectorOptions,
    default_pool_bytes,
    writer_options_for,
)
from layertap.vllm.engine_facts import EngineFacts, read_engine_facts
from layertap.vllm.errors import ConnectorError
from layertap.vllm.gather import HiddenStatesCache
from layertap.vllm.hidden_states_saver import HiddenStatesSaver, region_bytes
from layertap.vllm.metadata import LayertapMetadata, StepSaves
from layertap.vllm.mooncake_forwarder import Forwarder, connect_store
from layertap.vllm.pool import HostPool
from layertap.vllm.stats import WorkerStats, describe, write_json
from layertap.vllm.threads import lower_encoder_priority

logger = logging.getLogger("vllm.layertap")  # under vLLM's logging configuration


def open_writer(options: ConnectorOptions, facts: EngineFacts, pool_bytes: int, dtype: str | None = None) -> RecordSink:
    """The shard writer the options ask for, with the connector's shard metadata."""
    import json

    shard_meta = {"source": "layertap.vllm", "model": facts.model, LAYER_IDS: json.dumps(list(facts.layer_ids))}
    if dtype is not None:
        shard_meta["dtype"] = dtype
    writer_options = writer_options_for(options, facts.writer_id, pool_bytes, shard_meta)

    try:
        from layertap.writer import ShardWriter

        return ShardWriter(options.output_dir, options=writer_options)
    except ImportError as e:  # the compiled extension is not built
        raise ConfigError(
            "writer",
            f"the Rust writer is not available: the native extension is not built ({e}); build it (make build)",
        ) from e


class WorkerSide:
    """Everything the connector does in a worker process."""

    def __init__(
        self, vllm_config: Any, kv_cache_config: Any, options: ConnectorOptions, facts: EngineFacts | None = None
    ):
        self.vllm_config = vllm_config
        self.options = options
        self.facts = facts or read_engine_facts(vllm_config, kv_cache_config, options)
        self.stats = WorkerStats(self.facts.writer_id)
        self.saver: HiddenStatesSaver | None = None
        self.compress_on = options.compress_on
        """Where records are compressed: the option, or "host" where "gpu" cannot run."""
        self._cache_layer: str | None = None
        """Name of the hidden-states cache layer (to find its tensor again after sleep)."""
        self._asleep = False
        self._closed = False
        self.forwarder: Forwarder | None = None

    @classmethod
    def from_facts(cls, facts: EngineFacts, options: ConnectorOptions) -> WorkerSide:
        """Without a vLLM configuration (benchmarks, tests): ``open_cache`` then ``get_finished``."""
        return cls(None, None, options, facts)

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
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() != 0:
            return
        self._cache_layer = self._hidden_states_layer(kv_caches)
        self.open_cache(kv_caches[self._cache_layer])

    def _cache(self, kv: Any) -> HiddenStatesCache:
        facts = self.facts
        return HiddenStatesCache(kv, len(facts.layer_ids), facts.hidden_size, facts.block_size)

    def open_cache(self, kv: Any) -> None:
        import vllm.envs as envs

        facts, options = self.facts, self.options
        cache = self._cache(kv)
        if self.compress_on == "gpu":
            why_not = gpu_compress.runs_here(cache)
            if why_not is not None:
                logger.warning(
                    'layertap: compress_on="gpu": %s; compressing on the host instead (same codec, exp-huf)', why_not
                )
                self.compress_on = "host"
        slack = gpu_compress.region_slack(1) if self.compress_on == "gpu" else 0
        largest = region_bytes(facts.max_model_len, cache, slack)
        pool_bytes = self.options.pool_bytes or default_pool_bytes(
            largest, region_bytes(facts.max_num_batched_tokens, cache), facts.max_num_seqs
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
        store = connect_store(options)  # before the writer: an unreachable master stops start-up
        writer = open_writer(self.options, facts, pool_bytes, str(cache.dtype).removeprefix("torch."))
        if store is not None:
            meta = {"writer": f"layertap ({writer.backend})", "user": dict(options.writer_options.metadata)}
            self.forwarder = Forwarder(store, options.output_dir, facts.writer_id, meta, options.mooncake_keep_shards)
            self.stats.store = self.forwarder.stats
        # The compression threads take the CPUs vLLM leaves idle, not the engine thread's.
        self.stats.encoder_threads_lowered = lower_encoder_priority(getattr(writer, "encoder_thread_ids", []))
        self.saver = HiddenStatesSaver(
            cache,
            writer,
            pool,
            facts,
            self.stats,
            self.options.output_dir,
            # An engine in its own process (vLLM's default) keeps stepping while the connector
            # holds blocks, so requests that find no room can wait for later steps.
            wait_when_full=not envs.VLLM_ENABLE_V1_MULTIPROCESSING,
            compress_on_gpu=self.compress_on == "gpu",
        )
        logger.info(
            "layertap: writing hidden states of layers %s (%s, cache %s strides %s, token axis %d, "
            "block %d/%d, gather by %s) to %s as writer %s (%s writer, %s, compressed on the %s; pool %.0f MiB%s)",
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
            "GPU" if self.compress_on == "gpu" else "host",
            pool_bytes / 2**20,
            " pinned" if pool.pinned else "",
        )

    # -- every step ---------------------------------------------------------------------------

    def get_finished(self, metadata: Any) -> set[str] | None:
        """Starts saving ``metadata``'s requests; returns those whose KV blocks may be freed now."""
        saver = self.saver
        if saver is None:
            return None
        if not isinstance(metadata, LayertapMetadata):
            metadata = None
        elif self._asleep:
            refused = self._refuse_while_asleep(metadata.saves)
            return refused.union(saver.collect()) or None
        elif metadata.drain_wait and not metadata.saves:
            # The engine steps only because records are being written: wait for the writer here
            # rather than spin, and do not count the wait as the connector's engine-thread time.
            return saver.collect(wait=metadata.drain_wait) or None
        t0 = time.perf_counter()
        if metadata is not None and metadata.saves:
            saver.start(metadata.saves)
        done = saver.collect()
        self.stats.step(time.perf_counter() - t0)
        return done or None

    def metrics_report(self) -> dict | None:
        saver = self.saver
        return None if saver is None else self.stats.report(saver.pool, saver.writer)

    # -- sleep mode (vLLM >= 0.33) ------------------------------------------------------------

    def unregister_kv_caches(self) -> None:
        """Before vLLM frees or remaps the KV cache (sleep): finishes every copy, forgets the tensor."""
        saver = self.saver
        if saver is None or self._asleep:
            return
        # vLLM drains the engine before it sleeps, so nothing should wait; but an in-process
        # scheduler half may still hold requests it has not handed over: copy them now, while
        # their blocks still hold their hidden states.
        leftover = registry.take_unsent(self.facts.engine_id)
        if leftover:
            saver.start(leftover)
        saver.drop_cache()
        self._asleep = True
        logger.info(
            "layertap: KV cache unregistered (sleep); %d records still being written",
            self.stats.records_submitted - self.stats.records_written,
        )

    def restore_kv_caches(self) -> None:
        saver = self.saver
        if saver is None or not self._asleep:
            return
        layer = self.vllm_config.compilation_config.static_forward_context.get(self._cache_layer)
        kv = getattr(layer, "kv_cache", None)
        if kv is None or not hasattr(kv, "shape") or kv.numel() == 0:
            raise ConnectorError(
                f"layertap connector: vLLM restored the KV caches but layer {self._cache_layer!r} has no cache tensor"
            )
        saver.use_cache(self._cache(kv))
        self._asleep = False
        logger.info("layertap: KV cache restored (wake-up)")

    def _refuse_while_asleep(self, saves: StepSaves | None) -> set[str]:
        """Requests handed over while the KV cache is unregistered (vLLM drains before sleeping, so
        none should be): their blocks' contents are gone; counted failed, blocks released."""
        if not saves:
            return set()
        self.stats.records_failed += len(saves)
        logger.error(
            "layertap: %d finished requests were handed over while the KV cache is unregistered "
            "(sleep mode); their hidden states are not saved: %s",
            len(saves),
            saves.keys[:10],
        )
        return set(saves.req_ids)

    # -- end ----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Saves what an in-process scheduler still holds, writes everything, reports the statistics."""
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
                saver.wait_when_full = True
                saver.start(leftover)
            saver.close()
            if self.forwarder is not None:
                self.forwarder.close()
        finally:
            self._report()

    def summary(self) -> dict:
        saver = self.saver
        return self.stats.summary(
            pool=saver.pool if saver else None,
            writer=saver.writer if saver else None,
            extra={
                "writer_id": self.facts.writer_id,
                "output_dir": self.options.output_dir,
                "compress_on": self.compress_on,
                **({"gpu_compress": saver.compressor.summary()} if saver and saver.compressor else {}),
                **({"mooncake": dict(self.forwarder.stats)} if self.forwarder is not None else {}),
            },
        )

    def _report(self) -> None:
        summary = self.summary()
        logger.info("layertap: %s", describe(summary))
        if self.options.stats_path:
            write_json(self.options.stats_path, summary)
