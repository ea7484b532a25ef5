"""Prototype (not part of the package): hidden states captured without vLLM's speculative method.

vLLM's ``extract_hidden_states`` caches the hidden states through a draft "model" that owns one
cache-only attention layer (a ``HiddenStateCacheSpec`` KV-cache group), run as a speculative step:
in decode every request is scheduled two tokens per step (its token and a draft that is thrown
away), then a draft forward and rejection sampling run. Here the target model owns that same
cache-only layer (vLLM's ``CacheOnlyAttentionLayer``, under the name the method gives it,
``cache_only_layers.{N}``) and writes the recorded layers into it at the end of its own forward, from
the slot mapping vLLM computes for every KV-cache group; no speculative configuration at all. The
connector reads the same cache; only its lookup of the layer ids (from the speculative
configuration) is replaced, in this script.

``python benches/inmodel_capture.py`` checks the values through the connector against
transformers (the requests of tests/vllm/test_plugin_values.py: prefix caching, chunked prefill,
generated tokens); ``plugin_decode_cpu.py`` measures its decode speed (mode ``in-model``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

IN_MODEL_ARCH = "LayertapInModelLlamaForCausalLM"
LAYERS = [2, 3, 4]


def register_in_model_llama(layers: list[int] = LAYERS) -> None:
    """Registers ``IN_MODEL_ARCH``: vLLM's Llama whose forward also caches ``layers`` (read with the
    plugin's hooks) into a cache-only layer of its own."""
    import torch
    from vllm import ModelRegistry
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer
    from vllm.model_executor.models.llama import LlamaForCausalLM

    from layertap.vllm.models.classes import aux_hidden_states_class
    from layertap.vllm.models.families import FUSED, Family

    hooked = aux_hidden_states_class(
        LlamaForCausalLM, Family("llama", "LlamaForCausalLM", "model.layers", FUSED), "HookedLlamaForCausalLM"
    )

    class InModelLlama(hooked):
        def __init__(self, *, vllm_config, prefix: str = ""):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            num_layers = vllm_config.model_config.get_total_num_hidden_layers()
            # num_heads = layers and head_size = hidden: a token's [layers, hidden] is one cache row.
            self.hidden_states_cache = CacheOnlyAttentionLayer(
                num_heads=len(layers),
                head_size=vllm_config.model_config.get_hidden_size(),
                cache_config=vllm_config.cache_config,
                prefix=f"cache_only_layers.{num_layers}",
            )
            self.set_aux_hidden_state_layers(tuple(layers))

        def forward(self, *args, **kwargs):
            hidden_states, aux = super().forward(*args, **kwargs)
            self.hidden_states_cache(torch.stack(aux, dim=1))
            return hidden_states

    InModelLlama.__name__ = InModelLlama.__qualname__ = IN_MODEL_ARCH
    ModelRegistry.register_model(IN_MODEL_ARCH, InModelLlama)


def patch_connector_layer_ids(layers: list[int] = LAYERS) -> None:
    """The connector takes its layer ids from the speculative configuration, which this mode has
    not: give it ``layers`` instead (a real option would come from the connector's configuration)."""
    import layertap.vllm.engine as engine

    engine._layer_ids = lambda vllm_config: tuple(layers)


def in_model_copy(llama_dir: str, out: Path) -> str:
    """A copy of a tiny Llama's directory whose ``architectures`` names ``IN_MODEL_ARCH``."""
    shutil.copytree(llama_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = [IN_MODEL_ARCH]
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


if os.environ.get("LAYERTAP_BENCH_IN_MODEL") == "1":
    # In vLLM's engine processes too: they are spawned and import the main script again.
    register_in_model_llama()
    patch_connector_layer_ids()


def check_values() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "vllm"))
    from vllm import LLM

    from layertap._tiny_model import build_tiny_llama
    from layertap.vllm import fetch
    from plugin_support import run_requests
    from vllm_support import Reference, assert_hidden_states_match, connector_config

    work = Path(tempfile.mkdtemp(prefix="inmodel-"))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(work / "cache"))
    try:
        llama = build_tiny_llama(work / "llama")
        llm = LLM(
            model=in_model_copy(llama, work / "in-model"),
            dtype="float32",
            enforce_eager=True,
            max_model_len=512,
            block_size=32,
            kv_cache_memory_bytes=64 << 20,
            seed=0,
            enable_prefix_caching=True,
            max_num_batched_tokens=64,
            max_num_seqs=8,
            kv_transfer_config=connector_config(work / "hs", writer="python"),
        )
        requests = run_requests(llm)
        records = [fetch(out.kv_transfer_params, timeout=60) for out, _ in requests]
        llm.llm_engine.engine_core.shutdown()
        reference = Reference(llama)
        for record, (_, ids) in zip(records, requests):
            assert_hidden_states_match(record, reference, ids, layers=sorted(LAYERS))
            print(f"{record.key}: {record.num_tokens} tokens, layers {record.layer_ids}: equal to transformers")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.update(LAYERTAP_BENCH_IN_MODEL="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    register_in_model_llama()
    patch_connector_layer_ids()
    check_values()
