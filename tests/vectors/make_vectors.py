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

from layertap._py import exphuf
from layertap._py.reader import PyShardReader
from layertap._py.recover import recover
from layertap._py.write import write_shard as write_reference_shard
from layertap._spec.blob import build_header
from layertap._spec.codecs import decode, split_planes
from layertap._spec.format import (
    CODEC_BP16_ZSTD,
    CODEC_EXP_HUF,
    CODEC_NONE,
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
from layertap.reader import problem_message

CREATED_UNIX_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z
WRITER = "layertap-python 0.1.0"
USER_META = {"run": "test-vectors", "note": "ünïcode ✓"}


def shard_identity(writer_id: str, index: int = 0) -> tuple[bytes, int]:
    """``(shard_id, created_unix_ms)`` of the vectors' shards: not the clock's nor random."""
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


def by_element_record() -> tuple[str, dict, dict]:
    """A record for a block coded by element (mode 1, the GPU encoder's layout): bf16
    ``[32, 2, 32]`` hidden states with an outlier channel, and token ids."""
    j = np.arange(32 * 2 * 32)
    hidden = torch.from_numpy(_values(j.size, 8) * np.where(j % 32 == 5, 40.0, 1.0)).to(torch.bfloat16)
    tensors = {"hidden_states": hidden.reshape(32, 2, 32), "token_ids": torch.arange(32, dtype=torch.int64) * 7}
    meta = {"layer_ids": "[2, 8]", "model": "tiny-test", "dtype": "bfloat16", "num_tokens": "32"}
    return "by-element", tensors, meta


def five_streams_record() -> tuple[str, dict, dict]:
    """A record for a small block coded by column in 5 streams (the writers give a block one
    stream per 8,192 elements in fours, at least 4; readers take any count up to the columns): bf16 ``[64, 24]``,
    whose 24 columns the streams split 4, 5, 5, 5, 5."""
    hidden = torch.from_numpy(_values(64 * 24, 9)).to(torch.bfloat16).reshape(64, 1, 24)
    tensors = {"hidden_states": hidden, "token_ids": torch.arange(64, dtype=torch.int64)}
    meta = {"layer_ids": "[2]", "model": "tiny-test", "dtype": "bfloat16", "num_tokens": "64"}
    return "five-streams", tensors, meta


def two_streams_record() -> tuple[str, dict, dict]:
    """A record whose block is coded by column in 2 streams (16,448 elements: the writers'
    one per 8,192 before they took at least 4), whose 257 columns split 128 and 129: bf16 ``[64, 1, 257]`` of quarters from -3.75
    to 3.75 (a few characters each in expected.json), and token ids."""
    j = np.arange(64 * 257, dtype=np.int64)
    hidden = torch.from_numpy(((j * 7919 + j // 257 * 31) % 31 - 15) / 4.0).to(torch.bfloat16)
    tensors = {"hidden_states": hidden.reshape(64, 1, 257), "token_ids": torch.arange(64, dtype=torch.int64) * 3}
    meta = {"layer_ids": "[2]", "model": "tiny-test", "dtype": "bfloat16", "num_tokens": "64"}
    return "two-streams", tensors, meta


#: exp-huf.lts's records past the first three, and how their blocks are coded: (record, layout,
#: streams); in this order so that the first two coded records lie in the first 8 KiB (what the
#: fuzzers take of a vector, tests/fuzz).
EXP_HUF_EXTRA = [
    (by_element_record, "element", None),
    (five_streams_record, "column", 5),
    (wide_record, "column", 1),
    (two_streams_record, "column", 2),
]


def make_exp_huf(out: str) -> None:
    """exp-huf.lts: the three records (their tensors too small to code: raw blocks), then
    ``EXP_HUF_EXTRA``: blocks coded by element (mode 1) and by column (mode 2) in 1, 2 and 5
    streams, in one shard, which no writer makes (the writers code by column, the GPU encoder by
    element): the records the reference encoder's, laid out by ``hand_shard``."""
    recs = [(rec, "column", None) for rec in records()] + [(make(), by, s) for make, by, s in EXP_HUF_EXTRA]
    frames = []
    for (key, tensors, meta), by, streams in recs:
        raw, _ = _blob(key, tensors, meta)
        stored = exphuf.encode(raw, by=by, streams=streams)
        if key in ("by-element", "five-streams", "two-streams"):  # coded as said (hidden_states first)
            at = 8 + int.from_bytes(raw[:8], "little")
            assert stored[at] == (exphuf.MODE_CODED if by == "element" else exphuf.MODE_COLUMNS), key
        frames.append((key, CODEC_EXP_HUF, stored, len(raw), int(tensors["token_ids"].shape[0])))
    hand_shard(os.path.join(out, "exp-huf.lts"), "exp-huf", frames)


def write_shard(directory: str, writer_id: str, codec: str, count: int = 3, extra=()) -> str:
    """The shard ``{writer_id}-000000.lts`` in ``directory``, of ``records(count)`` and ``extra``,
    written by the reference writer (``layertap._py.write``)."""
    path = os.path.join(directory, f"{writer_id}-000000.lts")
    shard_id, created = shard_identity(writer_id)
    write_reference_shard(
        path,
        [*records(count), *extra],
        writer_id=writer_id,
        shard_id=shard_id,
        created_unix_ms=created,
        software=WRITER,
        codec=codec,
        level=3,
        user_meta=USER_META,
    )
    return path


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


def _with_window_log(frame: bytes, log: int) -> bytes:
    """``frame`` (one with a window descriptor: not single-segment) asking for a window of
    ``2**log`` bytes (RFC 8878, 3.1.1.1.2: exponent ``log - 10``, mantissa 0) instead."""
    assert not frame[4] & 0x20, "a single-segment frame has no window descriptor"
    return frame[:5] + bytes([(log - 10) << 3]) + frame[6:]


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
    shard_id, created = shard_identity(writer_id, 0)
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
    frame, one asks for a window of 2^28 bytes (more than FORMAT.md allows; a one-call decoder
    would decode it, a streaming one refuses it); then a good one."""
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
        ("wide-window", CODEC_ZSTD, _with_window_log(frame0, 28), len(raw0), t0),
        (k2, CODEC_BP16_ZSTD, _stored(CODEC_BP16_ZSTD, raw2, p2), len(raw2), t2),
    ]
    hand_shard(os.path.join(out, "zstd-no-size-bad.lts"), "zstd-no-size-bad", bad)


def _raw_blob(header: str, data: bytes = b"") -> bytes:
    """A safetensors blob of the JSON text ``header`` written as it is (padded with spaces) and
    ``data``: for headers no writer makes."""
    text = header.encode("utf-8")
    text += b" " * (align8(8 + len(text)) - 8 - len(text))
    return len(text).to_bytes(8, "little") + text + data


#: json-limits.lts: records whose safetensors headers test docs/FORMAT.md's JSON limits, by key:
#: (what their tensor ``t`` (I64 [1], value 7) carries besides dtype, shape and offsets, the
#: metadata members besides the key, a second tensor ``e`` (I64) of no element, given by its
#: shape text, or None). Whether each is good is what expected.json says.
JSON_LIMITS = {
    "deep-enough": (',"x":' + "[" * 62 + "]" * 62, "", None),  # objects 2 deep, then 62 arrays: 64
    "too-deep": (',"x":' + "[" * 63 + "]" * 63, "", None),
    "nan": (',"x":NaN', "", None),
    "huge-number": (',"x":1e400', "", None),
    "huge-integer": (',"x":1' + "0" * 309, "", None),  # 1e309: above the largest double
    "largest-double": (',"x":1.7976931348623157e308,"y":1.7976931348623158e308', "", None),  # both finite
    "lone-surrogate": ("", ',"note":"\\ud800"', None),
    "paired-surrogates": ("", ',"note":"\\ud83d\\ude00"', None),
    "repeated-name": ("", ',"note":"first","note":"last"', None),
    "minus-zero": ("", "", "[-0]"),
    "dim-of-2^64": ("", "", "[18446744073709551616,0]"),
    "empty-of-2^62-bytes": ("", "", "[1073741824,536870912,0]"),  # nonzero dimensions x 8 bytes: 2^62
    "empty-of-2^63-bytes": ("", "", "[0,1073741824,1073741824]"),
}


def make_json_limits(out: str) -> None:
    """json-limits: one record for each case of ``JSON_LIMITS`` (codec none). (The shard
    metadata's limits: ``meta-beyond-limits.lts``, among the files that are not shards.)"""
    frames = []
    for key, (extra, meta, empty) in JSON_LIMITS.items():
        header = (
            f'{{"__metadata__":{{"key":"{key}"{meta}}},"t":{{"dtype":"I64","shape":[1],"data_offsets":[0,8]{extra}}}'
        )
        if empty is not None:
            header += f',"e":{{"dtype":"I64","shape":{empty},"data_offsets":[8,8]}}'
        raw = _raw_blob(header + "}", (7).to_bytes(8, "little"))
        frames.append((key, CODEC_NONE, raw, len(raw), 1))
    hand_shard(os.path.join(out, "json-limits.lts"), "json-limits", frames)


def make_zero_tokens(tmp: str, out: str) -> None:
    """zero-tokens: a record of no token (empty hidden_states and token_ids) between two others."""
    (k0, t0, m0), (k1, t1, m1) = records(2)
    empty = {
        "hidden_states": torch.zeros(0, 2, 4, dtype=torch.bfloat16),
        "token_ids": torch.zeros(0, dtype=torch.int64),
    }
    meta = {"layer_ids": "[2, 8]", "model": "tiny-test", "dtype": "bfloat16", "num_tokens": "0"}
    three = write_shard(
        tmp, "zero-tokens", "none", count=0, extra=[(k0, t0, m0), ("no-tokens", empty, meta), (k1, t1, m1)]
    )
    shutil.copyfile(three, os.path.join(out, "zero-tokens.lts"))


def make_open_huge_frame(tmp: str, out: str) -> None:
    """open-huge-frame: three records, no footer, record 1's frame header (checksum right) saying
    its payload is 2^64 - 1 bytes long. A valid header whose frame runs past the end of the file
    is the frame being written: the scan stops there, and record 2 after it is torn tail."""
    three = write_shard(tmp, "open-huge-frame", "none", count=3)
    with PyShardReader(three, probe_lock=False) as r:
        rec1 = r.raw_entries()[1]
    with open(three, "rb") as f:
        data = bytearray(f.read(_data_end(three)))
    at = rec1.frame_offset
    data[at + 8 : at + 16] = (2**64 - 1).to_bytes(8, "little")
    key = rec1.key.encode("utf-8")
    data[at + 44 : at + 48] = crc32c(key, crc32c(bytes(data[at : at + 44]))).to_bytes(4, "little")
    with open(os.path.join(out, "open-huge-frame.lts"), "wb") as f:
        f.write(data)


def make_recovered(out: str) -> None:
    """recovered-lost: open-damaged.lts completed by the reference recover, which leaves its
    corrupt record and damaged region out of the index and counts them in the trailer."""
    path = os.path.join(out, "recovered-lost.lts")
    shutil.copyfile(os.path.join(out, "open-damaged.lts"), path)
    report = recover(path)
    assert report.records == 2 and len(report.problems) == 2, report


#: Files that are not shards, and whether each is a torn empty shard (a prefix of a header:
#: recover removes it) or something else (left alone).
NOT_SHARDS = {"torn-empty.lts": True, "torn-header.lts": True, "garbage.lts": False, "meta-beyond-limits.lts": False}


def _meta_beyond_limits() -> bytes:
    """A file header, checksum right, whose shard metadata says ``"created_unix_ms":1e400``: JSON
    to Python's json module (as inf), not within FORMAT.md's limits (a double's range)."""
    shard_id, _ = shard_identity("meta-beyond-limits", 0)
    meta = {"writer_id": "meta-beyond-limits", "shard_index": 0, "created_unix_ms": 12345, "writer": WRITER}
    header = bytearray(encode_file_header(shard_id, meta))
    crc_at = 32 + int.from_bytes(header[12:16], "little")
    assert header.count(b":12345,") == 1
    header[:crc_at] = header[:crc_at].replace(b":12345,", b":1e400,")
    header[crc_at : crc_at + 4] = crc32c(header[:crc_at]).to_bytes(4, "little")
    return bytes(header)


def make_not_shards(out: str) -> None:
    with open(os.path.join(out, "none.lts"), "rb") as f:
        header = f.read(20)  # magic, version, flags, meta_len and 4 bytes of the shard id
    contents = {
        "torn-empty.lts": b"",
        "torn-header.lts": header,
        "garbage.lts": b"this is not a layertap shard\n",
        "meta-beyond-limits.lts": _meta_beyond_limits(),
    }
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
                rec["error"] = problem_message(err, path)
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
    "json-limits.lts",
    "open-huge-frame.lts",
]


#: Hidden-states KV caches as vLLM lays them out, for layout.json: (name, shape, strides, layers,
#: hidden size, scheduler block size). Sizes differ from each other so that the token axis is
#: found from the shape (``gather.token_axis``).
LAYOUT_CACHES = [
    # vLLM 0.26: [blocks, block size, layers, hidden], contiguous.
    ("token-major", (6, 4, 3, 5), (60, 15, 5, 1), 3, 5, 4),
    # vLLM 0.32 on the CPU: [blocks, layers, block size, hidden], contiguous (layer-major).
    ("layer-major", (6, 3, 4, 5), (60, 20, 5, 1), 3, 5, 4),
    # vLLM 0.32 under LBNHC on CUDA: the logical [blocks, layers, block size, hidden] over
    # token-major memory.
    ("lbnhc", (6, 3, 4, 5), (60, 5, 15, 1), 3, 5, 4),
    # A scheduler block of 8 tokens split into kernel blocks of 4.
    ("kernel-blocks", (6, 4, 3, 5), (60, 15, 5, 1), 3, 5, 8),
    # Padded: blocks 2 elements apart more than their rows take, so no table of rows: the
    # indices are (tensor block, offset) pairs.
    ("padded", (6, 4, 3, 5), (62, 15, 5, 1), 3, 5, 4),
]


def layout_case(name: str, shape, strides, layers: int, hidden: int, block_size: int) -> dict:
    """One case of layout.json: the cache's geometry, the layout arguments the sinks take (as
    ``HiddenStatesCache.row_layout`` gives them), requests, and each token's indices computed
    token by token from the strides (not by either implementation)."""
    axis = 2 if shape[1] == layers else 1
    tbs = shape[axis]
    block_stride, token_stride, layer_stride = strides[0], strides[axis], strides[3 - axis]
    by_rows = strides[3] == 1 and all(s % hidden == 0 for s in (block_stride, token_stride, layer_stride))
    sched_blocks = shape[0] * tbs // block_size
    bs = block_size
    requests = [
        ([sched_blocks - 1, 0, 1], 2 * bs + 1),  # the last block partly used
        ([1], bs),
        ([], 0),  # no token
        ([2, sched_blocks - 1], bs - 1),  # a block past the tokens, never read
    ]
    indices = []
    for blocks, n in requests:
        for t in range(n):
            blk, off = divmod(blocks[t // bs] * bs + t % bs, tbs)
            if by_rows:
                at = blk * block_stride + off * token_stride
                indices.append([(at + layer * layer_stride) // hidden for layer in range(layers)])
            else:
                indices.append([blk, off])
    return {
        "name": name,
        "kv_shape": list(shape),
        "kv_strides": list(strides),
        "num_layers": layers,
        "hidden_size": hidden,
        "block_size": block_size,
        "tensor_block_size": tbs,
        "row_steps": [block_stride // hidden, token_stride // hidden] if by_rows else None,
        "layer_rows": [layer * layer_stride // hidden for layer in range(layers)] if by_rows else [],
        "index_width": layers if by_rows else 2,
        "requests": [{"block_ids": b, "num_tokens": n} for b, n in requests],
        "indices": indices,
    }


def _compact_lists(text: str) -> str:
    """Lists of numbers on one line each, so that the file stays short and diffs stay readable."""
    return re.sub(
        r"\[\s*(-?[0-9.e+-]+(?:,\s*-?[0-9.e+-]+)*)\s*\]",
        lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]",
        text,
    )


def make_layout(out: str) -> None:
    """layout.json: where each token of a request lies in the hidden-states cache, for the Rust
    layout (``layertap_core::region``) and Python's (``HiddenStatesCache.write_indices``, both
    sinks' ``fill``)."""
    layout = {"generator": "tests/vectors/make_vectors.py", "cases": [layout_case(*c) for c in LAYOUT_CACHES]}
    text = _compact_lists(json.dumps(layout, indent=1))
    assert json.loads(text) == layout
    with open(os.path.join(out, "layout.json"), "w", encoding="utf-8") as f:
        f.write(text + "\n")


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        make_files(tmp, out)
        make_zero_tokens(tmp, out)
        make_open_huge_frame(tmp, out)
    make_zstd_no_size(out)
    make_exp_huf(out)
    make_json_limits(out)
    make_recovered(out)
    make_not_shards(out)
    expected = {
        "format_version": 1,
        "generator": "tests/vectors/make_vectors.py",
        "files": {name: describe(os.path.join(out, name)) for name in FILES},
        "not_shards": {name: {"torn_empty": torn} for name, torn in NOT_SHARDS.items()},
    }
    text = _compact_lists(json.dumps(expected, indent=1, ensure_ascii=False))
    assert json.loads(text) == expected
    with open(os.path.join(out, "expected.json"), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    make_layout(out)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
