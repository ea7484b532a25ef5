"""The connector a vLLM server for speculators runs: layertap's, with the ``handle`` speculators
looks for in a response.

speculators' client (``speculators.data_generation.vllm_client.extract_output``) refuses a
response whose ``kv_transfer_params`` has neither ``hidden_states_path`` nor ``handle`` at its
top level; layertap's connector answers ``{"layertap": {...}}``. This subclass adds
``"handle"`` (the record key) beside it, and changes nothing else. Imported by vLLM only.
"""

from __future__ import annotations

from typing import Any

from layertap.vllm.connector import LayertapConnector
from layertap.vllm.online import PARAMS_KEY


def _with_handle(result: tuple[bool, dict[str, Any] | None]) -> tuple[bool, dict[str, Any] | None]:
    delay, params = result
    if params is not None:
        key = params.get(PARAMS_KEY, {}).get("key")
        if key is not None:  # requests the connector refused keep the error alone
            params = {**params, "handle": key}
    return delay, params


class LayertapSpeculatorsConnector(LayertapConnector):
    """``LayertapConnector`` whose responses also carry ``"handle"`` (the record key)."""

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return _with_handle(super().request_finished(request, block_ids))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return _with_handle(super().request_finished_all_groups(request, block_ids))


__all__ = ["LayertapSpeculatorsConnector"]
