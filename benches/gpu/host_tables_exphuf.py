"""The host's share of the torch exp-huf encoder (issue 21): per record, the CPU time of what
``layertap.gpu.exphuf`` does on the host between its two copies, the code lengths, the
canonical codes and the block heads, with the Rust core's builders (what runs where the
extension is built) and with the Python stand-ins (what ran before). On the H200 the
compressor thread of ``compress_on="gpu"`` was CPU-bound at 217 ms a batch, most of it here.

It needs no GPU: these steps run on the host whatever the device. The symbol counts are those
of real-looking activations (``[tokens, layers, hidden]`` bf16, counted by the encoder itself on
the CPU).

    python benches/gpu/host_tables_exphuf.py --records 64 --out benches/results/gpu-host-tables-cpu2.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from layertap._spec.exphuf import MAX_CONTEXTS, SYMBOLS
from layertap.gpu import exphuf as gx


def counts_of(records: int, tokens: int, seed: int = 0) -> np.ndarray:
    """``[records, 16, 512]`` symbol counts, as the encoder's first copy brings them to the host:
    each record's contexts counted over activation-like values."""
    g = torch.Generator().manual_seed(seed)
    out = np.zeros((records, MAX_CONTEXTS, SYMBOLS), dtype=np.int64)
    for r in range(records):
        scale = torch.logspace(-2, 2, 256)
        x = (torch.randn((tokens, 3, 256), generator=g) * scale).to(torch.bfloat16)
        top = (x.reshape(-1).view(torch.int16).to(torch.int64) & 0xFFFF) >> 7
        sym = ((top & 0xFF) << 1) | (top >> 8)
        # Context: the exponent bucket of the element one layer back (as the encoder's).
        prev = torch.roll(top, 256)
        ctx = (prev >> 8) * 8 | (torch.clamp((prev & 0xFF) - 127, -4, 3) & 7)
        out[r] = torch.bincount(ctx * SYMBOLS + sym, minlength=MAX_CONTEXTS * SYMBOLS).reshape(16, 512).numpy()
    return out


def host_steps(hist: np.ndarray, native: bool) -> tuple[float, float, float]:
    """CPU seconds of the code lengths (from the Rust core either way), the codes and the heads
    (from it with ``native``, else from the Python stand-ins) for the batch ``hist``."""
    k = hist.shape[0]
    strides = [768] * k
    modes = np.full(k, 127)
    seg_bytes = np.full(4 * k, 123_456, dtype=np.int64)
    t0 = time.process_time()
    lengths = gx.code_lengths(hist.reshape(-1, SYMBOLS)).reshape(k, MAX_CONTEXTS, SYMBOLS)
    t1 = time.process_time()
    # Before, only the code lengths came from the Rust core.
    saved = sys.modules.get("layertap._native")
    if not native:
        sys.modules["layertap._native"] = None  # the extension's builders do not import
    try:
        gx.reversed_codes_of(lengths.reshape(-1, SYMBOLS))
        t2 = time.process_time()
        gx._coded_heads("BF16", 0, strides, modes, lengths, seg_bytes)
        t3 = time.process_time()
    finally:
        sys.modules["layertap._native"] = saved
    return t1 - t0, t2 - t1, t3 - t2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=64, help="records per batch (default 64)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per record (default 256)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, help="write the table (markdown) here too")
    args = ap.parse_args(argv)
    hist = counts_of(args.records, args.tokens)
    lines = [
        f"Host CPU per record of the torch exp-huf encoder's table steps ({args.records} records a batch, "
        f"best of {args.reps}; `python benches/gpu/host_tables_exphuf.py --records {args.records}`)",
        "",
        "| builders | code lengths | codes | heads | total per record | per batch |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for native, name in ((False, "Python (before)"), (True, "Rust core (now)")):
        best = min((host_steps(hist, native) for _ in range(args.reps)), key=sum)
        per = [1e3 * s / args.records for s in best]
        lines.append(
            f"| {name} | {per[0]:.3f} ms | {per[1]:.3f} ms | {per[2]:.3f} ms | {sum(per):.3f} ms | "
            f"{1e3 * sum(best):.1f} ms |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
