"""What compressing on the GPU could give (issue 21), measured before anything is built on it.

On real bf16 activations (all-MiniLM-L6-v2's, ``.devbundle/acts``), cut into records of
``--record-tokens`` tokens, for each of nvCOMP's codecs (``nvidia-nvcomp-cu13``) and each input
(the raw bf16 bytes, the high byte plane, the low byte plane, split on the GPU by one strided
copy as bp16-zstd splits them):

- the ratio, and the GPU throughput of compressing a batch of records (GB/s of input, CUDA
  synchronised around the call, best of ``--reps``);
- with ``BitstreamKind.RAW`` (no nvCOMP header), whether a standard CPU library decodes the
  output to the same bytes: zstd frames (``zstandard``), raw deflate and gzip (``zlib``), LZ4
  blocks (``lz4``, where installed); the others have no CPU decoder outside nvCOMP;
- the CPU references on the same records, one thread: zstd level 1 of the raw bytes, of each
  plane, and of both planes in one frame (what bp16-zstd stores), with CPU seconds per GB.

Every codec runs in its own ``try``: one that fails is reported with its error and the rest go
on. Without CUDA or nvCOMP only the CPU references run, and the reason is printed (a dry run).

    python benches/gpu/bench_gpu_codecs.py --activations .devbundle/acts/activations-2k.safetensors \
        --out /tmp/layertap-results/gpu-codecs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from pathlib import Path

#: nvCOMP's algorithm names (``nvcomp.Codec(algorithm=...)``) and the CPU decoder of their RAW
#: bitstream, if a standard one exists.
ALGORITHMS = {
    "Zstd": "zstd",
    "Deflate": "deflate",
    "Gzip": "gzip",
    "LZ4": "lz4",
    "Snappy": None,
    "GDeflate": None,
    "ANS": None,
    "Bitcomp": None,
    "Cascaded": None,
}
INPUTS = ("raw", "high", "low")


def load_records(path: Path, tokens: int, count: int):
    """``count`` records of ``tokens`` tokens (bf16 ``[tokens, layers, hidden]``), cycling."""
    from safetensors.torch import load_file

    acts = load_file(str(path))["bf16"]
    out, start = [], 0
    for _ in range(count):
        if start + tokens > acts.shape[0]:
            start = 0
        out.append(acts[start : start + tokens].contiguous())
        start += tokens
    return out


def planes(t):
    """(high, low) byte planes of a bf16 tensor, as contiguous uint8 tensors (on its device)."""
    import torch

    b = t.reshape(-1).view(torch.uint8).reshape(-1, 2)
    return b[:, 1].contiguous(), b[:, 0].contiguous()


def cpu_references(records) -> dict:
    """zstd level 1 on the CPU, one thread, of each input and of both planes in one frame."""
    import torch
    import zstandard

    cctx = zstandard.ZstdCompressor(level=1)
    inputs: dict[str, list[bytes]] = {"raw": [], "high": [], "low": [], "bp16 (high + low, one frame)": []}
    for r in records:
        hi, lo = planes(r)
        inputs["raw"].append(r.reshape(-1).view(torch.uint8).numpy().tobytes())
        inputs["high"].append(hi.numpy().tobytes())
        inputs["low"].append(lo.numpy().tobytes())
        inputs["bp16 (high + low, one frame)"].append(inputs["high"][-1] + inputs["low"][-1])
    out = {}
    for name, blobs in inputs.items():
        raw = sum(len(b) for b in blobs)
        t0 = time.process_time()
        stored = sum(len(cctx.compress(b)) for b in blobs)
        cpu = time.process_time() - t0
        out[name] = {"ratio": round(raw / stored, 4), "cpu_s_per_gb": round(cpu / (raw / 1e9), 3), "bytes": raw}
    return out


def cpu_decode(kind: str, data: bytes, size: int) -> bytes:
    if kind == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
    if kind == "deflate":
        return zlib.decompress(data, -15)
    if kind == "gzip":
        return zlib.decompress(data, 31)
    if kind == "lz4":
        import lz4.block

        return lz4.block.decompress(data, uncompressed_size=size)
    raise ValueError(kind)


def to_bytes(nv_array) -> bytes:
    """The bytes of an nvCOMP array (device or host)."""
    import numpy as np

    try:
        return np.asarray(nv_array.cpu()).view(np.uint8).tobytes()
    except (TypeError, ValueError):  # no __array_interface__: through DLPack
        import torch

        return torch.from_dlpack(nv_array).cpu().view(torch.uint8).numpy().tobytes()


def gpu_trials(records, reps: int) -> list[dict]:
    import torch
    from nvidia import nvcomp

    stream = torch.cuda.current_stream().cuda_stream
    dev = [r.cuda() for r in records]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    split = [planes(r) for r in dev]
    torch.cuda.synchronize()
    split_s = time.perf_counter() - t0
    inputs = {
        "raw": [r.reshape(-1).view(torch.uint8) for r in dev],
        "high": [s[0] for s in split],
        "low": [s[1] for s in split],
    }
    rows = [{"what": "plane split", "seconds": split_s, "gb": sum(r.numel() * 2 for r in dev) / 1e9}]
    for algo, decoder in ALGORITHMS.items():
        for inp in INPUTS:
            for kind in ("RAW", "NVCOMP_NATIVE"):
                row = {"algorithm": algo, "input": inp, "bitstream": kind}
                try:
                    codec = nvcomp.Codec(
                        algorithm=algo, bitstream_kind=getattr(nvcomp.BitstreamKind, kind), cuda_stream=stream
                    )
                    arrays = nvcomp.as_arrays(inputs[inp], stream)
                    raw_bytes = sum(t.numel() for t in inputs[inp])
                    best = None
                    for _ in range(reps):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        enc = codec.encode(arrays)
                        torch.cuda.synchronize()
                        dt = time.perf_counter() - t0
                        best = dt if best is None else min(best, dt)
                    blobs = [to_bytes(e) for e in enc]
                    stored = sum(len(b) for b in blobs)
                    row.update(
                        ratio=round(raw_bytes / stored, 4), gbps=round(raw_bytes / best / 1e9, 2), bytes=raw_bytes
                    )
                    first = inputs[inp][0].cpu().numpy().tobytes()
                    try:  # the GPU's own round trip, on the first record (RAW may need the size)
                        row["gpu_roundtrip"] = to_bytes(codec.decode(enc[0])) == first
                    except Exception as e:
                        row["gpu_roundtrip"] = f"{type(e).__name__}: {str(e)[:120]}"
                    if kind == "RAW":
                        if decoder is None:
                            row["cpu_decodes"] = "no standard decoder"
                        else:
                            try:
                                ok = cpu_decode(decoder, blobs[0], len(first)) == first
                                row["cpu_decodes"] = f"{decoder}: {'equal' if ok else 'DIFFERENT'}"
                            except Exception as e:
                                row["cpu_decodes"] = f"{decoder}: {type(e).__name__}: {str(e)[:120]}"
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def table(result: dict) -> str:
    out = [f"# GPU codecs on real activations ({result['records']} records x {result['record_tokens']} tokens)", ""]
    out += ["CPU references (zstd level 1, one thread):", "", "| input | ratio | CPU s per GB |", "|---|---:|---:|"]
    for k, v in result["cpu"].items():
        out.append(f"| {k} | {v['ratio']:.3f} | {v['cpu_s_per_gb']:.2f} |")
    if result.get("gpu_unavailable"):
        out += ["", f"GPU: not run ({result['gpu_unavailable']})."]
        return "\n".join(out) + "\n"
    out += [
        "",
        "| algorithm | input | bitstream | ratio | GB/s | CPU decodes RAW | GPU round trip | error |",
        "|---|---|---|---:|---:|---|---|---|",
    ]
    for r in result["gpu"]:
        if "algorithm" not in r:
            out.insert(2, f"Plane split on the GPU: {r['gb']:.3f} GB in {r['seconds'] * 1e3:.2f} ms.\n")
            continue
        out.append(
            f"| {r['algorithm']} | {r['input']} | {r['bitstream']} | {r.get('ratio', '-')} | {r.get('gbps', '-')} | "
            f"{r.get('cpu_decodes', '-')} | {r.get('gpu_roundtrip', '-')} | {r.get('error', '')} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--activations", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="PREFIX: writes PREFIX.json and PREFIX.md")
    ap.add_argument("--record-tokens", type=int, default=256)
    ap.add_argument("--records", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    records = load_records(args.activations, args.record_tokens, args.records)
    result = {"records": len(records), "record_tokens": args.record_tokens, "cpu": cpu_references(records)}
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
        from nvidia import nvcomp

        result["nvcomp"] = getattr(nvcomp, "__version__", "?")
    except (ImportError, RuntimeError) as e:
        result["gpu_unavailable"] = f"{type(e).__name__}: {e}"
        print(f"GPU codecs not measured: {result['gpu_unavailable']}", file=sys.stderr)
    else:
        result["gpu"] = gpu_trials(records, args.reps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=1))
    Path(f"{args.out}.md").write_text(table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
