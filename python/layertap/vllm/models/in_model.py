"""Capture in the model (``capture="in-model"``): the model class caches the hidden states
itself, without vLLM's speculative method.

vLLM's ``extract_hidden_states`` caches them through a draft "model" owning one cache-only
attention layer, run as a speculative step: every decode step schedules a second, discarded token
per request, then the draft forward and the rejection sampler; and its layer holds the engine to
piecewise CUDA graphs. Here the target model owns that layer, under the method's name
(``cache_only_layers.{N}``), and writes the recorded layers into it at the end of its forward,
from the slot mapping vLLM computes for every KV-cache group: one token per request per decode
step, and the connector reads the same cache as with the method.

``in_model_class(arch)`` is vLLM's class (with ``classes.py``'s EAGLE-3 interface where vLLM's
lacks it) plus ``InModelCacheMixin``, which does this when its configuration asks
(``config.in_model_layer_ids``) and nothing otherwise. The classes live in this module under the
architecture's name (pickled by reference). Importing this module imports vLLM.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any

import torch
from torch import nn
from vllm.model_executor.models.extract_hidden_states import (
    CacheOnlyAttentionBackend,
    CacheOnlyAttentionLayer,
    CacheOnlyAttentionMetadataBuilder,
)
from vllm.v1.attention.backend import AttentionCGSupport

from layertap.vllm.config import ConfigError, in_model_layer_ids, refuse_speculation
from layertap.vllm.engine_facts import check_layer_ids
from layertap.vllm.models.classes import StreamCaptureOwner, with_aux_hidden_states
from layertap.vllm.models.families import FAMILIES, IN_MODEL_FAMILIES


class GraphSafeCacheOnlyBuilder(CacheOnlyAttentionMetadataBuilder):
    """vLLM's cache-only metadata builder, declaring that full CUDA graphs may replay it.

    The cache write reads not this metadata but the forward context's slot mapping, which the
    model runner keeps in persistent buffers (padded with -1: the null block) as full graphs need.
    vLLM's builder declares ``NEVER``, which turns the whole engine's ``FULL_AND_PIECEWISE`` into
    ``PIECEWISE``; with this one the engine keeps the mode it would have without extraction."""

    _cudagraph_support = AttentionCGSupport.ALWAYS


class GraphSafeCacheOnlyBackend(CacheOnlyAttentionBackend):
    @staticmethod
    def get_builder_cls() -> type[GraphSafeCacheOnlyBuilder]:
        return GraphSafeCacheOnlyBuilder


class HiddenStatesCacheLayer(CacheOnlyAttentionLayer):
    """vLLM's cache-only layer (``num_heads``: layers, ``head_size``: hidden) on the graph-safe backend."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.attn_backend = GraphSafeCacheOnlyBackend

    def get_attn_backend(self) -> type[GraphSafeCacheOnlyBackend]:
        return GraphSafeCacheOnlyBackend


class InModelCacheMixin(StreamCaptureOwner):
    """Caches the residual stream at the configured layer ids into a cache-only layer of its own."""

    def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        kv_transfer = vllm_config.kv_transfer_config
        ids = None if kv_transfer is None else in_model_layer_ids(kv_transfer.kv_connector_extra_config)
        if ids is not None:
            self._layertap_start_caching(vllm_config, prefix, ids)

    def _layertap_start_caching(self, vllm_config: Any, prefix: str, ids: tuple[int, ...]) -> None:
        from vllm.distributed import get_pp_group
        from vllm.model_executor.models.utils import maybe_prefix

        refuse_speculation(vllm_config.speculative_config)
        if get_pp_group().world_size > 1:
            raise ConfigError("capture", '"in-model" with pipeline parallelism is not supported')
        capture = self._layertap_capture()
        num_layers = vllm_config.model_config.get_total_num_hidden_layers()
        check_layer_ids(ids, num_layers, "layer_ids")
        capture.set_layers(ids)
        # The hidden states are stored in the model's dtype, whatever the KV cache's.
        cache_config = vllm_config.cache_config
        if cache_config is not None and cache_config.cache_dtype != "auto":
            cache_config = dataclasses.replace(cache_config, cache_dtype="auto")
        layer = HiddenStatesCacheLayer(
            num_heads=len(capture.layer_ids),
            head_size=vllm_config.model_config.get_hidden_size(),
            cache_config=cache_config,
            prefix=maybe_prefix(prefix, f"cache_only_layers.{num_layers}"),
        )
        # Under the method's name: the connector and vLLM's KV-cache grouping find it as theirs.
        self.cache_only_layers = nn.ModuleDict({str(num_layers): layer})
        self.__dict__["_layertap_cache_layer"] = layer  # a plain attribute: registered once, above

    def _layertap_forward(self, inner_forward: Any, outer_forward: Any, args: tuple, kwargs: dict) -> Any:
        layer = self.__dict__.get("_layertap_cache_layer")
        if layer is None:
            return outer_forward(self, *args, **kwargs)
        capture = self._layertap_capture()
        capture.tensors = []
        hidden_states = inner_forward(self, *args, **kwargs)
        # [tokens, layers, hidden]: one cache row per token. Padded tokens (CUDA graphs) have slot
        # -1, which the write sends to the null block.
        layer(torch.stack(capture.take(), dim=1))
        return hidden_states


@functools.cache
def in_model_class(arch: str) -> type:
    family = IN_MODEL_FAMILIES.get(arch)
    if family is None:
        raise AttributeError(f"layertap plugin: no in-model capture for architecture {arch!r}")
    vllm_class = getattr(importlib.import_module(f"vllm.model_executor.models.{family.module}"), family.class_name)
    parent = with_aux_hidden_states(arch) if arch in FAMILIES else vllm_class
    inner_forward = vllm_class.forward
    outer_forward = parent.forward

    # vLLM inspects the model's forward for the keyword arguments it may pass.
    @functools.wraps(inner_forward)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self._layertap_forward(inner_forward, outer_forward, args, kwargs)

    namespace = {
        "forward": forward,
        "__module__": __name__,
        "__qualname__": arch,
        "__doc__": f"vLLM's {vllm_class.__module__}.{vllm_class.__qualname__} that can cache its hidden states "
        "itself (layertap plugin, capture='in-model').",
        "_layertap_family": family,
    }
    return type(arch, (InModelCacheMixin, parent), namespace)


def __getattr__(name: str) -> type:
    # Pickle finds the classes by module and name.
    if name in IN_MODEL_FAMILIES:
        return in_model_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
