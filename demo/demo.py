"""``make demo``: ``layertap generate`` end to end on a CPU.

Builds a tiny random Llama locally (the tests' ``tests/tiny_llama.py``: nothing is downloaded),
runs ``layertap generate`` over the chat JSONL beside this script (``chat.jsonl``) in two goes, the second resuming
the first, reads one record back, and prints ``layertap inspect`` of the dataset. Runs in under a
minute on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

from layertap.reader import open as open_dataset

HERE = Path(__file__).resolve().parent
DATA = HERE / "chat.jsonl"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="demo/demo.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--output", default="demo-output", help="folder for the model and the dataset (default: %(default)s)"
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    return p.parse_args(argv)


def _quiet() -> None:
    """vLLM on a CPU warns about what a CPU lacks (Triton, tcmalloc, OpenMP, NUMA binding) and
    what an experimental API is; none of it matters here. Errors still show."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Writing model shards"
    # The engine in this process starts in about 3 s, against 12 s in a process of its own.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)  # "Triton not available"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    _quiet()
    out = os.path.abspath(args.output)
    dataset = os.path.join(out, "hidden-states")
    shutil.rmtree(dataset, ignore_errors=True)
    # vLLM's IPC sockets, temporary files and caches stay in the demo folder.
    for var, sub in (("TMPDIR", "tmp"), ("VLLM_CACHE_ROOT", "vllm-cache")):
        os.environ.setdefault(var, os.path.join(out, sub))
        os.makedirs(os.environ[var], exist_ok=True)
    tempfile.tempdir = None

    sys.path.insert(0, str(HERE.parent / "tests"))
    from layertap.cli import main as layertap_cli
    from tiny_llama import build_tiny_llama

    # Saved in the dtype it runs in: vLLM warns about every weight it casts.
    model = build_tiny_llama(os.path.join(out, f"tiny-llama-{args.dtype}"), dtype=args.dtype)
    rows = len(DATA.read_text().splitlines())
    print(f"model: random 4-layer Llama ({args.dtype}) in {model}\ndata: {rows} chats in {DATA}\n", flush=True)
    # The KV cache is sized by generate on a CPU (docs/GENERATE.md, "On a CPU"); enforce_eager
    # skips torch.compile's ~40 s at start-up there.
    engine_args = json.dumps({"dtype": args.dtype, "enforce_eager": True})
    generate = ["generate", model, "--data", str(DATA), "--out", dataset, "--engine-args", engine_args]
    steps = [
        (f"$ layertap generate MODEL --data chat.jsonl --out {dataset} --limit 10", [*generate, "--limit", "10"]),
        ("$ layertap generate MODEL --data chat.jsonl (the same --out: resumes after the 10 rows done)", generate),
    ]
    for title, cmd in steps:
        print(title, flush=True)
        status = layertap_cli(cmd)
        print(flush=True)
        if status:
            return status

    with open_dataset(dataset) as ds:
        rec = ds["7"]
        print(
            f"record of row 7: {rec}\n  layer_ids {rec.layer_ids}, metadata row={rec.metadata['row']!r}, "
            f"tokens {rec.token_ids[:12].tolist()}...\n",
            flush=True,
        )
    print(f"$ layertap inspect {dataset}", flush=True)
    return layertap_cli(["inspect", dataset])


if __name__ == "__main__":
    sys.exit(main())
