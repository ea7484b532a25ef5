"""The checked-in test vectors (tests/vectors, see its README): the generator still makes the
same bytes, and both readers find in them exactly what expected.json says."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math

import numpy as np
import pytest
import torch

import layertap
from helpers import VECTORS, reader_class
from layertap._spec.format import is_torn_empty
from layertap._tensors import TORCH_DTYPES
from layertap.errors import CorruptRecordError, FormatError

EXPECTED = json.loads((VECTORS / "expected.json").read_text(encoding="utf-8"))
FILES = sorted(EXPECTED["files"])


def _generator():
    spec = importlib.util.spec_from_file_location("make_vectors", VECTORS / "make_vectors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generator_is_deterministic(tmp_path):
    _generator().main(str(tmp_path))
    fresh = json.loads((tmp_path / "expected.json").read_text(encoding="utf-8"))
    for name, want in EXPECTED["files"].items():
        got = fresh["files"][name]
        if all(r["codec"] == "none" for r in want["records"]):
            # Codec none: the format and the canonical records, byte for byte.
            assert (tmp_path / name).read_bytes() == (VECTORS / name).read_bytes(), name
        else:
            # zstd output may change with the zstd library; what decodes from it may not.
            decoded = ("key", "codec", "raw_len", "num_tokens", "ok", "raw_crc32c", "metadata", "tensors")
            assert [{k: r.get(k) for k in decoded} for r in got["records"]] == [
                {k: r.get(k) for k in decoded} for r in want["records"]
            ], name
    assert (tmp_path / "layout.json").read_text(encoding="utf-8") == (VECTORS / "layout.json").read_text(
        encoding="utf-8"
    )


def test_expected_json_describes_the_files():
    for name, want in EXPECTED["files"].items():
        data = (VECTORS / name).read_bytes()
        assert len(data) == want["file_bytes"] and hashlib.sha256(data).hexdigest() == want["sha256"], name
        # exp-huf codes a tensor only where it saves more than its tables take (~0.5 KB), so
        # its vector needs records of a few thousand elements, and the writers give a block two
        # streams from 16,384 elements on; json-limits has 13 records.
        limit = {"exp-huf.lts": 48_000, "json-limits.lts": 6000}.get(name, 4096)
        assert len(data) < limit, f"{name}: test vectors should stay tiny"


def _values(t: torch.Tensor) -> list:
    flat = t.reshape(-1)
    return [float(v) for v in flat.to(torch.float64).tolist()] if t.is_floating_point() else flat.tolist()


@pytest.mark.parametrize("reader", ["python", "rust"])
@pytest.mark.parametrize("name", FILES)
def test_reader_finds_what_expected_json_says(reader, name):
    cls = reader_class(reader)
    want = EXPECTED["files"][name]
    r = cls(VECTORS / name)
    try:
        assert r.complete == want["complete"]
        assert r.file_bytes == want["file_bytes"] and r.torn_tail_bytes == want["torn_tail_bytes"]
        assert r.meta == want["meta"] and not r.being_written
        assert r.lost_in_recovery == want["lost_in_recovery"]
        assert [(p.kind, p.offset, p.key) for p in r.scan_problems] == [
            (p["kind"], p["offset"], p["key"]) for p in want["open_problems"]
        ]
        assert [
            (e.key, e.frame_offset, e.codec, e.stored_len, e.raw_len, e.num_tokens, e.payload_crc) for e in r.entries
        ] == [
            (x["key"], x["frame_offset"], x["codec"], x["stored_len"], x["raw_len"], x["num_tokens"], x["payload_crc"])
            for x in want["records"]
        ]
        for i, rec in enumerate(want["records"]):
            if not rec["ok"]:
                with pytest.raises(CorruptRecordError) as info:
                    r.check(i)
                assert (info.value.offset, info.value.key) == (rec["frame_offset"], rec["key"])
                with pytest.raises(CorruptRecordError):
                    r.read(i)
                continue
            r.check(i)
            metadata, tensors = r.read(i)
            assert metadata == rec["metadata"]
            assert len(tensors) == len(rec["tensors"])
            for (n, dtype, shape, buf), t in zip(tensors, rec["tensors"]):
                assert (n, dtype, list(shape)) == (t["name"], t["dtype"], t["shape"])
                raw = bytearray(memoryview(buf).cast("B"))
                flat = torch.frombuffer(raw, dtype=TORCH_DTYPES[dtype]) if raw else torch.empty(0)
                got = _values(flat)
                assert len(got) == math.prod(shape) == len(t["values"])
                assert got == t["values"], (name, rec["key"], n)
    finally:
        r.close()


NOT_SHARDS = sorted(EXPECTED["not_shards"])


@pytest.mark.parametrize("reader", ["python", "rust"])
@pytest.mark.parametrize("name", NOT_SHARDS)
def test_files_that_are_not_shards(reader, name, tmp_path):
    # A torn empty shard (a prefix of a header) is a shard to recover, which removes it; any
    # other file is not a shard, and recovery leaves it alone. Both readers and both recoveries.
    torn = EXPECTED["not_shards"][name]["torn_empty"]
    data = (VECTORS / name).read_bytes()
    assert is_torn_empty(data) == torn
    with pytest.raises(FormatError, match="torn empty shard" if torn else "not a layertap shard") as info:
        reader_class(reader)(VECTORS / name)
    assert ("torn empty shard" in str(info.value)) == torn
    copy = tmp_path / name
    copy.write_bytes(data)
    if torn:
        with layertap.open(copy, backend=reader) as ds:
            [info] = ds.shards
            assert (info.complete, info.records, info.torn_tail_bytes) == (False, 0, len(data))
            assert [(p.kind, p.offset) for p in ds.verify().problems] == [("torn_tail", 0)]
    else:
        with pytest.raises(FormatError):
            layertap.open(copy, backend=reader)
    if reader == "python":
        from layertap._py.recover import recover
    else:
        from layertap.recover import recover
    if torn:
        report = recover(copy)
        assert report.removed and (report.records, report.truncated_bytes) == (0, len(data))
        assert not copy.exists()
    else:
        with pytest.raises(FormatError):
            recover(copy)
        assert copy.read_bytes() == data


LAYOUT = json.loads((VECTORS / "layout.json").read_text(encoding="utf-8"))


def layout_cache(case: dict):
    """The case's hidden-states KV cache: a tensor of its shape and strides (values unused)."""
    from layertap.vllm.gather import HiddenStatesCache

    shape, strides = case["kv_shape"], case["kv_strides"]
    storage = torch.zeros(1 + sum((n - 1) * s for n, s in zip(shape, strides)), dtype=torch.bfloat16)
    kv = torch.as_strided(storage, shape, strides)
    return HiddenStatesCache(kv, case["num_layers"], case["hidden_size"], case["block_size"])


@pytest.mark.parametrize("case", LAYOUT["cases"], ids=[c["name"] for c in LAYOUT["cases"]])
def test_write_indices_follow_the_layout_vector(case):
    """Python's layout (``HiddenStatesCache``) gives the layout arguments and the indices of
    tests/vectors/layout.json, which the Rust layout is checked against too (vectors.rs)."""
    cache = layout_cache(case)
    steps, layer_rows = cache.row_layout()
    assert (cache.tensor_block_size, cache.index_width) == (case["tensor_block_size"], case["index_width"])
    assert (list(steps) if steps else None, layer_rows) == (case["row_steps"], case["layer_rows"])
    requests = [(r["block_ids"], r["num_tokens"]) for r in case["requests"]]
    index = np.full((len(case["indices"]), cache.index_width), -1, dtype=np.int64)
    cache.write_indices(requests, index)
    assert index.tolist() == case["indices"]
