"""Codec ``exp-huf`` and lossy ``fp8-e4m3`` storage through the writer and both readers, on
real files: round trips of bf16/f16/f32 activations-like tensors, the Python reference codec
against the Rust one, damaged payloads refused by both decoders, and fp8 records (error
metadata, scales, dequantize, inspect)."""

from __future__ import annotations

import json

import pytest
import torch

import layertap
from helpers import writer_class
from layertap import fp8
from layertap._py import exphuf as py_encoder
from layertap._py.write import write_shard
from layertap._spec import exphuf as py_decoder
from layertap._spec.blob import build_header
from layertap._spec.format import FormatProblem
from layertap.cli.inspect import inspect_summary, inspect_table
from layertap.errors import CorruptRecordError, InvalidInputError, OptionError


def _activations(tokens: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 3, 64, generator=g)
    x[:, :, 5] *= 30.0  # an outlier channel
    return x.to(dtype)


@pytest.fixture
def writer():
    return writer_class()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_exp_huf_round_trips_in_both_readers(tmp_path, writer, dtype):
    x = _activations(24, dtype)
    ids = torch.arange(24, dtype=torch.int64)
    with writer(tmp_path, codec="exp-huf", durability="none") as w:
        w.submit("a", {"hidden_states": x, "token_ids": ids}, {"model": "m"})
        w.submit("b", {"hidden_states": x[:1], "token_ids": ids[:1]})  # too small to code
    for backend in ("rust", "python"):
        with layertap.open(tmp_path, backend=backend) as ds:
            a, b = ds["a"], ds["b"]
            assert torch.equal(a.hidden_states.view(torch.uint8), x.view(torch.uint8))
            assert torch.equal(b.hidden_states.view(torch.uint8), x[:1].view(torch.uint8))
            assert torch.equal(a.token_ids, ids)
            assert ds.backends[0].entries[0].codec == "exp-huf"
            assert ds.verify().ok
    if dtype == torch.bfloat16:
        with layertap.open(tmp_path) as ds:
            e = ds.backends[0].entries[0]
            assert e.stored_len < 0.75 * e.raw_len  # bf16 exponents code to ~3 bits


def test_python_and_rust_encoders_decode_each_other(tmp_path):
    x = _activations(40, torch.bfloat16, seed=3)
    (tmp_path / "py").mkdir()
    write_shard(
        tmp_path / "py" / "w-000000.lts",
        [("k", {"hidden_states": x}, None)],
        writer_id="w",
        shard_id=bytes(16),
        created_unix_ms=0,
        software="reference",
        codec="exp-huf",
    )
    with writer_class()(tmp_path / "rs", codec="exp-huf", durability="none") as w:
        w.submit("k", {"hidden_states": x})
    for d in ("py", "rs"):
        for backend in ("rust", "python"):
            with layertap.open(tmp_path / d, backend=backend) as ds:
                assert torch.equal(ds["k"].hidden_states.view(torch.int16), x.view(torch.int16)), (d, backend)


def test_damaged_block_is_refused_by_both_decoders(tmp_path):
    x = _activations(16, torch.bfloat16)
    blob = build_header([("hidden_states", "BF16", tuple(x.shape))], {"key": "k"})
    raw = blob + x.view(torch.uint8).numpy().tobytes()
    stored = bytearray(py_encoder.encode(raw))
    assert bytes(py_decoder.decode(stored, len(raw))) == raw
    stored[len(blob) + 1] = 0  # zero contexts
    with pytest.raises(FormatProblem, match="contexts"):
        py_decoder.decode(stored, len(raw))
    with pytest.raises(FormatProblem, match="after the last"):
        py_decoder.decode(bytes(py_encoder.encode(raw)) + b"\0", len(raw))
    # The Rust reader says the same of the same bytes, as a corrupt record.
    path = tmp_path / "d"
    with writer_class()(path, codec="exp-huf", durability="none") as w:
        w.submit("k", {"hidden_states": x})
    shard = next(path.glob("*.lts"))
    with layertap.open(shard) as ds:
        e = ds.backends[0].entries[0]
    data = bytearray(shard.read_bytes())
    payload = e.frame_offset + 48 + 8  # key "k" pads the frame header to 56 bytes
    data[payload + len(blob) + 1] = 0
    shard.write_bytes(bytes(data))
    with layertap.open(shard) as ds:
        with pytest.raises(CorruptRecordError):
            ds.backends[0].read(0, verify=False)


def test_lossy_is_never_the_default_and_is_checked():
    assert layertap.WriterOptions().lossy is None
    with pytest.raises(OptionError, match="lossy"):
        layertap.WriterOptions(lossy="fp4")


