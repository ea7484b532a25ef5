"""Compression ratio and speed of each codec on real activations (benches/activations.py).

For each dtype (bf16, f16, f32), codec and zstd level: the ratio (raw / stored), the encode speed
of the Rust writer with 1 and with all compression threads (records of ~2.6 MiB written to a
tmpfs, durability none, so the disk is out of the picture), and the decode speed of the Rust
reader (read + checksum + decode, one thread), each in GB per wall-clock second and in GB per
CPU-second of the process (the machine may be shared; CPU time is what a core costs). Then, on
the same records, libraries outside layertap as references, one thread, codec calls alone:
ZipNN (byte grouping + Huffman, if it installs) and lz4.

    python benches/bench_codecs.py --out benches/results/codecs-NAME

writes NAME.json and NAME.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_writer import load_activations  # noqa: E402

RECORD_TOKENS = 512  # 512 x 7 x 384 x 2 bytes = 2.6 MiB of bf16 a record


def measure(acts, codec: str, level: int, threads: int, scratch: Path, passes: int) -> dict:
    import layertap

    out = scratch / f"{codec}-{level}-{threads}"
    shutil.rmtree(out, ignore_errors=True)
    n = acts.shape[0] // RECORD_TOKENS
    records = [acts[i * RECORD_TOKENS : (i + 1) * RECORD_TOKENS] for i in range(n)] * passes
    raw = sum(r.numel() * r.element_size() for r in records)
    t0, c0 = time.perf_counter(), time.process_time()
    with layertap.ShardWriter(out, codec=codec, level=level, threads=threads, durability="none") as w:
        for i, r in enumerate(records):
            w.submit(f"r{i}", {"hidden_states": r})
    t_enc, c_enc = time.perf_counter() - t0, time.process_time() - c0
    stats = w.stats
    t0, c0 = time.perf_counter(), time.process_time()
    with layertap.open(out, backend="rust") as ds:
        for rec in ds:
            rec.hidden_states.view(-1)[0].item()  # touch the data
    t_dec, c_dec = time.perf_counter() - t0, time.process_time() - c0
    shutil.rmtree(out)
    return {
        "codec": codec,
        "level": level,
        "threads": threads,
        "raw_bytes": raw,
        "ratio": stats["ratio"],
        "encode_gbps": raw / t_enc / 1e9,
        "decode_gbps": raw / t_dec / 1e9,
        "encode_gb_per_cpu_s": raw / c_enc / 1e9,
        "decode_gb_per_cpu_s": raw / c_dec / 1e9,
    }


def measure_library(acts, name: str, passes: int) -> dict | None:
    """A library's compress and decompress calls alone on the same records, one thread; None
    when it is not installed."""
    import torch

    dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[acts.dtype]
    try:
        if name == "zipnn":
            import zipnn

            z = zipnn.ZipNN(bytearray_dtype=dtype, threads=1)
            compress, decompress = z.compress, z.decompress
        else:
            import lz4.frame

            compress, decompress = lz4.frame.compress, lz4.frame.decompress
    except ImportError:
        return None
    n = acts.shape[0] // RECORD_TOKENS
    records = [acts[i * RECORD_TOKENS : (i + 1) * RECORD_TOKENS].view(torch.uint8).numpy().tobytes() for i in range(n)]
    raw = sum(map(len, records)) * passes
    # One pass's compressed records are kept at a time, and nothing decompressed: f32 records
    # take a GiB a pass.
    t_enc = c_enc = t_dec = c_dec = 0.0
    stored_bytes, round_trip = 0, True
    for _ in range(passes):
        t0, c0 = time.perf_counter(), time.process_time()
        stored = [compress(r) for r in records]
        t_enc, c_enc = t_enc + time.perf_counter() - t0, c_enc + time.process_time() - c0
        stored_bytes += sum(map(len, stored))
        for c, r in zip(stored, records):
            t0, c0 = time.perf_counter(), time.process_time()
            back = decompress(c)
            t_dec, c_dec = t_dec + time.perf_counter() - t0, c_dec + time.process_time() - c0
            round_trip = round_trip and bytes(back) == r
        del stored
    return {
        "codec": name,
        "level": None,
        "threads": 1,
        "raw_bytes": raw,
        "ratio": raw / stored_bytes,
        "round_trip": round_trip,
        "encode_gbps": raw / t_enc / 1e9,
        "decode_gbps": raw / t_dec / 1e9,
        "encode_gb_per_cpu_s": raw / c_enc / 1e9,
        "decode_gb_per_cpu_s": raw / c_dec / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="results path without suffix")
    ap.add_argument("--tokens", type=int, default=32768, help="tokens of activations to use per dtype")
    ap.add_argument("--passes", type=int, default=3, help="times each record is written (distinct keys)")
    ap.add_argument("--levels", default="-3,1,3")
    ap.add_argument("--dtypes", default="bf16,f16,f32", help="which dtypes' activations to measure")
    ap.add_argument(
        "--activations",
        type=Path,
        help="a safetensors file holding a tensor per dtype measured (default: benches/activations.py's, made on first "
        "use; on a GPU machine, device.sh host passes .devbundle/acts/activations-2k.safetensors, bf16 only)",
    )
    args = ap.parse_args(argv)
    cpus = os.cpu_count() or 1
    scratch = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    rows = []
    try:
        for dtype in args.dtypes.split(","):
            acts = load_activations(dtype, args.activations)[: args.tokens].contiguous()
            rows.append(dict(measure(acts, "none", 1, 1, scratch, args.passes), dtype=dtype))
            print(rows[-1], flush=True)
            for codec in ("zstd", "bp16-zstd", "exp-huf"):
                if codec == "bp16-zstd" and dtype == "f32":
                    continue  # the transform only touches 2-byte elements
                levels = [int(x) for x in args.levels.split(",")] if "zstd" in codec else [1]
                for level in levels:
                    for threads in sorted({1, cpus}):
                        rows.append(dict(measure(acts, codec, level, threads, scratch, args.passes), dtype=dtype))
                        print(rows[-1], flush=True)
            for lib in ("zipnn", "lz4"):
                row = measure_library(acts, lib, args.passes)
                if row is not None:
                    rows.append(dict(row, dtype=dtype))
                    print(rows[-1], flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    machine = {
        "host": platform.node(),
        "cpus": cpus,
        "processor": platform.processor() or platform.machine(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "activations": "all-MiniLM-L6-v2, 7 hidden-state layers x 384, stdlib docstrings",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    lines = [
        "| dtype | codec | level | threads | ratio | encode GB/s | decode GB/s (1 thread) "
        "| encode GB/CPU-s | decode GB/CPU-s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        level = r["level"] if "zstd" in r["codec"] else "-"
        name = r["codec"] if r.get("round_trip", True) else f"{r['codec']} (does not round-trip)"
        lines.append(
            f"| {r['dtype']} | {name} | {level} | {r['threads']} | "
            f"{r['ratio']:.3f} | {r['encode_gbps']:.2f} | {r['decode_gbps']:.2f} | "
            f"{r['encode_gb_per_cpu_s']:.2f} | {r['decode_gb_per_cpu_s']:.2f} |"
        )
    note = (
        "Writer rows: the Rust writer and reader (GB per CPU-second counts every thread of the process). "
        "zipnn and lz4: their own compress/decompress calls on the same records' bytes, one thread.\n\n"
    )
    md = f"# Codecs on real activations, {machine['date']}\n\n{json.dumps(machine)}\n\n{note}" + "\n".join(lines) + "\n"
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
