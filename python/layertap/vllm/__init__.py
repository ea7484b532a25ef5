"""layertap's vLLM connector and the online fetch API.

Configure vLLM with ``kv_connector_module_path: "layertap.vllm"`` and ``kv_connector:
"LayertapConnector"`` (docs/CONNECTOR.md). ``layertap.vllm.fetch`` reads the record of a finished
request from its response's ``kv_transfer_params``; it does not import vLLM, and neither does
importing this package: vLLM's modules are loaded only when vLLM asks for the connector class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from layertap.vllm.online import RecordLocation, fetch, record_location

if TYPE_CHECKING:
    from layertap.vllm.connector import LayertapConnector


def __getattr__(name: str) -> Any:
    if name == "LayertapConnector":
        from layertap.vllm.connector import LayertapConnector

        return LayertapConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LayertapConnector", "RecordLocation", "fetch", "record_location"]
