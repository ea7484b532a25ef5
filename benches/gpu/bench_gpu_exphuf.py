"""The encoder of exp-huf (layertap.gpu.exphuf) on the GPU (issues 21, 32), its device work in
Triton kernels and in torch operations side by side (``--impl``): on real bf16 activations
(all-MiniLM-L6-v2's, ``.devbundle/acts``), in records of ``--record-tokens`` tokens, encoded
one record a call, the records of one engine step a call (``--step-tokens``: 64 x 256 tokens,
8 x 2048; ``encode_blocks``) and the same into one buffer (``encode_contiguous``, the
connector's call),

- whether its bytes equal the Rust writer's encoder's (the CPU reference) for the first
  ``--check`` records;
- the ratio, and per record the wall time (CUDA synchronised) and the host CPU time of the
  calling thread (launches, the code lengths built from the counts), as GB/s of input and host
  CPU seconds per GB, best of ``--reps`` passes, and the synchronising calls torch sees in one
  call (``host_syncs``: waits in which the thread spins);
- the same for bp16-zstd level 1 on one CPU thread (the Rust writer's codec, through zstandard
  here), for the "10x fewer host CPU seconds per GB" of the issue.

Without CUDA it runs on the CPU (a dry run: the speeds mean nothing; Triton's kernels need
``TRITON_INTERPRET=1`` and triton on the path there, and ``--tiny``, as the interpreter is slow):

    python benches/gpu/bench_gpu_exphuf.py --activations .devbundle/acts/activations-2k.safetensors \\
        --out /tmp/layertap-results/gpu-exphuf
    PYTHONPATH=.venv/triton:python TRITON_INTERPRET=1 .venv/bin/python benches/gpu/bench_gpu_exphuf.py \\
        --activations .devbundle/acts/activations-2k.safetensors --out /tmp/gpu-exphuf-dry --tiny
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu_codecs import load_records  # noqa: E402


def calls(records, batch):
    """The records cut into calls of ``batch`` records (all in one call where ``batch`` is 0)."""
    batch = batch or len(records)
    return [records[k : k + batch] for k in range(0, len(records), batch)]


#: The variants ``--impl`` names: who does the device work, and where the code tables are built.
VARIANTS = {
    "triton": {"impl": "triton", "tables": "host"},
    "triton-device-tables": {"impl": "triton", "tables": "device"},
    "triton-device-tables-histogram": {"impl": "triton", "tables": "device", "counts": "histogram"},
    "torch": {"impl": "torch", "tables": "host"},
}


def variant(name: str) -> dict:
    """The encoder's arguments for variant ``name``; sets how the Triton kernels add counts."""
    args = dict(VARIANTS[name])
    counts = args.pop("counts", "atomic")
    if args["impl"] == "triton":
        from layertap.gpu import exphuf_triton

        exphuf_triton.COUNTS = counts
    return args


def encode_all(records, batched, impl, batch):
    """``batched``: False (one call a record), True (``encode_blocks``, ``batch`` records a
    call) or "contiguous" (``encode_contiguous``, the connector's call: every block of a call
    in one buffer)."""
    from layertap.gpu.exphuf import Block, encode_block, encode_blocks, encode_contiguous

    torch.cuda.synchronize() if torch.cuda.is_available() else None
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    blocks = []
    if batched == "contiguous":
        for part in calls(records, batch):
            buf, sizes = encode_contiguous(part, "BF16", **variant(impl))
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            blocks += [Block(b"", buf[a : a + n]) for a, n in zip(starts, sizes)]
    elif batched:
        for part in calls(records, batch):
            blocks += encode_blocks(part, "BF16", **variant(impl))
    else:
        blocks = [encode_block(r, "BF16", **variant(impl)) for r in records]
    total = sum(len(b) for b in blocks)  # the body's size is known on the host: no extra sync
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    return blocks, total, time.perf_counter() - wall0, time.thread_time() - cpu0


