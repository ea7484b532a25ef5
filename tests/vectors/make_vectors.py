"""Writes the shared test vectors (tiny shards and expected.json) described in README.md.

    PYTHONPATH=python python tests/vectors/make_vectors.py [OUT_DIR]

OUT_DIR defaults to this script's folder. The output is deterministic: shard ids, creation
times and the writer string are fixed, and the tensor values come from integer formulas, so
running it again gives the same bytes (given the same zstd library for the zstd files).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile

import numpy as np
import torch

from layertap._py.reader import PyShardReader
from layertap._py.writer import PyShardWriter
from layertap._spec.codecs import decode
from layertap._spec.format import CODECS, crc32c, decode_trailer
from layertap._tensors import TORCH_DTYPES
from layertap.errors import CorruptRecordError
from layertap.reader import _reason

CREATED_UNIX_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z
WRITER = "layertap-python 0.1.0"
USER_META = {"run": "test-vectors", "note": "ünïcode ✓"}


class VectorWriter(PyShardWriter):
    """A PyShardWriter whose shards do not depend on the clock or on randomness."""

    _software = WRITER

    @classmethod
    def _shard_identity(cls, writer_id: str, index: int) -> tuple[bytes, int]:
        seed = hashlib.sha256(f"{writer_id}/{index}".encode()).digest()
        return seed[:16], CREATED_UNIX_MS


def _values(n: int, salt: int) -> np.ndarray:
    """``n`` float64 values in about [-7.3, 7.3], from integers only."""
    j = np.arange(n, dtype=np.int64)
    return ((j * 2654435761 + salt * 40503) % 2001 - 1000).astype(np.float64) / 137.0


def records(count: int = 3) -> list[tuple[str, dict, dict]]:
    """``(key, tensors, metadata)`` of the vector records: record i holds bf16, f16, f32
    hidden_states (cycling) ``[tokens, 2, 4]`` and int64 token_ids; record 2 also an int16
    tensor (so bp16 splits a 2-byte integer tensor too)."""
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    keys = ["req-0", "req-1", "rëq-2 ✓", "req-3"]
    out = []
    for i in range(count):
        tokens = 3 + i % 2
        dtype = dtypes[i % 3]
        hidden = torch.from_numpy(_values(tokens * 2 * 4, i)).to(torch.float32).to(dtype).reshape(tokens, 2, 4)
        token_ids = torch.tensor([(i * 1000 + t * 37) for t in range(tokens)], dtype=torch.int64)
        if i == 1:
            token_ids[0] = -(1 << 40)  # a negative id exercises sign bytes
        tensors = {"hidden_states": hidden, "token_ids": token_ids}
        if i == 2:
            tensors["extra_i16"] = torch.tensor([-300, 0, 7, 32767], dtype=torch.int16)
        meta = {
            "layer_ids": "[2, 8]",
            "model": "tiny-test",
            "dtype": str(dtype).removeprefix("torch."),
            "num_tokens": str(tokens),
        }
        out.append((keys[i], tensors, meta))
    return out


def wide_record() -> tuple[str, dict, dict]:
    """A record whose floating tensors are large enough (64 elements and more) for ``exp-huf``
    to code them, and the tables pay: bf16 ``[64, 2, 32]`` hidden states with an outlier
    channel, f16 and f32 ``[64, 32]``, and token ids."""
    j = np.arange(64 * 2 * 32)
    hidden = torch.from_numpy(_values(j.size, 5) * np.where(j % 32 == 3, 40.0, 1.0)).to(torch.bfloat16)
    tensors = {
        "hidden_states": hidden.reshape(64, 2, 32),
        "token_ids": torch.arange(64, dtype=torch.int64) * 11,
        "f16": torch.from_numpy(_values(2048, 6)).to(torch.float16).reshape(64, 32),
        "f32": torch.from_numpy(_values(2048, 7) / 1000.0).to(torch.float32).reshape(64, 32),
    }
    meta = {"layer_ids": "[2, 8]", "model": "tiny-test", "dtype": "bfloat16", "num_tokens": "64"}
    return "wide", tensors, meta


def write_shard(directory: str, writer_id: str, codec: str, count: int = 3, extra=()) -> str:
    with VectorWriter(directory, codec=codec, writer_id=writer_id, level=3, durability="none", metadata=USER_META) as w:
        for key, tensors, meta in [*records(count), *extra]:
            w.submit(key, tensors, meta)
    return os.path.join(directory, f"{writer_id}-000000.lts")


def _flip_payload_bit(path: str, record: int) -> None:
    """Flips one bit in the tensor data of ``record``'s payload (codec none)."""
    with PyShardReader(path, probe_lock=False) as r:
        e = r.raw_entries()[record]
    with open(path, "r+b") as f:
        at = e.payload_offset + e.stored_len - 5
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def _data_end(path: str) -> int:
    with open(path, "rb") as f:
        f.seek(-32, os.SEEK_END)
        index_offset, _ = decode_trailer(f.read(32))
    return index_offset


