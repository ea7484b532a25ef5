"""Property round trips: random records written by the writer, read back by each reader.

A reader whose implementation is missing FAILS (it does not skip), saying what is not built. For
codec ``none`` the writer must produce the frames of the reference writer (``layertap._py.write``,
docs/FORMAT.md) byte for byte (the file headers differ: shard id, creation time, writer string).
"""

from __future__ import annotations

import math
import os
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import layertap
from helpers import reader_class, shard_files, writer_class
from layertap._py.reader import PyShardReader
from layertap._py.write import write_shard
from layertap._spec.format import key_problem
from layertap._tensors import ITEMSIZE, TORCH_DTYPES

DTYPES = sorted(TORCH_DTYPES)
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

keys = st.text(min_size=1, max_size=24).filter(lambda k: key_problem(k) is None)
meta_text = st.text(max_size=16)


@st.composite
def tensor_specs(draw):
    """``(dtype, shape, data bytes, form)``: form is how it is handed to the writer."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=3)))
    n = math.prod(shape) * ITEMSIZE[dtype]
    if dtype == "BOOL":
        data = bytes(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)))
    else:
        data = draw(st.binary(min_size=n, max_size=n))
    # numpy has no bfloat16 or float8 of its own (ml_dtypes' are not what the writers take).
    form = draw(st.sampled_from(["buffer", "torch"] if dtype in ("BF16", "F8_E4M3") else ["buffer", "torch", "numpy"]))
    return dtype, shape, data, form


@st.composite
def records(draw):
    ks = draw(st.lists(keys, min_size=1, max_size=6, unique=True))
    out = []
    for k in ks:
        names = draw(
            st.lists(
                st.sampled_from(["hidden_states", "token_ids", "a", "b", "ü"]), min_size=1, max_size=3, unique=True
            )
        )
        tensors = {name: draw(tensor_specs()) for name in names}
        meta = draw(st.dictionaries(meta_text.filter(lambda s: s != "key"), meta_text, max_size=3))
        out.append((k, tensors, meta))
    return out


def _as_input(dtype, shape, data, form):
    if form == "buffer":
        return (data, dtype, shape)
    t = torch.frombuffer(bytearray(data), dtype=TORCH_DTYPES[dtype]).reshape(shape)
    return t if form == "torch" else t.numpy()


def _write(cls, directory, recs, codec, level=1, **kw):
    with cls(directory, codec=codec, level=level, writer_id="w", durability="none", **kw) as w:
        for key, tensors, meta in recs:
            w.submit(key, {n: _as_input(*spec) for n, spec in tensors.items()}, meta)
    return shard_files(directory)


def _check(reader_cls, paths, recs):
    got = []
    for p in paths:
        r = reader_cls(p)
        try:
            assert r.complete and not r.scan_problems and r.torn_tail_bytes == 0
            for i, e in enumerate(r.entries):
                r.check(i)
                metadata, tensors = r.read(i)
                got.append(
                    (
                        e.key,
                        e.num_tokens,
                        metadata,
                        [(n, d, tuple(s), bytes(memoryview(b).cast("B"))) for n, d, s, b in tensors],
                    )
                )
        finally:
            r.close()
    want = []
    for key, tensors, meta in recs:
        num_tokens = tensors["token_ids"][1][0] if "token_ids" in tensors and tensors["token_ids"][1] else 0
        want.append(
            (key, num_tokens, {**meta, "key": key}, [(n, d, s, data) for n, (d, s, data, _) in tensors.items()])
        )
    assert got == want


@pytest.mark.parametrize("reader", ["python", "rust"], ids=lambda r: f"{r}-reader")
@SETTINGS
@given(recs=records(), codec=st.sampled_from(["none", "zstd", "bp16-zstd"]), shard_size=st.sampled_from([1 << 20, 300]))
def test_write_then_read(reader, recs, codec, shard_size):
    reader_cls = reader_class(reader)
    with tempfile.TemporaryDirectory() as d:
        paths = _write(writer_class(), d, recs, codec, shard_size=shard_size)
        _check(reader_cls, paths, recs)


@SETTINGS
@given(recs=records())
def test_dataset_api_round_trip(recs):
    with tempfile.TemporaryDirectory() as d:
        _write(writer_class(), d, recs, "bp16-zstd")
        with layertap.open(d, backend="python") as ds:
            assert ds.keys() == [k for k, _, _ in recs]
            for (key, tensors, meta), rec in zip(recs, ds):
                assert rec.key == key and rec.metadata == {**meta, "key": key}
                assert list(rec.tensors) == list(tensors)
                for name, (dtype, shape, data, _) in tensors.items():
                    t = rec[name]
                    assert t.dtype == TORCH_DTYPES[dtype] and tuple(t.shape) == shape
                    assert t.reshape(-1).view(torch.uint8).numpy().tobytes() == data
            assert ds.verify().ok


def _frames(path):
    """``(header_len, [frame bytes], [index entries], index offset)``, offsets from the end of
    the file header."""
    with open(path, "rb") as f:
        data = f.read()
    with PyShardReader(path, probe_lock=False) as r:
        entries = r.raw_entries()
        frames = [data[e.frame_offset : e.frame_offset + e.frame_len] for e in entries]
        shifted = [e._replace(frame_offset=e.frame_offset - r.header_len) for e in entries]
        return r.header_len, frames, shifted, int.from_bytes(data[-32:-24], "little") - r.header_len


def _reference(directory, recs) -> str:
    """The shard ``w-000000.lts`` of ``recs`` written by the reference writer, codec none."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "w-000000.lts")
    inputs = [(key, {n: _as_input(*spec) for n, spec in tensors.items()}, meta) for key, tensors, meta in recs]
    write_shard(
        path, inputs, writer_id="w", shard_id=bytes(16), created_unix_ms=0, software="layertap-python reference"
    )
    return path


@SETTINGS
@given(recs=records())
def test_the_writer_makes_the_reference_writers_frames(recs):
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        pa = _reference(a, recs)
        (pb,) = _write(writer_class(), b, recs, "none")
        _, frames_py, index_py, at_py = _frames(pa)
        _, frames_rs, index_rs, at_rs = _frames(pb)
        assert len(frames_py) == len(frames_rs) == len(recs)
        for i, (x, y) in enumerate(zip(frames_py, frames_rs)):
            assert x == y, f"record {i} ({recs[i][0]!r}): frames differ"
        assert index_py == index_rs and at_py == at_rs
        # Everything after the header, the footer included, is the same bytes once both files'
        # frames start at the same offset.
        with open(pa, "rb") as f:
            tail_py = f.read()[-32:]
        with open(pb, "rb") as f:
            tail_rs = f.read()[-32:]
        assert tail_py[8:20] == tail_rs[8:20] and tail_py[24:] == tail_rs[24:]


def test_the_writers_header_holds_what_the_format_names(tmp_path):
    recs = [("k", {"x": ("F32", (2,), np.arange(2, dtype=np.float32).tobytes(), "buffer")}, {})]
    pa = _reference(tmp_path / "a", recs)
    (pb,) = _write(writer_class(), tmp_path / "b", recs, "none")
    ra, rb = PyShardReader(pa, probe_lock=False), PyShardReader(pb, probe_lock=False)
    try:
        assert sorted(ra.meta) == sorted(rb.meta)
        for key in ("writer_id", "shard_index", "user"):
            assert ra.meta[key] == rb.meta[key], key
        assert rb.meta["writer"].startswith("layertap-rust ")
        assert os.path.basename(pa) == os.path.basename(pb) == "w-000000.lts"
    finally:
        ra.close()
        rb.close()
