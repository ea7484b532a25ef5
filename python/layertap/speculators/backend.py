"""The ``layertap`` hidden-states backend of speculators: ``LayertapBackend`` (the
``hs_connectors.HiddenStatesBackend`` hooks) and ``LayertapTransfer`` (what the training
dataset calls for each sample).

speculators' training dataset asks the transfer for row ``i`` of the prepared dataset
(``get_cached(i)``), falls back to asking a running vLLM for that row when it gets ``None``
(``--on-missing generate``) and reads the result with ``get_generated(kv_transfer_params)``.
Both return ``{"hidden_states": [tokens, layers, hidden], "token_ids": int64 [tokens]}`` (a record
stored as fp8 dequantized to bfloat16, as speculators' fp8 backend returns its own); the
dataset drops a sample whose ``token_ids`` differ from the row's ``input_ids`` and takes
``hidden_states[:, :-1]`` as the auxiliary states and ``hidden_states[:, -1]`` as the verifier's
last hidden state.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch
from hs_connectors import HiddenStatesBackend, HiddenStatesTransfer
from hs_connectors.fp8_utils import dequantize_fp8_tensor

from layertap._checks import json_object
from layertap.errors import FormatError, InvalidInputError
from layertap.fp8 import SCALE_NAME
from layertap.reader import open as open_dataset

logger = logging.getLogger("layertap.speculators")

#: How long ``get_generated`` waits for the server's writer, unless --layertap-fetch-timeout.
DEFAULT_FETCH_TIMEOUT = 300.0
#: The connector class and module that ``build_kv_transfer_config`` names.
CONNECTOR_CLASS = "LayertapSpeculatorsConnector"
CONNECTOR_MODULE = "layertap.speculators.connector"


def _add_argument(parser: argparse.ArgumentParser, *flags: str, **kwargs: Any) -> None:
    """Adds an option unless another backend already did (``--hidden-states-path`` is shared
    with speculators' file backends, so switching backends keeps the rest of a command line)."""
    try:
        parser.add_argument(*flags, **kwargs)
    except argparse.ArgumentError:
        pass


def _record_tensors(record: Any, where: str) -> dict:
    hidden, token_ids = record.hidden_states, record.token_ids
    if hidden is None or token_ids is None:
        raise InvalidInputError(f"{where}: record {record.key!r} has no hidden_states or no token_ids tensor")
    if hidden.dim() != 3 or token_ids.dim() != 1 or hidden.shape[0] != token_ids.shape[0]:
        raise InvalidInputError(
            f"{where}: record {record.key!r} has hidden_states {list(hidden.shape)} and token_ids "
            f"{list(token_ids.shape)}; expected [tokens, layers, hidden] and [tokens]"
        )
    scale = record.tensors.get(SCALE_NAME)
    if scale is not None:
        # A dataset stored as fp8 (docs/FP8.md) is handed over as speculators' fp8 backend hands
        # its own: dequantized to bfloat16 by hs-connectors' function, so a drafter trains on the
        # same values from either.
        hidden = dequantize_fp8_tensor(hidden, scale.reshape(-1, *([1] * (hidden.dim() - 1))), dtype=torch.bfloat16)
    return {"hidden_states": hidden, "token_ids": token_ids}


class LayertapTransfer(HiddenStatesTransfer):
    """Serves row ``i`` from the record with key ``str(i)`` of a layertap dataset, and
    generated samples with ``layertap.vllm.fetch``.

    Pickled into each DataLoader worker (speculators spawns them): the dataset is opened in
    the process that reads, on its first read, and the open dataset is never pickled."""

    def __init__(
        self, dataset_path: str | None, fetch_timeout: float = DEFAULT_FETCH_TIMEOUT, reader_backend: str = "auto"
    ):
        #: The layertap dataset of cached rows; None: every row is generated.
        self.dataset_path = dataset_path
        self.fetch_timeout = fetch_timeout
        self.reader_backend = reader_backend
        self._dataset: Any = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_dataset"] = None
        return state

    def _open(self) -> Any:
        if self._dataset is None and self.dataset_path is not None:
            self._dataset = open_dataset(self.dataset_path, backend=self.reader_backend, tensors="torch")
        return self._dataset

    def get_cached(self, file_idx: int) -> dict | None:
        dataset = self._open()
        if dataset is None:
            return None
        record = dataset.get(str(int(file_idx)))
        if record is None:
            return None
        return _record_tensors(record, self.dataset_path)

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict | None:
        from layertap.vllm import fetch

        # Training needs the tensors, not the durability a client keeping the record would want.
        record = fetch(hs_transfer_params, timeout=self.fetch_timeout, durable=False)
        return _record_tensors(record, record.shard)

    def delete(self, handle: str) -> None:
        """Nothing to delete: layertap's shards are append-only, so the generated record stays
        in the server's dataset (under vLLM's request id)."""

    def close(self) -> None:
        if self._dataset is not None:
            self._dataset.close()
            self._dataset = None


def check_dataset(path: str, explicit: bool, reader_backend: str = "auto") -> str | None:
    """The dataset of cached rows to read, checked up front so that a wrong path fails at
    start-up with one line instead of in a DataLoader worker: ``path`` when it holds shards;
    None (with a warning) when the default path does not exist; ``FileNotFoundError`` or
    ``ValueError`` otherwise."""
    if not path.startswith("mooncake://") and not os.path.exists(path):
        if explicit:
            raise FileNotFoundError(
                f"--hidden-states-path {path}: no such layertap dataset; write it with layertap generate "
                "(docs/TRAINING.md, step 2), or leave the option out to have every row generated (--on-missing)"
            )
        logger.warning(
            "layertap backend: no dataset at %s (the default, data path / 'hidden_states'): every "
            "sample's hidden states come from --on-missing",
            path,
        )
        return None
    try:
        with open_dataset(path, backend=reader_backend) as ds:
            count = len(ds)
    except FormatError as e:
        hint = ""
        if os.path.isdir(path) and any(n.startswith("hs_") and n.endswith(".safetensors") for n in os.listdir(path)):
            hint = "; it holds hs_*.safetensors files, the 'file' backend's layout: pass --hidden-states-backend file"
        raise InvalidInputError(f"--hidden-states-path {path} is not a layertap dataset: {e}{hint}") from None
    logger.info("layertap backend: %d cached records in %s", count, path)
    return path


class LayertapBackend(HiddenStatesBackend):
    """speculators' hidden states from layertap datasets (``--hidden-states-backend layertap``)."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        _add_argument(
            parser,
            "--hidden-states-path",
            type=str,
            default=None,
            help="The path where cached hidden states files are stored. (Default: args.data_path / 'hidden_states')",
        )
        _add_argument(
            parser,
            "--layertap-fetch-timeout",
            type=float,
            default=DEFAULT_FETCH_TIMEOUT,
            help="layertap backend: seconds to wait for the record of a sample generated by the "
            f"vLLM server (default {DEFAULT_FETCH_TIMEOUT:g})",
        )

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        _add_argument(
            parser,
            "--hidden-states-path",
            type=str,
            default="/tmp/hidden_states",
            help="The directory to save hidden states to. Default '/tmp/hidden_states'",
        )
        _add_argument(
            parser,
            "--layertap-codec",
            choices=["none", "zstd", "bp16-zstd"],
            default="bp16-zstd",
            help="layertap backend: the codec of the shards (default bp16-zstd)",
        )
        _add_argument(
            parser,
            "--layertap-options",
            type=str,
            default="{}",
            help="layertap backend: other connector options as a JSON object (docs/CONNECTOR.md)",
        )

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> LayertapTransfer:
        explicit = getattr(args, "hidden_states_path", None)
        path = explicit or os.path.join(data_path, "hidden_states")
        timeout = getattr(args, "layertap_fetch_timeout", DEFAULT_FETCH_TIMEOUT)
        return LayertapTransfer(check_dataset(path, explicit=bool(explicit)), fetch_timeout=timeout)

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        extra = json_object("--layertap-options", getattr(args, "layertap_options", None) or None)
        options = {"codec": getattr(args, "layertap_codec", "bp16-zstd"), **extra}
        options["output_dir"] = os.path.abspath(args.hidden_states_path)
        return {
            "kv_connector": CONNECTOR_CLASS,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": options,
        }


__all__ = ["LayertapBackend", "LayertapTransfer", "check_dataset"]