def host_syncs(records, batched, impl, batch) -> int | None:
    """The synchronising calls torch sees in one pass (its sync debug mode: a copy to the host
    that waits, ``.item()``, a boolean mask's count, bincount's min and max), each a wait with
    the calling thread spinning; the encoder's own waits (blocking events) are not among them.
    None without CUDA."""
    if not torch.cuda.is_available():
        return None
    import warnings

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            encode_all(records, batched, impl, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # (encode_all's own torch.cuda.synchronize calls are not among the warnings: the debug mode
    # warns of implicit synchronisations only.)
    return sum("synchroniz" in str(w.message) for w in caught)


def rust_block(t: torch.Tensor) -> bytes:
    """The Rust encoder's exp-huf block of ``t`` coded by element (mode 1, what the GPU encoder
    writes; its payload of a blob holding ``t`` alone)."""
    from layertap import _native
    from layertap._spec.blob import build_header

    header = build_header([("t", "BF16", tuple(t.shape))], {})
    return _native.exphuf_encode(header + t.reshape(-1).view(torch.uint8).numpy().tobytes(), by="element")[
        len(header) :
    ]


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


def measure(args, records, dev, gb: float, impl: str, batched, batch: int, device: str) -> dict:
    """One variant's row: best of ``args.reps`` passes over ``dev`` after one that compiles."""
    best = None
    encode_all(dev[:batch], batched, impl, batch)  # Triton compiles its kernels
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for _ in range(args.reps):
        blocks, stored, wall, cpu = encode_all(dev, batched, impl, batch)
        best = (wall, cpu) if best is None or wall < best[0] else best
    # What the encoder takes from the GPU's memory beyond its input: the connector's headroom
    # next to vLLM's KV cache.
    peak = (torch.cuda.max_memory_allocated() - base) / 1e6 if device == "cuda" else None
    checked = range(min(args.check, len(records)))
    return {
        "record_mb": round(records[0].numel() * 2 / 1e6, 3),
        "equal_to_cpu_reference": all(blocks[i].to_bytes() == rust_block(records[i]) for i in checked),
        "ratio": round(gb * 1e9 / stored, 4),
        "gbps": round(gb / best[0], 3),
        "us_per_record": round(best[0] / len(records) * 1e6, 1),
        "peak_mb": None if peak is None else round(peak, 1),
        "input_mb": round(gb * 1e3, 1),
        "host_cpu_s_per_gb": round(best[1] / gb, 4),
        "host_syncs": host_syncs(dev[:batch], batched, impl, batch),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--activations", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="PREFIX: writes PREFIX.json and PREFIX.md")
    ap.add_argument("--record-tokens", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--records", type=int, default=64, help="records of each size")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--check", type=int, default=2)
    ap.add_argument(
        "--batch",
        type=int,
        default=0,
        help="records a call of the batched modes (default: those of one step of --step-tokens)",
    )
    ap.add_argument(
        "--step-tokens",
        type=int,
        default=16384,
        help="tokens of an engine step: the batched modes take this many tokens' records a call (64 x 256, 8 x 2048)",
    )
    ap.add_argument(
        "--impl",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        help="who does the device work, and where the tables are built (default all, side by side)",
    )
    ap.add_argument("--max-records", type=int, default=0, help="at most this many records a size (0: --records)")
    ap.add_argument(
        "--tiny", action="store_true", help="a dry run: 16-token records, at most 4, one pass (the interpreter)"
    )
    args = ap.parse_args(argv)
    if args.tiny:
        args.record_tokens, args.records, args.reps, args.step_tokens = [16], min(args.records, 4), 1, 32
    if args.max_records:
        args.records = min(args.records, args.max_records)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    failed: dict[str, str] = {}  # variant -> its error
    for tokens in args.record_tokens:
        batch = args.batch or max(1, args.step_tokens // tokens)
        records = load_records(args.activations, tokens, args.records)
        gb = sum(r.numel() * 2 for r in records) / 1e9
        zstd_ratio, zstd_cpu_per_gb = bp16_zstd_reference(records, gb)
        dev = [r.to(device) for r in records]
        for impl, batched in ((i, b) for i in args.impl for b in (False, True, "contiguous")):
            where = {"device": device, "impl": impl, "batched": batched, "batch": batch if batched else 1}
            where |= {"record_tokens": tokens, "records": len(records)}
            if impl in failed:  # (a variant that failed once, its kernels' compilation say, fails again)
                row = where | {"error": failed[impl]}
            else:
                try:
                    row = where | measure(args, records, dev, gb, impl, batched, batch, device)
                except Exception as e:  # one variant's failure costs the GPU call none of the others
                    traceback.print_exc()
                    failed[impl] = f"{type(e).__name__}: {e}"[:300]
                    row = where | {"error": failed[impl]}
                row |= {"bp16_zstd_ratio": zstd_ratio, "bp16_zstd_cpu_s_per_gb": zstd_cpu_per_gb}
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    md = [
        "# exp-huf on the device (layertap.gpu.exphuf: Triton kernels, torch operations) on real activations",
        "",
        "| device | impl | batched | records a call | tokens/record | MB/record | equal to CPU | ratio | GB/s | us/record | peak MB over input MB | host CPU s/GB | syncs a call | bp16-zstd ratio | bp16-zstd CPU s/GB |",
        "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            md.append(
                f"| {r['device']} | {r['impl']} | {r['batched']} | {r['batch']} | {r['record_tokens']} | - | "
                f"failed: {r['error']} | - | - | - | - | - | - | - | - |"
            )
            continue
        md.append(
            f"| {r['device']} | {r['impl']} | {r['batched']} | {r['batch']} | {r['record_tokens']} | {r['record_mb']} | {r['equal_to_cpu_reference']} | {r['ratio']} | "
            f"{r['gbps']} | {r['us_per_record']} | {r['peak_mb']} / {r['input_mb']} | {r['host_cpu_s_per_gb']} | {r['host_syncs']} | {r['bp16_zstd_ratio']} | "
            f"{r['bp16_zstd_cpu_s_per_gb']} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