@pytest.mark.parametrize("codec", ["exp-huf", "zstd"])
def test_fp8_records_hold_scales_errors_and_dequantize(tmp_path, writer, codec):
    x = _activations(12, torch.bfloat16, seed=1)
    with writer(tmp_path, codec=codec, lossy="fp8-e4m3", durability="none") as w:
        w.submit("a", {"hidden_states": x, "token_ids": torch.arange(12)}, {"dtype": "bfloat16"})
        w.submit_many([("b", {"hidden_states": x[:3]})])
    with layertap.open(tmp_path, backend="python") as ds:
        rec = ds["a"]
        assert rec.hidden_states.dtype == torch.float8_e4m3fn
        assert rec["hidden_states_scale"].shape == (12,)
        meta = rec.metadata
        assert meta["lossy"] == "fp8-e4m3" and meta["fp8_source_dtype"] == "bfloat16"
        assert 0 < float(meta["fp8_mean_rel_err"]) <= float(meta["fp8_max_rel_err"]) <= 1.0
        back = fp8.dequantize(rec)
        assert back.dtype == torch.bfloat16 and back.shape == x.shape
        rel = ((back.float() - x.float()).norm() / x.float().norm()).item()
        assert rel < 0.05 and abs(rel - float(meta["fp8_rms_rel_err"])) < 0.01
        assert ds["b"].hidden_states.shape == (3, 3, 64)
        summary = inspect_summary(ds)
    assert summary["shards"][0]["lossy"]["lossy"] == "fp8-e4m3"
    assert "first record's relative error" in inspect_table(summary)
    json.dumps(summary)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_writer_quantizes_as_fp8_quantize_in_every_submit(tmp_path, dtype):
    """The Rust writer quantizes on its compression threads (``rust/core/src/fp8.rs``),
    ``layertap.fp8.quantize`` (which ``layertap export`` uses) with torch: the same e4m3 bytes
    and scales, through ``submit``, ``submit_many`` and ``submit_buffers`` (the connector's
    path); the error statistics agree to their printed digits but the last (``f64`` sums against
    torch's ``f32``)."""
    x = _activations(33, dtype, seed=7)
    x[4] = 0  # a token of zeros: scale 1
    names = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
    ids = torch.arange(33, dtype=torch.int64)
    buffers = [
        ("hidden_states", x.view(torch.uint8).numpy(), names[dtype], list(x.shape)),
        ("token_ids", ids.numpy(), "I64", [33]),
    ]
    with writer_class()(tmp_path, codec="zstd", lossy="fp8-e4m3", durability="none") as w:
        w.submit("a", {"hidden_states": x, "token_ids": ids}, {"dtype": "source"})
        w.submit_many([("b", {"hidden_states": x[:5]})])
        w.submit_buffers([("c", buffers, {"dtype": "source"}, 33)])
    with layertap.open(tmp_path) as rs:
        for key, source in (("a", x), ("b", x[:5]), ("c", x)):
            r = rs[key]
            q, scale, errors = fp8.quantize(source)
            assert list(r.tensors) == ["hidden_states", "hidden_states_scale", *(["token_ids"] if key != "b" else [])]
            assert r.hidden_states.dtype == torch.float8_e4m3fn
            assert torch.equal(r.hidden_states.view(torch.uint8), q.view(torch.uint8)), key
            assert torch.equal(r["hidden_states_scale"], scale), key
            assert r.metadata["lossy"] == errors["lossy"] == "fp8-e4m3"
            for name in ("fp8_max_rel_err", "fp8_mean_rel_err", "fp8_rms_rel_err"):
                a, b = float(r.metadata[name]), float(errors[name])
                assert abs(a - b) <= 1e-5 * max(abs(a), abs(b), 1e-30), (key, name, a, b)
        assert rs["a"]["hidden_states_scale"][4].item() == 1.0
        assert rs["c"].metadata["fp8_source_dtype"] == "source"


def test_a_lossy_writer_refuses_what_it_cannot_quantize(tmp_path, writer):
    with writer(tmp_path, lossy="fp8-e4m3", durability="none") as w:
        ints = torch.zeros(2, 4, dtype=torch.int16)
        with pytest.raises(InvalidInputError, match="hidden_states"):
            w.submit("ints", {"hidden_states": ints})
        x = _activations(2, torch.bfloat16)
        with pytest.raises(InvalidInputError, match="hidden_states_scale"):
            w.submit("scaled", {"hidden_states": x, "hidden_states_scale": torch.ones(2)})
        w.submit("fine", {"hidden_states": x})
    with layertap.open(tmp_path) as ds:
        assert list(ds.keys()) == ["fine"]
