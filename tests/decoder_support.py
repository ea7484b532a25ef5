"""What the tests of the record decoder (``layertap._decoder``) share: one live (unfinished)
shard per codec, and a child process that reads records through every production read path and
says which modules of the Python reference's decoding it imported."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import torch

import layertap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: (codec, lossy) of each writer: every codec, and fp8 records (docs/FP8.md) under two of them.
CASES = [
    ("none", None),
    ("zstd", None),
    ("bp16-zstd", None),
    ("exp-huf", None),
    ("exp-huf", "fp8-e4m3"),
    ("bp16-zstd", "fp8-e4m3"),
]
RECORDS = 3

#: The Python reference's decoding: its record decoder and the payload codecs it runs. No
#: production read path may import them (the core decodes).
REFERENCE_DECODER = ("layertap._py.decode", "layertap._spec.codecs", "layertap._spec.exphuf")


def writer_id(codec: str, lossy: str | None) -> str:
    return f"w-{codec}" + ("-fp8" if lossy else "")


def tensors(i: int) -> dict:
    """A record of 40 tokens x 3 layers x 64 (bf16): wide enough for exp-huf's coded blocks."""
    g = torch.Generator().manual_seed(i)
    return {
        "hidden_states": (torch.randn(40, 3, 64, generator=g) * (1 + i)).to(torch.bfloat16),
        "token_ids": torch.arange(40, dtype=torch.int64) + 1000 * i,
    }


def write_case(directory, codec: str, lossy: str | None, n: int = RECORDS):
    """An open Rust writer of ``n`` flushed records (keys ``{writer_id}-r{i}``): its shard is
    live, locked and without an index until the writer is closed."""
    wid = writer_id(codec, lossy)
    w = layertap.ShardWriter(os.fspath(directory), writer_id=wid, codec=codec, lossy=lossy, durability="none")
    for i in range(n):
        w.submit(f"{wid}-r{i}", tensors(i), {"layer_ids": "[1, 2, 3]", "i": str(i)})
    w.flush()
    return w


@contextlib.contextmanager
def live_shards(directory):
    """One live shard per case in ``directory``, their writers open while the block runs."""
    writers = [write_case(directory, codec, lossy) for codec, lossy in CASES]
    try:
        yield [writer_id(codec, lossy) for codec, lossy in CASES]
    finally:
        for w in writers:
            w.close()


def as_plain(record) -> tuple:
    """A record's metadata and tensors (name, dtype, shape, bytes), to compare readers."""
    return (
        record.key,
        record.metadata,
        [(name, str(t.dtype), tuple(t.shape), t.tobytes()) for name, t in record.tensors.items()],
    )


#: Run by ``read_in_child``: imports the production read paths, reads every record of the
#: dataset through them, prints what it read and which reference modules are in sys.modules.
_CHILD = r"""
import json, sys
import layertap.mooncake.backend
from layertap.follow import follow
from layertap.reader import open as open_dataset
from layertap.vllm.online import RecordLocation, fetch

directory, store, keys = sys.argv[1], sys.argv[2] or None, json.loads(sys.argv[3])
read = {}
source = store or directory
for r in follow(source, timeout=0, tensors="numpy"):
    read.setdefault("follow", []).append(r.key)
with open_dataset(source, backend="rust", tensors="numpy") as ds:
    read["open"] = [r.key for r in ds]
for writer_id, key in keys:
    r = fetch(RecordLocation(directory, writer_id, key, store=store), timeout=30, durable=False)
    read.setdefault("fetch", []).append(r.key)
print(json.dumps({"read": read, "modules": sorted(sys.modules)}))
"""


def read_in_child(directory, keys: list[tuple[str, str]], store: str | None = None) -> dict:
    """What ``_CHILD`` read and imported, run with the default backend (auto: the Rust core)."""
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "python")}
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, os.fspath(directory), store or "", json.dumps(keys)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
