"""Throughput of ``layertap export`` (docs/TRAINING.md) against reading alone and a plain loop.

    python benches/bench_export.py --dir /var/tmp/layertap-bench --out benches/results/export-NAME

Writes a bp16-zstd dataset of RECORDS records of TOKENS tokens x 4 layers x HIDDEN (bf16, the
last layer N of a random Llama of that width), then times, each the fastest of 3 runs after one
warm-up read:

- ``read``: every record read and checked (checksum, decode), one thread: the floor;
- ``loop``: a plain loop that reads each record and ``safetensors.torch.save_file``s it (what a
  user script would do: no checks, no temporary names, no fsync), one thread;
- ``speculators`` and ``specforge`` (EAGLE-3, with the final norm) exports at 1, 2 and 4
  threads, with and without fsync.

Throughput is raw hidden-state bytes per second (what the trainer gets). Compare the rows of one
run with each other: on a shared machine absolute numbers move with its load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch


def make(dir_: Path, records: int, tokens: int, hidden: int) -> tuple[str, str]:
    import layertap

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_llama import build_tiny_llama

    model = build_tiny_llama(
        dir_ / "model",
        hidden_size=hidden,
        num_heads=hidden // 64,
        num_kv_heads=1,
        intermediate_size=2 * hidden,
        dtype="bfloat16",
    )
    ds = dir_ / "ds"
    g = torch.Generator().manual_seed(0)
    with layertap.ShardWriter(str(ds), codec="bp16-zstd") as w:
        for i in range(records):
            hs = (torch.randn(tokens, 4, hidden, generator=g) * 2).bfloat16()
            w.submit(
                str(i),
                {"hidden_states": hs, "token_ids": torch.arange(tokens, dtype=torch.int64)},
                metadata={"layer_ids": "[1, 2, 3, 4]"},
            )
    return str(ds), model


def timed(fn, cleanup=None, repeat: int = 3) -> float:
    """The fastest of ``repeat`` runs (the least disturbed by other work on a shared machine)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        if cleanup is not None:
            cleanup()
    return best


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="/var/tmp/layertap-bench")
    p.add_argument("--out", required=True, help="results path without extension (.md and .json are written)")
    p.add_argument("--records", type=int, default=120)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=1024)
    args = p.parse_args()
    from safetensors.torch import save_file

    import layertap
    from layertap.export import export

    work = Path(args.dir) / "export-bench"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ds, model = make(work, args.records, args.tokens, args.hidden)
    raw = args.records * args.tokens * 4 * args.hidden * 2
    results = []

    def read_all():
        with layertap.open(ds) as d:
            for rec in d:
                assert rec.hidden_states.numel() > 0  # decoded and checked by the read

    def loop():
        out = work / "loop"
        out.mkdir()
        with layertap.open(ds) as d:
            for rec in d:
                save_file(
                    {"hidden_states": rec.hidden_states, "token_ids": rec.token_ids},
                    str(out / f"hs_{rec.key}.safetensors"),
                )

    read_all()  # warm the page cache
    results.append({"what": "read", "threads": 1, "fsync": False, "seconds": timed(read_all)})
    results.append(
        {
            "what": "loop (save_file)",
            "threads": 1,
            "fsync": False,
            "seconds": timed(loop, lambda: shutil.rmtree(work / "loop")),
        }
    )
    for fmt in ("speculators", "specforge"):
        for fsync in (False, True):
            for threads in (1, 2, 4):
                out = work / "out"
                kw = {"model": model} if fmt == "specforge" else {}
                secs = timed(
                    lambda out=out, fmt=fmt, threads=threads, fsync=fsync, kw=kw: export(
                        ds, str(out), fmt, workers=threads, fsync=fsync, **kw
                    ),
                    lambda out=out: shutil.rmtree(out),
                )
                results.append({"what": fmt, "threads": threads, "fsync": fsync, "seconds": secs})
                print(results[-1], file=sys.stderr)
    for r in results:
        r["seconds"] = round(r["seconds"], 2)
        r["raw_MB_per_s"] = round(raw / r["seconds"] / 1e6, 1)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "host": os.uname().nodename,
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 1),
        "records": args.records,
        "tokens": args.tokens,
        "hidden": args.hidden,
        "raw_bytes": raw,
    }
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    lines = [
        f"# layertap export throughput ({meta['date']}, {meta['cpus']} CPUs, load {meta['load_avg_1m']})",
        "",
        f"{args.records} records x {args.tokens} tokens x 4 layers x {args.hidden} bf16 "
        f"({raw / 2**20:.0f} MiB raw), bp16-zstd, page cache warm.",
        "",
        "| what | threads | fsync | seconds | raw MB/s |",
        "|---|---:|---|---:|---:|",
    ]
    lines += [
        f"| {r['what']} | {r['threads']} | {'yes' if r['fsync'] else 'no'} | {r['seconds']} | {r['raw_MB_per_s']} |"
        for r in results
    ]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