def make_files(tmp: str, out: str) -> None:
    for codec in ("none", "zstd", "bp16-zstd"):
        shutil.copyfile(write_shard(tmp, codec, codec), os.path.join(out, f"{codec}.lts"))
    # exp-huf stores the small tensors of the three records raw; the fourth is coded.
    shutil.copyfile(write_shard(tmp, "exp-huf", "exp-huf", extra=[wide_record()]), os.path.join(out, "exp-huf.lts"))

    # open-torn: three records, then the first 100 bytes of a fourth frame; no footer.
    four = write_shard(tmp, "open-torn", "none", count=4)
    with PyShardReader(four, probe_lock=False) as r:
        cut = r.raw_entries()[3].frame_offset + 100
    with open(four, "rb") as f:
        data = f.read(cut)
    with open(os.path.join(out, "open-torn.lts"), "wb") as f:
        f.write(data)

    # corrupt-payload: complete; record 1's payload has one bit flipped.
    path = os.path.join(out, "corrupt-payload.lts")
    shutil.copyfile(write_shard(tmp, "corrupt-payload", "none"), path)
    _flip_payload_bit(path, 1)

    # open-damaged: no footer; record 1's payload bit-flipped (corrupt record), record 2's frame
    # header overwritten (damaged region up to record 3), record 3 valid, 20 bytes of torn tail.
    four = write_shard(tmp, "open-damaged", "none", count=4)
    _flip_payload_bit(four, 1)
    with PyShardReader(four, probe_lock=False) as r:
        rec2 = r.raw_entries()[2].frame_offset
    end = _data_end(four)
    with open(four, "rb") as f:
        data = bytearray(f.read(end))
    data[rec2 : rec2 + 8] = b"garbage!"
    data += b"LTRF" + bytes(16)  # an unfinished frame header
    with open(os.path.join(out, "open-damaged.lts"), "wb") as f:
        f.write(data)


def _tensor_json(name: str, dtype: str, shape, buf) -> dict:
    t = torch.frombuffer(bytearray(buf), dtype=TORCH_DTYPES[dtype]) if len(buf) else torch.empty(0)
    if t.is_floating_point():
        values = [float(v) for v in t.to(torch.float64).tolist()]
    else:
        values = [int(v) for v in t.tolist()]
    return {"name": name, "dtype": dtype, "shape": list(shape), "values": values}


def describe(path: str) -> dict:
    """What a reader must find in the shard at ``path``."""
    with open(path, "rb") as f:
        data = f.read()
    with PyShardReader(path, probe_lock=False) as r:
        desc = {
            "file_bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "complete": r.complete,
            "header_len": r.header_len,
            "shard_id": r.shard_id.hex(),
            "meta": r.meta,
            "data_end": r.data_end,
            "torn_tail_bytes": r.torn_tail_bytes,
            "open_problems": [{"kind": p.kind, "offset": p.offset, "key": p.key} for p in r.scan_problems],
            "verify_problems": [],
            "records": [],
        }
        for i, e in enumerate(r.raw_entries()):
            rec = {
                "key": e.key,
                "frame_offset": e.frame_offset,
                "frame_len": e.frame_len,
                "codec": CODECS[e.codec],
                "stored_len": e.stored_len,
                "raw_len": e.raw_len,
                "num_tokens": e.num_tokens,
                "payload_crc": e.payload_crc,
            }
            try:
                r.check(i)
                metadata, tensors = r.read(i)
            except CorruptRecordError as err:
                rec["ok"] = False
                rec["error"] = _reason(err, path)
                desc["verify_problems"].append({"kind": "corrupt_record", "offset": e.frame_offset, "key": e.key})
            else:
                raw = decode(e.codec, r.pread(e.payload_offset, e.stored_len), e.raw_len).blob
                rec["ok"] = True
                rec["raw_crc32c"] = crc32c(raw)
                rec["metadata"] = metadata
                rec["tensors"] = [_tensor_json(*t) for t in tensors]
            desc["records"].append(rec)
        desc["verify_problems"] = [{"kind": p.kind, "offset": p.offset, "key": p.key} for p in r.scan_problems] + desc[
            "verify_problems"
        ]
    return desc


FILES = [
    "none.lts",
    "zstd.lts",
    "bp16-zstd.lts",
    "exp-huf.lts",
    "open-torn.lts",
    "corrupt-payload.lts",
    "open-damaged.lts",
]


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        make_files(tmp, out)
    expected = {
        "format_version": 1,
        "generator": "tests/vectors/make_vectors.py",
        "files": {name: describe(os.path.join(out, name)) for name in FILES},
    }
    text = json.dumps(expected, indent=1, ensure_ascii=False)
    # Lists of numbers on one line each, so that the file stays short and diffs stay readable.
    text = re.sub(
        r"\[\s*(-?[0-9.e+-]+(?:,\s*-?[0-9.e+-]+)*)\s*\]",
        lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]",
        text,
    )
    assert json.loads(text) == expected
    with open(os.path.join(out, "expected.json"), "w", encoding="utf-8") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
