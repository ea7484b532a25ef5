"""The torch encoder of exp-huf (layertap.gpu.exphuf) on the GPU (issue 21): on real bf16
activations (all-MiniLM-L6-v2's, ``.devbundle/acts``), in records of ``--record-tokens`` tokens,

- whether its bytes equal the Rust writer's encoder's (the CPU reference) for the first
  ``--check`` records;
- the ratio, and per record the wall time (CUDA synchronised) and the host CPU time of the
  calling thread (launches, the code lengths built from the counts), as GB/s of input and host
  CPU seconds per GB, best of ``--reps`` passes, and the synchronising calls torch sees in one
  call (``host_syncs``: waits in which the thread spins);
- the same for bp16-zstd level 1 on one CPU thread (the Rust writer's codec, through zstandard
  here), for the "10x fewer host CPU seconds per GB" of the issue.

Without CUDA it runs on the CPU (a dry run: the speeds mean nothing).

    python benches/gpu/bench_gpu_exphuf.py --activations .devbundle/acts/activations-2k.safetensors \\
        --out /tmp/layertap-results/gpu-exphuf
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu_codecs import load_records  # noqa: E402


def encode_all(records, batched):
    """``batched``: False (one call a record), True (``encode_blocks``) or "contiguous"
    (``encode_contiguous``, the connector's call: every block in one buffer)."""
    from layertap.gpu.exphuf import Block, encode_block, encode_blocks, encode_contiguous

    torch.cuda.synchronize() if torch.cuda.is_available() else None
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    if batched == "contiguous":
        buf, sizes = encode_contiguous(records, "BF16")
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        blocks = [Block(b"", buf[a : a + n]) for a, n in zip(starts, sizes)]
    else:
        blocks = encode_blocks(records, "BF16") if batched else [encode_block(r, "BF16") for r in records]
    total = sum(len(b) for b in blocks)  # the body's size is known on the host: no extra sync
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    return blocks, total, time.perf_counter() - wall0, time.thread_time() - cpu0


def host_syncs(records, batched) -> int | None:
    """The synchronising calls torch sees in one encode (its sync debug mode: a copy to the host
    that waits, ``.item()``, a boolean mask's count, bincount's min and max), each a wait with
    the calling thread spinning; the encoder's own waits (blocking events) are not among them.
    None without CUDA."""
    if not torch.cuda.is_available():
        return None
    import warnings

    from layertap.gpu.exphuf import encode_block, encode_blocks, encode_contiguous

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if batched == "contiguous":
                encode_contiguous(records, "BF16")
            elif batched:
                encode_blocks(records, "BF16")
            else:
                for r in records:
                    encode_block(r, "BF16")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def rust_block(t: torch.Tensor) -> bytes:
    """The Rust writer's exp-huf block of ``t`` (its payload of a blob holding ``t`` alone)."""
    from layertap import _native
    from layertap._spec.blob import build_header

    header = build_header([("t", "BF16", tuple(t.shape))], {})
    return _native.exphuf_encode(header + t.reshape(-1).view(torch.uint8).numpy().tobytes())[len(header) :]


def bp16_zstd_reference(records, gb: float):
    """Ratio and CPU seconds per GB of bp16-zstd level 1 on one thread (None where zstandard is
    missing: the GPU image has it only with the vLLM bundle)."""
    try:
        import zstandard

        from layertap._py.encode import BYTE_PLANE_LEVEL_1
    except ImportError:
        return None, None
    from layertap._spec.codecs import split_planes

    cctx = zstandard.ZstdCompressor(compression_params=BYTE_PLANE_LEVEL_1)
    cpu0 = time.thread_time()
    stored = 0
    for r in records:
        data = r.reshape(-1).view(torch.uint8).numpy()
        planes = np.empty_like(data)
        split_planes(data, planes)
        stored += len(cctx.compress(planes.tobytes()))
    return round(gb * 1e9 / stored, 4), round((time.thread_time() - cpu0) / gb, 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--activations", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="PREFIX: writes PREFIX.json and PREFIX.md")
    ap.add_argument("--record-tokens", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--records", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--check", type=int, default=2)
    args = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for tokens in args.record_tokens:
        records = load_records(args.activations, tokens, args.records)
        gb = sum(r.numel() * 2 for r in records) / 1e9
        zstd_ratio, zstd_cpu_per_gb = bp16_zstd_reference(records, gb)
        dev = [r.to(device) for r in records]
        for batched in (False, True, "contiguous"):
            best = None
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            for _ in range(args.reps):
                blocks, stored, wall, cpu = encode_all(dev, batched)
                best = (wall, cpu) if best is None or wall < best[0] else best
            # What the encoder takes from the GPU's memory beyond its input: the connector's
            # headroom next to vLLM's KV cache.
            peak = (torch.cuda.max_memory_allocated() - base) / 1e6 if device == "cuda" else None
            checked = range(min(args.check, len(records)))
            row = {
                "device": device,
                "batched": batched,
                "record_tokens": tokens,
                "records": len(records),
                "record_mb": round(records[0].numel() * 2 / 1e6, 3),
                "equal_to_cpu_reference": all(blocks[i].to_bytes() == rust_block(records[i]) for i in checked),
                "ratio": round(gb * 1e9 / stored, 4),
                "gbps": round(gb / best[0], 3),
                "us_per_record": round(best[0] / len(records) * 1e6, 1),
                "peak_mb": None if peak is None else round(peak, 1),
                "input_mb": round(gb * 1e3, 1),
                "host_cpu_s_per_gb": round(best[1] / gb, 4),
                "host_syncs": host_syncs(dev, batched),
                "bp16_zstd_ratio": zstd_ratio,
                "bp16_zstd_cpu_s_per_gb": zstd_cpu_per_gb,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    md = [
        "# exp-huf in torch (layertap.gpu.exphuf) on real activations",
        "",
        "| device | batched | tokens/record | MB/record | equal to CPU | ratio | GB/s | us/record | peak MB over input MB | host CPU s/GB | syncs a call | bp16-zstd ratio | bp16-zstd CPU s/GB |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        md.append(
            f"| {r['device']} | {r['batched']} | {r['record_tokens']} | {r['record_mb']} | {r['equal_to_cpu_reference']} | {r['ratio']} | "
            f"{r['gbps']} | {r['us_per_record']} | {r['peak_mb']} / {r['input_mb']} | {r['host_cpu_s_per_gb']} | {r['host_syncs']} | {r['bp16_zstd_ratio']} | "
            f"{r['bp16_zstd_cpu_s_per_gb']} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
