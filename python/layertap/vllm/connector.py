"""``LayertapConnector``, the class vLLM loads (``kv_connector_module_path: "layertap.vllm"``): it
hands each call to its scheduler half (``scheduler.py``) or worker half (``worker_side.py``).
Only the public ``KVConnectorBase_V1`` of vLLM 0.26 to 0.33; hooks a version lacks (the sleep
hooks, new in 0.33) are never called there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from layertap.vllm import registry
from layertap.vllm.config import parse_options
from layertap.vllm.metadata import LayertapMetadata
from layertap.vllm.metrics import LayertapConnectorStats, LayertapPromMetrics, stats_from_payload
from layertap.vllm.parent_watch import watch_parent
from layertap.vllm.scheduler import SchedulerSide
from layertap.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class LayertapConnector(KVConnectorBase_V1, SupportsHMA):
    """Writes the cached hidden states into layertap shards, one record per finished request."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        options = parse_options(self._kv_transfer_config.kv_connector_extra_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(vllm_config, kv_cache_config, options)
            watch_parent()  # in vLLM's engine-core process: stop it if the one that started it dies
        else:
            self._worker = WorkerSide(vllm_config, kv_cache_config, options)

    # -- both sides ---------------------------------------------------------------------------

    def get_finished_count(self) -> int:
        """Only TP rank 0 reports a request's blocks free, so the scheduler waits for one."""
        return 1

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # Token-major: one token's layers are contiguous, so the gather reads whole rows. The
        # gather works with any layout; backends that cannot do this one drop the preference.
        return "NHD"

    def shutdown(self) -> None:
        if self._worker is not None:
            # An in-process engine stops stepping before the scheduler half hands over the
            # counts of its last step; its statistics take them from the registry.
            self._worker.stats.take_not_saved(registry.not_saved_totals(self._worker.facts.engine_id))
            self._worker.shutdown()

    # -- metrics (docs/CONNECTOR.md, "Metrics") -----------------------------------------------

    def get_kv_connector_stats(self) -> LayertapConnectorStats | None:
        if self._worker is not None:
            data = self._worker.metrics_report()
        elif self._scheduler is not None:
            data = self._scheduler.stats.report()
        else:
            data = None
        return None if data is None else LayertapConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> LayertapConnectorStats:
        return stats_from_payload(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> LayertapPromMetrics:
        return LayertapPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- sleep mode (vLLM >= 0.33) ------------------------------------------------------------

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return True

    def unregister_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.restore_kv_caches()

    # -- scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # writes only, never loads

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        # Only called for single-group caches (vLLM without the hybrid allocator).
        return self._scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output.finished_sending)
            stats = getattr(connector_output, "kv_connector_stats", None)
            if stats is not None:
                self._scheduler.stats.worker_report(getattr(stats, "data", None))

    def has_pending_block_frees(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        """Keeps the engine stepping while records are written, so their completion is seen."""
        return self._scheduler is not None and self._scheduler.stats.writing()

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # the hidden states are read once a request has finished (get_finished)

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Once per step, forward or not: saves what the scheduler handed over, reports freed blocks."""
        if self._worker is None:
            return None, None
        metadata = self._connector_metadata if isinstance(self._connector_metadata, LayertapMetadata) else None
        if metadata is not None and metadata.not_saved is not None:
            self._worker.stats.take_not_saved(metadata.not_saved)
        return self._worker.get_finished(metadata), None

    def layertap_stats(self) -> dict | None:
        """The worker half's statistics (None on the scheduler and TP ranks > 0)."""
        if self._worker is None or self._worker.saver is None:
            return None
        return self._worker.summary()
