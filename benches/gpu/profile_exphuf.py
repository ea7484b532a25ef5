"""Where the torch exp-huf encoder's time goes (issue 21): torch.profiler over
``encode_contiguous`` of ``--records`` records of ``--record-tokens`` tokens of real activations,
the kernels by device time and the host's share (Python, the two copies to the host, the code
lengths). Without CUDA it profiles the CPU (a dry run).

    python benches/gpu/profile_exphuf.py --activations .devbundle/acts/activations.safetensors --out PREFIX
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu_codecs import load_records  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from torch.profiler import ProfilerActivity, profile

    from layertap.gpu.exphuf import encode_contiguous

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--activations", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="PREFIX: writes PREFIX.txt")
    ap.add_argument("--record-tokens", type=int, default=2048)
    ap.add_argument("--records", type=int, default=16)
    ap.add_argument("--impl", choices=["triton", "torch"], default=None, help="default: the encoder's choice")
    ap.add_argument("--tables", choices=["host", "device"], default=None, help="default: the encoder's choice")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    records = [r.to(device) for r in load_records(args.activations, args.record_tokens, args.records)]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(2):  # warm-up: kernels loaded, allocator filled
        encode_contiguous(records, "BF16", impl=args.impl, tables=args.tables)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities, record_shapes=False) as prof:
        encode_contiguous(records, "BF16", impl=args.impl, tables=args.tables)
        sync()
    wall = time.perf_counter() - t0
    mb = sum(r.numel() * 2 for r in records) / 1e6
    lines = [
        f"{args.records} records x {args.record_tokens} tokens = {mb:.1f} MB on {device} ({args.impl or 'default'} impl, {args.tables or 'default'} tables); "
        f"wall {wall * 1e3:.1f} ms (profiled)"
    ]
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    lines.append(prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=60))
    lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    # The host's side by Python function (the code lengths, the heads, the launches).
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    encode_contiguous(records, "BF16", impl=args.impl, tables=args.tables)
    sync()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
    lines.append(buf.getvalue())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines)
    args.out.with_suffix(".txt").write_text(text)
    print(text[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
