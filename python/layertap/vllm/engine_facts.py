"""What the connector needs to know about its engine, read from vLLM's public configuration
(``VllmConfig``, ``KVCacheConfig``, alike in vLLM 0.26 and 0.32) the same way by both halves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from layertap.vllm.config import ConfigError, ConnectorOptions, refuse_speculation

#: Name of the layer ``extract_hidden_states`` caches into: ``cache_only_layers.{num_layers}``.
_CACHE_ONLY_LAYER = re.compile(r"(^|\.)cache_only_layers\.\d+$")


@dataclass(frozen=True)
class EngineFacts:
    """The engine as the connector sees it."""

    layer_ids: tuple[int, ...]
    """Layer ids in the order the hidden-states cache stores them (ascending)."""
    requested_layer_ids: tuple[int, ...]
    num_model_layers: int
    hidden_size: int
    model: str
    max_model_len: int
    max_num_batched_tokens: int
    group_id: int
    """Index of the KV-cache group that holds the hidden-states layer."""
    block_size: int
    """Tokens per block of that group, as the scheduler counts them."""
    engine_id: str
    writer_id: str
    """The same on both sides, so the scheduler can tell clients where their record goes."""
    tensor_parallel_size: int
    max_num_seqs: int = 256


def _layer_ids(vllm_config: Any, options: ConnectorOptions) -> tuple[int, ...]:
    spec = vllm_config.speculative_config
    if options.capture == "in-model":
        refuse_speculation(spec)
        assert options.layer_ids is not None  # parse_options requires them
        return options.layer_ids
    if spec is None or getattr(spec, "method", None) != "extract_hidden_states":
        raise ConfigError(
            "speculative_config",
            'the connector needs speculative_config={"method": "extract_hidden_states", '
            '"num_speculative_tokens": 1, "draft_model_config": {"hf_config": '
            '{"eagle_aux_hidden_state_layer_ids": [...]}}}, or the connector option '
            'capture="in-model" with layer_ids (docs/CONNECTOR.md)',
        )
    hf_config = spec.draft_model_config.hf_config
    ids = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)
    if ids is None:
        eagle_config = getattr(hf_config, "eagle_config", None)
        if isinstance(eagle_config, dict):
            ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if (
        not ids
        or not isinstance(ids, (list, tuple))
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise ConfigError(
            "eagle_aux_hidden_state_layer_ids",
            f"expected a non-empty list of layer ids in the draft model's hf_config, got {ids!r}",
        )
    return tuple(ids)


def check_layer_ids(ids: tuple[int, ...], num_layers: int, option: str) -> None:
    if len(set(ids)) != len(ids):
        raise ConfigError(
            option,
            f"{list(ids)} repeats a layer; vLLM stores each layer once, so give each id once",
        )
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise ConfigError(
            option,
            f"{bad} out of range for a model of {num_layers} layers: id k < {num_layers} is the "
            f"input of decoder layer k (0: the embeddings), {num_layers} is the last layer's output",
        )


def _spec_is_hidden_states(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    if isinstance(spec, HiddenStateCacheSpec):
        return True
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    return isinstance(inner, dict) and any(isinstance(s, HiddenStateCacheSpec) for s in inner.values())


def hidden_states_group(kv_cache_config: Any) -> tuple[int, int]:
    """``(group id, block size)`` of the KV-cache group holding the hidden-states layer.

    Found by spec type or, where the group's spec was merged into a plain attention spec (the
    scheduler's view on CPU), by the cache-only layer's name; a single group is taken as is."""
    groups = list(kv_cache_config.kv_cache_groups)
    found = [
        gid
        for gid, group in enumerate(groups)
        if _spec_is_hidden_states(group.kv_cache_spec)
        or any(_CACHE_ONLY_LAYER.search(name) for name in group.layer_names)
    ]
    if len(found) != 1:
        if not found and len(groups) == 1:
            found = [0]
        else:
            raise ConfigError(
                "kv_cache_config",
                f"cannot tell which of the {len(groups)} KV-cache groups holds the hidden states "
                f"(candidates: {found}); the hidden-states cache layer (extract_hidden_states' draft "
                "model's, or with capture=\"in-model\" the model's own) must be in exactly one group",
            )
    gid = found[0]
    return gid, int(groups[gid].kv_cache_spec.block_size)


def _writer_id(options: ConnectorOptions, engine_id: str, parallel_config: Any) -> str:
    if options.writer_id is None:
        # engine_id is a UUID per engine, suffixed "_dp{rank}" by vLLM for data-parallel ranks.
        wid = "vllm-" + re.sub(r"[^A-Za-z0-9._-]", "_", engine_id)
        return wid[:64]
    dp_index = getattr(parallel_config, "data_parallel_index", parallel_config.data_parallel_rank)
    if dp_index or parallel_config.data_parallel_size > 1:
        wid = f"{options.writer_id}-dp{dp_index}"
        if len(wid) > 64:
            raise ConfigError("writer_id", f"{wid!r} (with the data-parallel suffix) is longer than 64 characters")
        return wid
    return options.writer_id


def read_engine_facts(vllm_config: Any, kv_cache_config: Any, options: ConnectorOptions) -> EngineFacts:
    kv_transfer = vllm_config.kv_transfer_config
    if not kv_transfer.is_kv_producer:
        raise ConfigError("kv_role", f"must be 'kv_producer' (the connector only writes), got {kv_transfer.kv_role!r}")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ConfigError("pipeline_parallel_size", "pipeline parallelism is not supported by the connector")
    model_config = vllm_config.model_config
    num_layers = model_config.get_total_num_hidden_layers()
    requested = _layer_ids(vllm_config, options)
    option = "layer_ids" if options.capture == "in-model" else "eagle_aux_hidden_state_layer_ids"
    check_layer_ids(requested, num_layers, option)
    if kv_cache_config is None:
        raise ConfigError("kv_cache_config", "vLLM gave the connector no KV-cache configuration (vLLM too old?)")
    group_id, block_size = hidden_states_group(kv_cache_config)
    engine_id = str(kv_transfer.engine_id)
    return EngineFacts(
        layer_ids=tuple(sorted(requested)),
        requested_layer_ids=requested,
        num_model_layers=num_layers,
        hidden_size=model_config.get_hidden_size(),
        model=str(model_config.model),
        max_model_len=int(model_config.max_model_len),
        max_num_batched_tokens=int(vllm_config.scheduler_config.max_num_batched_tokens),
        group_id=group_id,
        block_size=block_size,
        engine_id=engine_id,
        writer_id=_writer_id(options, engine_id, parallel),
        tensor_parallel_size=parallel.tensor_parallel_size,
        max_num_seqs=int(vllm_config.scheduler_config.max_num_seqs),
    )
