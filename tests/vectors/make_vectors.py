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
import zstandard

from layertap._py.reader import PyShardReader
from layertap._py.recover import recover
from layertap._py.writer import PyShardWriter
from layertap._spec.blob import build_header
from layertap._spec.codecs import decode, split_planes
from layertap._spec.format import (
    CODEC_BP16_ZSTD,
    CODEC_ZSTD,
    CODECS,
    KIND_RECORD,
    RawEntry,
    align8,
    crc32c,
    decode_trailer,
    encode_file_header,
    encode_footer,
    encode_frame_header,
)
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
        return decode_trailer(f.read(32)).index_offset


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


def _blob(key: str, tensors: dict, meta: dict) -> tuple[bytes, list[tuple[int, int]]]:
    """The raw payload (safetensors blob) of a record, and the byte ranges of its 2-byte tensors."""
    parts = [(name, t.contiguous().view(torch.uint8).numpy().tobytes(), t) for name, t in tensors.items()]
    dtype_names = {
        torch.bfloat16: "BF16",
        torch.float16: "F16",
        torch.float32: "F32",
        torch.int64: "I64",
        torch.int16: "I16",
    }
    header = build_header([(n, dtype_names[t.dtype], tuple(t.shape)) for n, _, t in parts], {**meta, "key": key})
    out, planes = bytearray(header), []
    for _, data, t in parts:
        if t.element_size() == 2:
            planes.append((len(out), len(out) + len(data)))
        out += data
    return bytes(out), planes


def _no_size_frame(raw: bytes) -> bytes:
    """One zstd frame of ``raw`` without a content size, as a streaming compressor writes it."""
    c = zstandard.ZstdCompressor(level=3, write_content_size=False, write_checksum=False).compressobj()
    return c.compress(raw) + c.flush()


def _stored(codec: int, raw: bytes, planes: list[tuple[int, int]]) -> bytes:
    if codec == CODEC_BP16_ZSTD:
        split = np.frombuffer(raw, dtype=np.uint8).copy()
        for a, b in planes:
            split_planes(raw[a:b], split[a:b])
        raw = split.tobytes()
    return _no_size_frame(raw)


def hand_shard(path: str, writer_id: str, frames: list[tuple[str, int, bytes, int, int]]) -> None:
    """A complete shard of ``frames`` ``(key, codec, stored payload, raw_len, num_tokens)``, laid
    out as the writers lay theirs out: what the writers never write (frames without a content
    size, payloads that do not decode to their raw_len) made by hand."""
    shard_id, created = VectorWriter._shard_identity(writer_id, 0)
    meta = {"writer_id": writer_id, "shard_index": 0, "created_unix_ms": created, "writer": WRITER, "user": USER_META}
    out = bytearray(encode_file_header(shard_id, meta))
    entries = []
    for key, codec, stored, raw_len, tokens in frames:
        crc = crc32c(stored)
        entries.append(RawEntry(len(out), len(stored), raw_len, tokens, crc, codec, key))
        out += encode_frame_header(KIND_RECORD, codec, key.encode(), len(stored), raw_len, tokens, crc)
        out += stored + bytes(align8(len(stored)) - len(stored))
    out += encode_footer(entries, len(out))
    with open(path, "wb") as f:
        f.write(out)


def make_zstd_no_size(out: str) -> None:
    """zstd-no-size: the three vector records as frames without a content size, zstd, bp16-zstd,
    zstd. zstd-no-size-bad: such frames that are corrupt although their checksums match: one
    decodes to more than its raw_len, one to less, one is two frames, one has bytes after its
    frame; then a good one."""
    recs = [(key, *_blob(key, tensors, meta), int(tensors["token_ids"].shape[0])) for key, tensors, meta in records()]
    good = []
    for (key, raw, planes, tokens), codec in zip(recs, [CODEC_ZSTD, CODEC_BP16_ZSTD, CODEC_ZSTD]):
        good.append((key, codec, _stored(codec, raw, planes), len(raw), tokens))
    hand_shard(os.path.join(out, "zstd-no-size.lts"), "zstd-no-size", good)
    (k0, raw0, _, t0), (k1, raw1, _, t1), (k2, raw2, p2, t2) = recs
    frame0, frame1 = _no_size_frame(raw0), _no_size_frame(raw1)
    bad = [
        (k0, CODEC_ZSTD, frame0, len(raw0) - 8, t0),
        (k1, CODEC_ZSTD, frame1, len(raw1) + 8, t1),
        ("two-frames", CODEC_ZSTD, frame0 + frame0, 2 * len(raw0), t0),
        ("trailing", CODEC_ZSTD, frame1 + b"\0\0\0", len(raw1), t1),
        (k2, CODEC_BP16_ZSTD, _stored(CODEC_BP16_ZSTD, raw2, p2), len(raw2), t2),
    ]
    hand_shard(os.path.join(out, "zstd-no-size-bad.lts"), "zstd-no-size-bad", bad)


def make_zero_tokens(tmp: str, out: str) -> None:
    """zero-tokens: a record of no token (empty hidden_states and token_ids) between two others."""
    (k0, t0, m0), (k1, t1, m1) = records(2)
    empty = {
        "hidden_states": torch.zeros(0, 2, 4, dtype=torch.bfloat16),
        "token_ids": torch.zeros(0, dtype=torch.int64),
    }
    meta = {"layer_ids": "[2, 8]", "model": "tiny-test", "dtype": "bfloat16", "num_tokens": "0"}
    with VectorWriter(tmp, codec="none", writer_id="zero-tokens", durability="none", metadata=USER_META) as w:
        w.submit(k0, t0, m0)
        w.submit("no-tokens", empty, meta)
        w.submit(k1, t1, m1)
    shutil.copyfile(os.path.join(tmp, "zero-tokens-000000.lts"), os.path.join(out, "zero-tokens.lts"))


def make_recovered(out: str) -> None:
    """recovered-lost: open-damaged.lts completed by the reference recover, which leaves its
    corrupt record and damaged region out of the index and counts them in the trailer."""
    path = os.path.join(out, "recovered-lost.lts")
    shutil.copyfile(os.path.join(out, "open-damaged.lts"), path)
    report = recover(path)
    assert report.records == 2 and len(report.problems) == 2, report


#: Files that are not shards, and whether each is a torn empty shard (a prefix of a header:
#: recover removes it) or something else (left alone).
NOT_SHARDS = {"torn-empty.lts": True, "torn-header.lts": True, "garbage.lts": False}


def make_not_shards(out: str) -> None:
    with open(os.path.join(out, "none.lts"), "rb") as f:
        header = f.read(20)  # magic, version, flags, meta_len and 4 bytes of the shard id
    contents = {"torn-empty.lts": b"", "torn-header.lts": header, "garbage.lts": b"this is not a layertap shard\n"}
    for name, data in contents.items():
        with open(os.path.join(out, name), "wb") as f:
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
            "lost_in_recovery": r.lost_in_recovery,
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
    "zstd-no-size.lts",
    "zstd-no-size-bad.lts",
    "zero-tokens.lts",
    "recovered-lost.lts",
]


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        make_files(tmp, out)
        make_zero_tokens(tmp, out)
    make_zstd_no_size(out)
    make_recovered(out)
    make_not_shards(out)
    expected = {
        "format_version": 1,
        "generator": "tests/vectors/make_vectors.py",
        "files": {name: describe(os.path.join(out, name)) for name in FILES},
        "not_shards": {name: {"torn_empty": torn} for name, torn in NOT_SHARDS.items()},
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
