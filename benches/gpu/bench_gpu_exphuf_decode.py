"""The Triton decoder of exp-huf (layertap.gpu.exphuf_decode) on the GPU (issue 32, goal 3): on
real bf16 activations (``[tokens, layers, hidden]``, all-MiniLM-L6-v2's, ``.devbundle/acts``) or
``--synthetic`` ones (``--shape LAYERSxHIDDEN``, e.g. ``4x4096`` for an 8B model's), records
encoded on the host by the Rust encoder, coded by element (block mode 1, ``element`` rows, what
``compress_on="gpu"`` writes) and by column (mode 2, ``columns`` rows: ``_native.exphuf_encode``'s
default, what the Rust writer writes; one lane a stream, 4 streams a 32,768 elements; ``--modes``
picks), their payloads handed to
``decode_records`` as host bytes (what a trainer reads from a shard) in batches of ``records x
tokens``, and for each batch and kernel variant:

- whether every decoded tensor's bytes equal the original's (checked on the device; exit 1 if not);
- decoded GB/s (bf16 bytes out per wall second, CUDA-synchronised, best of ``--reps``): the whole
  call (staging, host parse and tables, copy of the payloads, kernels, the status read) and the
  kernels alone (CUDA events);
- host CPU seconds per decoded GB (the calling thread) and the host's parse time;
- the lanes (streams decoded side by side: 4 a record by element, 4 a 32,768 elements by
  column), the longest lane's elements, and the kernels' nanoseconds per element of one lane:
  the format's bound is lanes x 2 bytes / that;
- for scale: the same raw bf16 bytes copied host to device (pinned, one cudaMemcpy), and the
  Rust core decoding one record on one CPU thread (``_native.decode_record``).

    python benches/gpu/bench_gpu_exphuf_decode.py --activations .devbundle/acts/activations-2k.safetensors \\
        --out /tmp/layertap-results/gpu-exphuf-decode

A dry run on the CPU (Triton's interpreter: the speeds mean nothing, the checks do):

    PYTHONPATH=.venv/triton:python TRITON_INTERPRET=1 .venv/bin/python benches/gpu/bench_gpu_exphuf_decode.py \\
        --synthetic --tiny --out /tmp/gpu-exphuf-decode-dry
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu_codecs import load_records  # noqa: E402

#: (tokens a record, records a batch): the issue's 64 x 256-token batches and 2048-token records
#: first, then larger batches, for lanes enough to fill the device.
BATCHES = [(256, 64), (2048, 16), (256, 256), (2048, 64), (256, 1024), (2048, 256)]
#: Kernel variants: (name, lanes a program, streams a program decodes (None: decode_records'
#: choice), the next element's context loaded a step early, the stream's words kept from step to
#: step). The first is decode_records' default.
VARIANTS = [
    ("default", None, None, True, True),
    ("live-4", 32, 4, True, True),
    ("live-8", 32, 8, True, True),
    ("live-16", 32, 16, True, True),
    ("dense-32", 32, 32, True, True),
    ("dense-128", 128, 128, True, True),
    ("no-buffer", None, None, True, False),
    ("plain", None, None, False, False),
]
#: Variants of the mode-2 kernels (records coded by column): (name, lanes a program of the streams
#: kernel; None: decode_records' choice, ``COLUMN_LANES``). The first is the default.
COLUMN_VARIANTS = [("columns", None), ("columns-32", 32), ("columns-64", 64), ("columns-256", 256)]


def synthetic(tokens: int, layers: int = 7, hidden: int = 384, seed: int = 0) -> torch.Tensor:
    """Activations-like bf16 ``[tokens, layers, hidden]``: exponents vary by channel and layer."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-2, 1, hidden) * torch.linspace(0.5, 4, layers)[:, None]
    return (torch.randn((tokens, layers, hidden), generator=g) * scale).to(torch.bfloat16)


