"""The connector's cost per request on the engine thread, scheduler side and worker side, driven
directly (no engine): real vLLM ``Request`` objects finish, the scheduler half plans their saves
and builds the step's metadata, the worker half gathers them out of a real (CPU) hidden-states
cache tensor into its pool and hands them to a real Rust writer; the blocks come back as vLLM
would free them. Every hook vLLM calls on the engine thread is timed, per step:

- scheduler: ``request_finished_all_groups`` for each finished request, ``build_connector_meta``,
  ``update_connector_output`` and ``has_pending_block_frees``;
- worker: ``get_finished`` (start the step's saves, collect what the writer and the copies
  finished), with the gather itself timed apart: on the CPU it is a synchronous copy of every
  byte, on a GPU an asynchronous kernel whose launch costs the same for any number of requests.

    python benches/bench_hotpath.py [--case 1b|short|decode|all] [--steps 200] [--out PREFIX]

Cases (requests finishing per step, tokens each), after the GPU benchmark's (benches/gpu):
``1b`` 52 x 256 (prefill, the 1B case), ``short`` 256 x 16..128 (tens of thousands of short
prompts), ``decode`` 256 x (128 prompt + 128 generated, ``include_output_tokens``: all of a batch
finish in one step). Hidden size 64 x 3 layers by default, so that the copy of the bytes does not
hide the per-request cost (``--hidden 2048`` for the 1B model's rows). Records go to a tmpfs
(``/dev/shm``) with codec ``none`` unless told otherwise. Times are the engine thread's CPU time
(``time.thread_time``: steadier than the wall clock on a shared machine) and its wall time.
Also reported: the metadata's pickled size and pickle + unpickle time (what a multi-process
executor pays to send it to the workers).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

CASES = {
    # name: (requests per step, shortest prompt, longest prompt, generated tokens, record them)
    "1b": (52, 256, 256, 1, False),
    "short": (256, 16, 128, 1, False),
    "decode": (256, 128, 128, 128, True),
}
BLOCK = 16


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered)) - 1))]


class Clock:
    """CPU time of this thread and wall time, in seconds, since ``start``."""

    def __init__(self) -> None:
        self.cpu = time.thread_time()
        self.wall = time.perf_counter()

    def lap(self) -> tuple[float, float]:
        cpu, wall = time.thread_time(), time.perf_counter()
        out = (cpu - self.cpu, wall - self.wall)
        self.cpu, self.wall = cpu, wall
        return out


def run_case(name: str, args: argparse.Namespace, scratch: Path) -> dict:
    import torch
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    from layertap.vllm import gather
    from layertap.vllm.config import parse_options
    from layertap.vllm.engine_facts import EngineFacts
    from layertap.vllm.scheduler import SchedulerSide
    from layertap.vllm.worker_side import WorkerSide

    per_step, min_len, max_len, generated, include_outputs = CASES[name]
    layers = 3
    record_len = max_len + (generated - 1 if include_outputs else 0)
    blocks_per_req = -(-(max_len + generated) // BLOCK)
    num_blocks = 2 * per_step * blocks_per_req + 1
    facts = EngineFacts(
        layer_ids=(2, 8, 13),
        requested_layer_ids=(2, 8, 13),
        num_model_layers=16,
        hidden_size=args.hidden,
        model="bench",
        max_model_len=max_len + generated + 8,
        max_num_batched_tokens=max(8192, per_step * max_len),
        group_id=0,
        block_size=BLOCK,
        engine_id=f"bench-{name}",
        writer_id=f"bench-{name}",
        tensor_parallel_size=1,
    )
    out_dir = scratch / name
    extra = {"output_dir": str(out_dir), "codec": args.codec, "durability": "none"}
    extra.update(json.loads(args.extra))
    options = parse_options(extra)
    sched = SchedulerSide.from_facts(facts, options)
    worker = WorkerSide.from_facts(facts, options)
    # [blocks, block, layers, hidden]: vLLM 0.26's token-major layout on CUDA.
    kv = torch.randn(num_blocks, BLOCK, layers, args.hidden).to(torch.bfloat16)
    worker.open_cache(kv)

    gather_seconds: list[float] = []
    real_gather = gather.HiddenStatesCache.gather

    def timed_gather(self, index, out):
        t0 = time.thread_time()
        try:
            return real_gather(self, index, out)
        finally:
            gather_seconds.append(time.thread_time() - t0)

    gather.HiddenStatesCache.gather = timed_gather

    rng = random.Random(0)
    params = SamplingParams(
        max_tokens=generated,
        extra_args={"kv_transfer_params": {"include_output_tokens": True}} if include_outputs else None,
    )
    free_blocks = list(range(1, num_blocks))
    held: dict[str, list[int]] = {}
    rows: list[dict] = []
    n_req = 0
    for step in range(args.warmup + args.steps):
        # Requests that finish this step, as vLLM's scheduler holds them (not timed).
        finished = []
        for _ in range(per_step):
            n = rng.randint(min_len, max_len)
            req = Request(
                f"{n_req}-{rng.getrandbits(32):08x}", [rng.randrange(100, 30000) for _ in range(n)], params, None
            )
            if include_outputs:
                req.append_output_token_ids([rng.randrange(100, 30000) for _ in range(generated)])
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            need = -(-req.num_tokens // BLOCK)
            while len(free_blocks) < need:
                # Saves deferred for room in the pool hold their blocks: step on, untimed, as an
                # engine in its own process does, until the writer hands regions back.
                for req_id in worker.get_finished(None) or ():
                    free_blocks.extend(held.pop(req_id))
                time.sleep(0.001)
            blocks = [free_blocks.pop() for _ in range(need)]
            finished.append((req, blocks))
            n_req += 1
        gather_seconds.clear()
        finish = sched.request_finished
        clock = Clock()
        answers = [finish(req, (blocks,)) for req, blocks in finished]
        meta = sched.build_connector_meta()
        s1 = clock.lap()
        done = worker.get_finished(meta)
        w = clock.lap()
        sched.update_connector_output(done)
        sched.has_pending_block_frees()
        s2 = clock.lap()
        for (req, blocks), (keep, _) in zip(finished, answers):
            if keep:
                held[req.request_id] = blocks
            else:
                free_blocks.extend(blocks)
        for req_id in done or ():
            free_blocks.extend(held.pop(req_id))
        blob = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
        t0 = time.perf_counter()
        pickle.loads(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))
        pickle_s = time.perf_counter() - t0
        if step >= args.warmup:
            rows.append(
                {
                    "sched_cpu": s1[0] + s2[0],
                    "sched_wall": s1[1] + s2[1],
                    "worker_cpu": w[0],
                    "worker_wall": w[1],
                    "gather_cpu": sum(gather_seconds),
                    "pickle_bytes": len(blob),
                    "pickle_s": pickle_s,
                }
            )
    worker.shutdown()
    gather.HiddenStatesCache.gather = real_gather
    summary = worker.summary()
    shutil.rmtree(out_dir, ignore_errors=True)

    def per_request_us(key: str) -> float:
        return statistics.median(r[key] for r in rows) / per_step * 1e6

    def step_ms(key: str) -> dict:
        vals = [r[key] for r in rows]
        return {"p50_ms": percentile(vals, 50) * 1e3, "p99_ms": percentile(vals, 99) * 1e3}

    worker_ex = [r["worker_cpu"] - r["gather_cpu"] for r in rows]
    return {
        "case": name,
        "requests_per_step": per_step,
        "tokens": f"{min_len}..{max_len}" if min_len != max_len else str(max_len),
        "record_tokens_max": record_len,
        "steps": len(rows),
        "hidden": args.hidden,
        "codec": args.codec,
        "us_per_request": {
            "scheduler_cpu": per_request_us("sched_cpu"),
            "scheduler_wall": per_request_us("sched_wall"),
            "worker_cpu": per_request_us("worker_cpu"),
            "worker_wall": per_request_us("worker_wall"),
            "worker_cpu_without_gather": statistics.median(worker_ex) / per_step * 1e6,
            "gather_cpu": per_request_us("gather_cpu"),
        },
        "per_step": {
            "scheduler_cpu": step_ms("sched_cpu"),
            "scheduler_wall": step_ms("sched_wall"),
            "worker_cpu": step_ms("worker_cpu"),
            "worker_wall": step_ms("worker_wall"),
        },
        "metadata_pickle": {
            "bytes_per_request": statistics.median(r["pickle_bytes"] for r in rows) / per_step,
            "us_per_request": per_request_us("pickle_s"),
        },
        "connector": {k: summary[k] for k in ("records_written", "pool_stalls", "pool_stall_seconds", "gathers")},
    }


def markdown(results: list[dict], meta: dict) -> str:
    lines = [
        f"# Connector hot path per request ({meta['date']}, {meta['machine']}, load {meta['load']})",
        "",
        f"`{meta['command']}` at commit `{meta['commit']}`, vLLM {meta['vllm']}"
        + (f" ({meta['label']})" if meta["label"] else "")
        + ". Engine-thread CPU time per",
        "request (median over steps, divided by the requests of a step), then per step p50 / p99 (CPU",
        "and wall). `worker - gather`: the worker's hook without the CPU copy of the bytes (on a GPU an",
        "asynchronous kernel).",
        "",
        "| case | req/step | scheduler us/req | worker us/req | worker - gather us/req | "
        "scheduler ms/step p50 / p99 (wall) | worker ms/step p50 / p99 (wall) | metadata pickled B/req, us/req |",
        "|---|---:|---:|---:|---:|---|---|---|",
    ]
    for r in results:
        u, p, m = r["us_per_request"], r["per_step"], r["metadata_pickle"]
        lines.append(
            f"| {r['case']} ({r['tokens']} tok) | {r['requests_per_step']} | {u['scheduler_cpu']:.1f} | "
            f"{u['worker_cpu']:.1f} | {u['worker_cpu_without_gather']:.1f} | "
            f"{p['scheduler_cpu']['p50_ms']:.2f} / {p['scheduler_cpu']['p99_ms']:.2f} "
            f"({p['scheduler_wall']['p50_ms']:.2f} / {p['scheduler_wall']['p99_ms']:.2f}) | "
            f"{p['worker_cpu']['p50_ms']:.2f} / {p['worker_cpu']['p99_ms']:.2f} "
            f"({p['worker_wall']['p50_ms']:.2f} / {p['worker_wall']['p99_ms']:.2f}) | "
            f"{m['bytes_per_request']:.0f}, {m['us_per_request']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=[*CASES, "all"], default="all")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--codec", default="none")
    ap.add_argument("--extra", default="{}", help="JSON of more connector options")
    ap.add_argument("--dir", default="/dev/shm", help="where the records go (a scratch folder in it)")
    ap.add_argument("--out", help="write PREFIX.json and PREFIX.md")
    ap.add_argument(
        "--label",
        default="",
        help="what is measured, for the table (e.g. 'before: commit X through PYTHONPATH=...')",
    )
    args = ap.parse_args()
    import subprocess

    import vllm

    scratch = Path(tempfile.mkdtemp(prefix="layertap-hotpath-", dir=args.dir))
    try:
        results = [run_case(c, args, scratch) for c in (CASES if args.case == "all" else [args.case])]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "python", "rust"], capture_output=True, text=True).stdout
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs",
        "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "command": "python " + " ".join(sys.argv),
        "commit": commit + ("+changes" if dirty.strip() else ""),
        "vllm": vllm.__version__,
        "label": args.label,
        "layertap": os.path.dirname(__import__("layertap").__file__),
    }
    text = markdown(results, meta)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
        Path(f"{args.out}.md").write_text(text)


if __name__ == "__main__":
    main()
