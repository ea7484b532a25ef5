"""A trainer's read loop on the GPU (issue 32, goal 3): the same records read as batches on the
device three ways, records/s and GB/s of bf16 hidden states (CUDA-synchronised, best of
``--reps`` passes over all records):

- ``exp-huf on device``: a shard the Rust writer wrote with ``codec="exp-huf"`` (blocks coded by
  column, mode 2), read by ``HiddenStatesDataset(decode_on=device)``: stored bytes copied as they
  are and decoded by the Triton kernels, ``pad_collate`` taking the device batch as it is;
- ``safetensors``: one raw safetensors file a record (``safetensors.torch.load_file``), the
  batch stacked on the host and copied to the device (pinned, one copy);
- ``exp-huf on host``: the same shard decoded by the core on the CPU (``decode_on=None``), then
  ``pad_collate`` and one copy to the device.

The files were just written, so they are read from the page cache: this measures decoding and
copying, not the disk (the bytes the disk would move are printed: exp-huf's are 1.5x fewer).
Every batch's hidden states are checked equal across the three (exit 1 if not).

    python benches/gpu/bench_gpu_dataset_decode.py --synthetic --shape 4x4096 --tokens 256 \\
        --records 256 --batch 64 --out /tmp/layertap-results/gpu-dataset-decode

A dry run on the CPU (Triton's interpreter, ``decode_on="cpu"``; the speeds mean nothing):

    PYTHONPATH=.venv/triton:python TRITON_INTERPRET=1 .venv/bin/python benches/gpu/bench_gpu_dataset_decode.py \\
        --synthetic --shape 2x64 --tokens 8 --records 6 --batch 3 --reps 1 --out /tmp/gpu-dataset-decode-dry
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu_codecs import load_records  # noqa: E402
from bench_gpu_exphuf_decode import sync, synthetic  # noqa: E402


def write(root: Path, sources: list[torch.Tensor]) -> tuple[Path, list[Path], dict]:
    """The records as an exp-huf shard (Rust writer) and as safetensors files; their sizes."""
    from safetensors.torch import save_file

    import layertap

    shard_dir, files = root / "exphuf", []
    with layertap.ShardWriter(str(shard_dir), writer_id="w", codec="exp-huf") as w:
        for i, h in enumerate(sources):
            ids = torch.arange(h.shape[0], dtype=torch.int64)
            w.submit(f"{i:06d}", {"hidden_states": h, "token_ids": ids}, {"layer_ids": "[0]"})
            files.append(root / "st" / f"{i:06d}.safetensors")
            files[-1].parent.mkdir(exist_ok=True)
            save_file({"hidden_states": h.contiguous(), "token_ids": ids}, str(files[-1]))
    sizes = {
        "exphuf_mb": round(sum(p.stat().st_size for p in shard_dir.rglob("*") if p.is_file()) / 1e6, 2),
        "safetensors_mb": round(sum(p.stat().st_size for p in files) / 1e6, 2),
    }
    return shard_dir, files, sizes


def batches(n: int, size: int) -> list[list[int]]:
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def read_dataset(path: Path, decode_on, device, plan) -> list[torch.Tensor]:
    from layertap.torch import HiddenStatesDataset, pad_collate

    keys = [f"{i:06d}" for i in range(max(b[-1] for b in plan) + 1)]  # in the order written
    ds = HiddenStatesDataset(path, keys=keys, decode_on=decode_on)
    out = []
    for b in plan:
        hidden = pad_collate(ds.__getitems__(b))["hidden_states"]
        out.append(hidden.to(device, non_blocking=True))
    return out


def read_safetensors(files: list[Path], device, plan) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    out = []
    for b in plan:
        host = torch.stack([load_file(str(files[i]))["hidden_states"] for i in b])
        if device.type == "cuda":
            host = host.pin_memory()
        out.append(host.to(device, non_blocking=True))
    return out


def timed(fn, device, reps: int) -> tuple[float, list[torch.Tensor]]:
    best, out = float("inf"), None
    for _ in range(reps):
        out = None
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--activations", type=Path, help="safetensors with a bf16 [tokens, layers, hidden] tensor 'bf16'")
    src.add_argument("--synthetic", action="store_true", help="activations-like random values")
    ap.add_argument("--shape", default="7x384", help="--synthetic records' LAYERSxHIDDEN (8B-like: 4x4096)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens a record")
    ap.add_argument("--records", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64, help="records a batch")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where to write the records (a temporary folder)")
    ap.add_argument("--out", type=Path, required=True, help="PREFIX: writes PREFIX.json and PREFIX.md")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    decode_on = "cuda" if cuda else "cpu"  # "cpu": Triton's interpreter (TRITON_INTERPRET=1)
    if args.activations:
        sources = load_records(args.activations, args.tokens, args.records)
    else:
        layers, hidden = (int(x) for x in args.shape.split("x"))
        distinct = [synthetic(args.tokens, layers, hidden, seed=i) for i in range(min(args.records, 16))]
        sources = [distinct[i % len(distinct)] for i in range(args.records)]
    raw_gb = sum(s.numel() * 2 for s in sources) / 1e9
    plan = batches(len(sources), args.batch)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        shard_dir, files, sizes = write(Path(tmp), sources)
        ways = {
            "exp-huf on device": lambda: read_dataset(shard_dir, decode_on, device, plan),
            "safetensors": lambda: read_safetensors(files, device, plan),
            "exp-huf on host": lambda: read_dataset(shard_dir, None, device, plan),
        }
        rows, outs = [], {}
        for name, fn in ways.items():
            wall, outs[name] = timed(fn, device, args.reps)
            per_s = round(len(sources) / wall, 1)
            rows.append(
                {"read": name, "records_per_s": per_s, "gbps": round(raw_gb / wall, 3), "wall_s": round(wall, 4)}
            )
            print(json.dumps(rows[-1]), flush=True)
    want = outs["safetensors"]
    equal = all(
        all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(want, got)) for got in outs.values()
    )
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (Triton's interpreter)",
        "torch": torch.__version__,
        "source": str(args.activations) if args.activations else f"synthetic {args.shape}",
        "tokens": args.tokens,
        "records": len(sources),
        "batch": args.batch,
        "raw_gb": round(raw_gb, 4),
        **sizes,
        "equal": equal,
        "rows": rows,
    }
    lines = [
        f"# Dataset reads on {result['device']} ({result['source']}, {args.tokens} tokens a record, "
        f"{len(sources)} records, batches of {args.batch})",
        "",
        f"exp-huf shard {sizes['exphuf_mb']} MB, safetensors {sizes['safetensors_mb']} MB; equal: {equal}",
        "",
        "| read | records/s | GB/s | wall s |",
        "|---|---|---|---|",
        *(f"| {r['read']} | {r['records_per_s']} | {r['gbps']} | {r['wall_s']} |" for r in rows),
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not equal:
        print("FAILED: the reads' hidden states differ", file=sys.stderr)
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