def blob_of(t: torch.Tensor) -> bytes:
    from layertap._spec.blob import build_header

    header = build_header([("hidden_states", "BF16", tuple(t.shape))], {"key": "k"})
    return header + t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def host_copy_gbps(nbytes: int, device, reps: int) -> float | None:
    """Raw bytes host (pinned) to device, one copy: GB/s, best of ``reps``."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def cpu_decode_s_per_gb(stored: bytes, raw_len: int) -> float:
    """The Rust core decoding one record on this thread: CPU seconds per decoded GB (best of 3)."""
    from layertap._native import decode_record

    best = float("inf")
    for _ in range(3):
        t0 = time.thread_time()
        decode_record(stored, key="k", codec=3, raw_len=raw_len, payload_crc=None, path="bench", offset=0)
        best = min(best, time.thread_time() - t0)
    return best / (raw_len / 1e9)


def column_lanes(stored: bytes, n: int) -> tuple[int, int]:
    """The streams of a payload's first block (coded by column, mode 2; ``n`` elements), and the
    longest one's elements (its columns times the rows)."""
    head_len = 8 + int.from_bytes(stored[:8], "little")
    assert stored[head_len] == 2, "the block is not coded by column"
    columns = int.from_bytes(stored[head_len + 5 : head_len + 9], "little")
    streams = int.from_bytes(stored[head_len + 9 : head_len + 13], "little")
    return streams, -(-columns // streams) * (n // columns)


def run_batch(sources, payloads, device, variant, reps) -> dict:
    """One batch (``payloads[i]`` encodes ``sources[i % len(sources)]``) with one kernel variant
    (of ``VARIANTS`` for payloads coded by element, ``COLUMN_VARIANTS`` by column)."""
    from layertap.gpu.exphuf_decode import decode_records

    by_column = len(variant) == 2
    if by_column:
        name, lanes_per_program, live_lanes, ahead, buffered = variant[0], None, None, True, True
        options = {"column_lanes": variant[1]}
    else:
        name, lanes_per_program, live_lanes, ahead, buffered = variant
        options = {}
    want = [s.to(device) for s in sources]
    raw_bytes = sum(want[i % len(want)].numel() * 2 for i in range(len(payloads)))
    best: dict = {}
    equal = True
    for rep in range(reps):
        timings: dict = {}
        sync(device)
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        out = decode_records(
            payloads,
            device,
            lanes_per_program=lanes_per_program,
            live_lanes=live_lanes,
            ahead=ahead,
            buffered=buffered,
            timings=timings,
            **options,
        )
        sync(device)
        wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
        if rep == 0:  # bit for bit, on the device
            for i, rec in enumerate(out):
                got = rec["hidden_states"]
                ref = want[i % len(want)]
                equal &= got.shape == ref.shape and torch.equal(got.view(torch.int16), ref.view(torch.int16))
        if not best or wall < best["wall_s"]:
            best = {"wall_s": wall, "cpu_s": cpu, **timings}
        del out
    tokens, layers, hidden = sources[0].shape
    if by_column:
        streams, longest = column_lanes(payloads[0], tokens * layers * hidden)
        lanes = streams * len(payloads)
    else:
        lanes = 4 * len(payloads)
        longest = -(-tokens * layers * hidden // 4)
    row = {
        "variant": name,
        "shape": f"{layers}x{hidden}",
        "records": len(payloads),
        "tokens": tokens,
        "raw_mb": round(raw_bytes / 1e6, 1),
        "ratio": round(raw_bytes / sum(len(p) for p in payloads), 4),
        "equal": bool(equal),
        "gbps": round(raw_bytes / best["wall_s"] / 1e9, 3),
        "host_cpu_s_per_gb": round(best["cpu_s"] / (raw_bytes / 1e9), 4),
        "parse_ms": round(1e3 * best["parse_s"], 2),
        # its pieces: the payloads staged and copied, their heads parsed, the tables built
        "stage_ms": round(1e3 * best.get("stage_s", 0.0), 2),
        "records_ms": round(1e3 * best.get("records_s", 0.0), 2),
        "tables_ms": round(1e3 * best.get("tables_s", 0.0), 2),
        "lanes": lanes,
        "longest_lane": longest,
    }
    if "kernel_s" in best:
        row["kernel_gbps"] = round(raw_bytes / best["kernel_s"] / 1e9, 3)
        row["ns_per_element_lane"] = round(1e9 * best["kernel_s"] / longest, 2)
    return row


def markdown(result: dict) -> str:
    rows = result["batches"]
    cols = ["variant", "shape", "records", "tokens", "raw_mb", "ratio", "equal", "gbps", "kernel_gbps", "memcpy_gbps",
            "host_cpu_s_per_gb", "parse_ms", "stage_ms", "records_ms", "tables_ms", "lanes", "longest_lane", "ns_per_element_lane"]  # fmt: skip
    lines = [
        f"# exp-huf decoder on {result['device']} ({result['source']})",
        "",
        f"torch {result['torch']}, triton {result['triton']}; Rust core on one CPU thread: "
        f"{result.get('cpu_rust_decode_s_per_gb')} s/GB by element, "
        f"{result.get('cpu_rust_decode_columns_s_per_gb')} s/GB by column"
        + (f"; skipped: {', '.join(result['skipped'])}" if result.get("skipped") else ""),
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--activations", type=Path, help="safetensors with a bf16 [tokens, layers, hidden] tensor 'bf16'")
    src.add_argument("--synthetic", action="store_true", help="activations-like random values")
    ap.add_argument("--out", type=Path, required=True, help="PREFIX: writes PREFIX.json and PREFIX.md")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=240, help="start no batch after this many seconds")
    ap.add_argument("--batches", nargs="+", default=None, help="TOKENSxRECORDS, e.g. 256x64 2048x16")
    ap.add_argument("--variants", nargs="+", default=None, help=f"of {[v[0] for v in VARIANTS + COLUMN_VARIANTS]}")
    ap.add_argument("--modes", nargs="+", default=["column", "element"], choices=["column", "element"])
    ap.add_argument("--shape", default="7x384", help="--synthetic records' LAYERSxHIDDEN (8B-like: 4x4096)")
    ap.add_argument(
        "--tiny", action="store_true", help="dry-run sizes (4-token records of 7 x 32, batches of 2 and 3, 1 rep)"
    )
    args = ap.parse_args(argv)
    import triton

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batches = [tuple(int(x) for x in b.split("x")) for b in args.batches] if args.batches else BATCHES
    variants = [v for v in VARIANTS if "element" in args.modes and (args.variants is None or v[0] in args.variants)]
    variants += [
        v for v in COLUMN_VARIANTS if "column" in args.modes and (args.variants is None or v[0] in args.variants)
    ]
    layers, hidden = (int(x) for x in args.shape.split("x"))
    reps = args.reps
    if args.tiny:
        batches, reps = [(4, 2), (8, 3)], 1
    from layertap._native import exphuf_encode

    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton's interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "source": str(args.activations) if args.activations else "synthetic",
        "batches": [],
    }
    encoded: dict[int, tuple[list, list]] = {}
    failed = False
    started = time.perf_counter()
    for tokens, records in batches:
        if time.perf_counter() - started > args.budget_s:
            print(f"skipped {tokens}x{records}: past --budget-s {args.budget_s}", flush=True)
            result.setdefault("skipped", []).append(f"{tokens}x{records}")
            continue
        if tokens not in encoded:
            count = 8 if not args.tiny else 2
            if args.activations:
                sources = load_records(args.activations, tokens, count)
            else:
                sources = [synthetic(tokens, layers, hidden, seed=i) for i in range(count)]
            if args.tiny:
                sources = [s[:, :, :32].contiguous() for s in sources]
            # distinct records only (the file holds 2048 tokens): a batch cycles through them
            sources = list({s.view(torch.int16).numpy().tobytes(): s for s in sources}.values())
            blobs = [blob_of(s) for s in sources]
            # Coded by element (mode 1, compress_on="gpu"'s) and by column (mode 2, the writer's).
            encoded[tokens] = (
                sources,
                {
                    "element": [exphuf_encode(b, by="element") for b in blobs],
                    "column": [exphuf_encode(b) for b in blobs],
                },
            )
            for by, key in (("element", "cpu_rust_decode_s_per_gb"), ("column", "cpu_rust_decode_columns_s_per_gb")):
                stored = encoded[tokens][1][by][0]
                result.setdefault(key, round(cpu_decode_s_per_gb(stored, len(blobs[0])), 3))
        sources, stored = encoded[tokens]
        memcpy = host_copy_gbps(sum(sources[i % len(sources)].numel() * 2 for i in range(records)), device, reps)
        for variant in variants:
            by = "column" if len(variant) == 2 else "element"
            payloads = [stored[by][i % len(stored[by])] for i in range(records)]
            row = run_batch(sources, payloads, device, variant, reps)
            row["memcpy_gbps"] = None if memcpy is None else round(memcpy, 2)
            result["batches"].append(row)
            failed |= not row["equal"]
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    if failed:
        print("FAILED: a decoded tensor differs from the original", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
