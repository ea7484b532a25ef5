"""Capture in the model: the model class caches the hidden states itself, without vLLM's
speculative method (connector option ``capture="in-model"``).

vLLM's ``extract_hidden_states`` caches the hidden states through a draft "model" that owns one
cache-only attention layer (``CacheOnlyAttentionLayer``, a ``HiddenStateCacheSpec`` KV-cache group),
run as a speculative step: every decode step schedules two tokens per request (its token and a
draft that is thrown away), then runs the draft forward and the rejection sampler. Its layer also
holds the engine to piecewise CUDA graphs (it declares no full-graph support).

Here the target model owns that layer, under the name the method gives it
(``cache_only_layers.{N}``), and writes the recorded layers into it at the end of its own forward,
from the slot mapping vLLM computes for every KV-cache group. No speculative configuration: a
decode step schedules one token per request and nothing runs after the model. vLLM allocates,
caches (prefix caching) and frees that group's blocks like any other, and the connector reads the
same cache as with the method.

``in_model_class(arch)`` is vLLM's class for ``arch`` (with the EAGLE-3 interface added by
``classes.py`` where vLLM's lacks it) plus ``InModelCacheMixin``: when the vLLM configuration it is
built with asks for it (``kv_connector_extra_config`` with ``capture="in-model"`` and ``layer_ids``,
read by ``layertap.vllm.config.in_model_layer_ids``), it puts the plugin's hooks on its decoder
layers (``capture.py``) and owns the cache-only layer; otherwise it is the class it extends. The
classes live in this module under the architecture's name (pickled by reference). Importing this
module imports vLLM.
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

from layertap.vllm.config import ConfigError, in_model_layer_ids
from layertap.vllm.models.classes import StreamCaptureOwner, with_aux_hidden_states
from layertap.vllm.models.families import FAMILIES, IN_MODEL_FAMILIES


class GraphSafeCacheOnlyBuilder(CacheOnlyAttentionMetadataBuilder):
    """vLLM's cache-only metadata builder, declaring that full CUDA graphs may replay it.

    The cache write does not read this metadata: it reads the forward context's slot mapping,
    which the model runner keeps in persistent buffers (padded with -1, which the write sends to
    the null block) for every KV-cache group, as full graphs need for the attention layers' own
    cache writes. vLLM's builder declares no support (``NEVER``), which turns the whole engine's
    ``FULL_AND_PIECEWISE`` into ``PIECEWISE`` (decode steps replay many small graphs instead of
    one); with this one the engine keeps the mode it would have without extraction."""

    _cudagraph_support = AttentionCGSupport.ALWAYS


class GraphSafeCacheOnlyBackend(CacheOnlyAttentionBackend):
    """vLLM's cache-only backend with ``GraphSafeCacheOnlyBuilder``."""

    @staticmethod
    def get_builder_cls() -> type[GraphSafeCacheOnlyBuilder]:
        return GraphSafeCacheOnlyBuilder


class HiddenStatesCacheLayer(CacheOnlyAttentionLayer):
    """vLLM's cache-only layer (one row of ``[layers, hidden]`` per token: ``num_heads`` = layers,
    ``head_size`` = hidden) on ``GraphSafeCacheOnlyBackend``."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.attn_backend = GraphSafeCacheOnlyBackend

    def get_attn_backend(self) -> type[GraphSafeCacheOnlyBackend]:
        return GraphSafeCacheOnlyBackend


def _check_layer_ids(ids: tuple[int, ...], num_layers: int) -> None:
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise ConfigError(
            "layer_ids",
            f"{bad} out of range for a model of {num_layers} layers: id k < {num_layers} is the input of "
            f"decoder layer k (0: the embeddings), {num_layers} is the last layer's output",
        )


class InModelCacheMixin(StreamCaptureOwner):
    """Caches the residual stream at the configured layer ids into a cache-only layer of the
    model's own, at the end of every forward, when the configuration asks for it."""

    def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        kv_transfer = vllm_config.kv_transfer_config
        ids = None if kv_transfer is None else in_model_layer_ids(kv_transfer.kv_connector_extra_config)
        if ids is not None:
            self._layertap_start_caching(vllm_config, prefix, ids)

    def _layertap_start_caching(self, vllm_config: Any, prefix: str, ids: tuple[int, ...]) -> None:
        from vllm.distributed import get_pp_group
        from vllm.model_executor.models.utils import maybe_prefix

        spec = vllm_config.speculative_config
        if spec is not None:
            raise ConfigError(
                "capture",
                f'"in-model" runs without speculative decoding, but speculative_config (method '
                f'{getattr(spec, "method", None)!r}) is set; remove it, or use capture="method"',
            )
        if get_pp_group().world_size > 1:
            raise ConfigError("capture", '"in-model" with pipeline parallelism is not supported')
        capture = self._layertap_capture()
        num_layers = vllm_config.model_config.get_total_num_hidden_layers()
        _check_layer_ids(ids, num_layers)
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
    """The model class for ``arch`` (one of ``IN_MODEL_FAMILIES``) that can cache its hidden
    states itself."""
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
