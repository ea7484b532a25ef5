"""Writer throughput against the disk's own bandwidth, and codec ratios on real activations.

Same run, same disk, one after the other:
- `dd` sequential writes (buffered + fsync, and O_DIRECT): the disk's bandwidth;
- `ShardWriter` with io_uring and with pwrite, through the page cache or with O_DIRECT
  (`uring-direct`, `pwrite-direct`, `auto-direct`: dd O_DIRECT is their reference),
  and one safetensors file per record written by a thread pool (what vLLM's
  ExampleHiddenStatesConnector does), for record sizes from 256 KiB to 64 MiB and every codec.
Each writer run writes `--total` bytes of records and counts the time until its data is durable
(the writer's close() with durability "close"; for the safetensors files, an fsync of each
file). Records are slices of real activations (benches/activations.py), handed over without copy.
For the layertap writers it also reports `longest gap s`, the longest time between two polls that
returned records: how long a caller that recycles its buffers on completions could stall (with a
small `--shard-size`, an fsync at each shard rotation that blocked writing would show there).

    python benches/bench_writer.py --dir /path/on/the/disk --total 2GiB --out benches/results/NAME

writes NAME.json (every measurement) and NAME.md (tables).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from activations import DEFAULT_OUT as ACTIVATIONS  # noqa: E402

MiB = 1 << 20
SIZES = {"256KiB": 256 << 10, "1MiB": MiB, "4MiB": 4 * MiB, "16MiB": 16 * MiB, "64MiB": 64 * MiB}
CODECS = ["none", "zstd", "bp16-zstd"]


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if text.endswith(u):
            return int(float(text[: -len(u)]) * m)
    return int(text)


def load_activations(dtype: str = "bf16", path: Path | None = None) -> torch.Tensor:
    """Real activations from benches/activations.py (made on first use), or from ``path``."""
    from safetensors.torch import load_file

    if path is None:
        path = ACTIVATIONS
        if not path.exists():
            subprocess.run([sys.executable, str(HERE / "activations.py")], check=True)
    return load_file(str(path))[dtype]


def records(acts: torch.Tensor, record_bytes: int, total: int):
    """(key, tensors) pairs of about record_bytes each, views of acts, cycling through it."""
    per_token = acts[0].numel() * acts.element_size()
    tokens = max(1, record_bytes // per_token)
    n = max(1, total // (tokens * per_token))
    start = 0
    for i in range(n):
        if start + tokens > acts.shape[0]:
            start = 0
        hs = acts[start : start + tokens]
        if hs.shape[0] < tokens:  # a record longer than the activations: tile them (one copy, made up front)
            hs = acts.repeat((tokens + acts.shape[0] - 1) // acts.shape[0], 1, 1)[:tokens].contiguous()
        ids = torch.arange(start, start + tokens, dtype=torch.int64)
        yield f"rec-{i:07d}", {"hidden_states": hs, "token_ids": ids}
        start += tokens


def drop_caches() -> None:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_dd(path: Path, total: int, direct: bool) -> dict:
    target = path / "dd.bin"
    count = max(1, total // (8 * MiB))
    flag = "oflag=direct" if direct else "conv=fsync"
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=8M", f"count={count}", flag], check=True, capture_output=True
    )
    dt = time.perf_counter() - t0
    target.unlink()
    nbytes = count * 8 * MiB
    return {
        "writer": "dd " + ("O_DIRECT" if direct else "buffered+fsync"),
        "codec": "-",
        "record": "8MiB",
        "seconds": dt,
        "bytes_in": nbytes,
        "bytes_on_disk": nbytes,
        "gbps_in": nbytes / dt / 1e9,
    }


def run_layertap(
    kind: str, path: Path, acts: torch.Tensor, record_bytes: int, total: int, codec: str, threads: int, shard_size: int
) -> dict:
    """``kind``: an io mode (auto, uring, pwrite) with ``-direct`` for O_DIRECT."""
    import layertap

    io, _, mode = kind.partition("-")
    w = layertap.ShardWriter(
        path,
        codec=codec,
        level=1,
        durability="close",
        threads=threads,
        io=io,
        direct=mode == "direct",
        shard_size=shard_size,
    )
    backend = w.backend + (", O_DIRECT" if w.stats.get("direct") else "")
    nbytes = 0
    last_done, longest_gap = None, 0.0
    t0 = time.perf_counter()
    with w:
        for key, tensors in records(acts, record_bytes, total):
            w.submit(key, tensors)
            nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
            if w.poll():
                now = time.perf_counter()
                longest_gap = max(longest_gap, now - (t0 if last_done is None else last_done))
                last_done = now
    dt = time.perf_counter() - t0
    stats = w.stats
    return {
        "writer": f"layertap {kind} ({backend})",
        "codec": codec,
        "seconds": dt,
        "bytes_in": nbytes,
        "bytes_on_disk": dir_bytes(path),
        "gbps_in": nbytes / dt / 1e9,
        "blocked_seconds": stats.get("blocked_seconds"),
        "longest_gap_seconds": longest_gap,
        "shards": stats.get("shards_closed"),
    }


def run_safetensors_per_record(path: Path, acts: torch.Tensor, record_bytes: int, total: int) -> dict:
    """vLLM's ExampleHiddenStatesConnector: one safetensors file per record from 8 threads."""
    from safetensors.torch import save_file

    def save(key: str, tensors: dict) -> None:
        f = path / f"{key}.safetensors"
        save_file(tensors, str(f))
        fd = os.open(f, os.O_RDONLY)  # upstream never fsyncs; durable data needs it
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    nbytes = 0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        futures = []
        for key, tensors in records(acts, record_bytes, total):
            futures.append(pool.submit(save, key, tensors))
            nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
        for f in futures:
            f.result()
    dt = time.perf_counter() - t0
    return {
        "writer": "safetensors file per record",
        "codec": "none",
        "seconds": dt,
        "bytes_in": nbytes,
        "bytes_on_disk": dir_bytes(path),
        "gbps_in": nbytes / dt / 1e9,
    }


