"""A KV connector that frees every request's blocks at once and writes nothing: with vLLM's
`extract_hidden_states` method it measures what the method itself costs (the floor every
hidden-states connector sits on), the `noop` mode of bench_extract.py."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)


class NoopConnector(KVConnectorBase_V1, SupportsHMA):
    # Scheduler side: nothing to load, nothing kept.
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        return False, None

    # Worker side: every hook returns at once.
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        return None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