def table(rows: list[dict]) -> str:
    head = (
        "| round | writer | codec | record | GB/s of input | s | stored / input | blocked s | longest gap s |\n"
        "|---:|---|---|---|---:|---:|---:|---:|---:|\n"
    )
    lines = []

    def opt(v: float | None) -> str:
        return "" if v is None else f"{v:.2f}"

    for r in rows:
        ratio = r["bytes_on_disk"] / r["bytes_in"] if r["bytes_in"] else 0
        lines.append(
            f"| {r['round']} | {r['writer']} | {r['codec']} | {r['record']} | {r['gbps_in']:.2f} | "
            f"{r['seconds']:.2f} | {ratio:.3f} | {opt(r.get('blocked_seconds'))} | "
            f"{opt(r.get('longest_gap_seconds'))} |"
        )
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True, help="scratch directory on the disk to measure")
    ap.add_argument("--total", default="1GiB", help="bytes of records per run")
    ap.add_argument("--sizes", default=",".join(SIZES), help="record sizes")
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument(
        "--writers",
        default="uring,pwrite,uring-direct,pwrite-direct,safetensors",
        help="uring, pwrite, auto (ShardWriter io modes, each also with -direct), safetensors",
    )
    ap.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--shard-size", default="1GiB", help="the layertap writers' shard_size")
    ap.add_argument("--out", type=Path, required=True, help="results path without suffix")
    ap.add_argument("--activations", type=Path, help="a safetensors file with a 'bf16' tensor (default: made here)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run everything (dd included) this many times, writers in reverse order every other "
        "round (for noisy disks, where the first runs after a pause are often slower)",
    )
    args = ap.parse_args(argv)

    total = parse_size(args.total)
    acts = load_activations("bf16", args.activations)
    args.dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def fresh() -> Path:
        d = args.dir / "run"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        drop_caches()
        return d

    for round_ in range(1, args.rounds + 1):
        for direct in (False, True):
            fresh()
            rows.append(dict(run_dd(args.dir, total, direct), round=round_))
            print(rows[-1], flush=True)
        for size in args.sizes.split(","):
            rb = SIZES[size]
            writers = args.writers.split(",")
            for writer in writers if round_ % 2 else writers[::-1]:
                codecs = ["none"] if writer == "safetensors" else args.codecs.split(",")
                for codec in codecs:
                    d = fresh()
                    if writer == "safetensors":
                        r = run_safetensors_per_record(d, acts, rb, total)
                    else:
                        r = run_layertap(writer, d, acts, rb, total, codec, args.threads, parse_size(args.shard_size))
                    r["record"] = size
                    r["round"] = round_
                    rows.append(r)
                    print(r, flush=True)
    shutil.rmtree(args.dir / "run", ignore_errors=True)

    machine = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "total_bytes": total,
        "threads": args.threads,
        "dir": str(args.dir),
        "rounds": args.rounds,
        "shard_size": parse_size(args.shard_size),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    md = f"# Writer benchmark, {machine['date']}\n\n{json.dumps(machine)}\n\n" + table(rows)
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
