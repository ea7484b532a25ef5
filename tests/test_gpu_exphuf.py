"""The torch encoder of exp-huf (layertap.gpu.exphuf), run on the CPU: the bytes it emits are
those of the Rust writer's encoder (which the readers' tests read), block by block and for a
whole record's payload, and the reference decoder gives the tensors back bit for bit."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from helpers import python_runs_during
from layertap import _native
from layertap._py import exphuf as np_exphuf
from layertap._spec import exphuf as spec
from layertap._spec.blob import build_header
from layertap.errors import InvalidInputError
from layertap.gpu.exphuf import (
    Block,
    code_lengths,
    encode_block,
    encode_blocks,
    encode_contiguous,
    reversed_codes_of,
)

NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def activations_like(shape, dtype, seed=0) -> torch.Tensor:
    """Values whose exponents vary by layer and channel, as hidden states' do."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-2, 2, shape[-1]) if len(shape) > 1 else torch.tensor(1.0)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def reference(t: torch.Tensor) -> bytes:
    """The Rust encoder's block of ``t`` coded by element (mode 1, what the GPU encoders write;
    the Rust writer's own blocks are mode 2): its payload of a blob holding ``t`` alone, less
    the blob's header."""
    header = build_header([("t", NAMES[t.dtype], tuple(t.shape))], {})
    raw = header + t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    payload = _native.exphuf_encode(raw, by="element")
    assert payload[: len(header)] == header
    return payload[len(header) :]


CASES = [
    ((64, 3, 256), torch.bfloat16),  # [tokens, layers, hidden]: contexts one layer back
    ((33, 2, 100), torch.bfloat16),  # segments of unequal length
    ((1000,), torch.bfloat16),  # one dimension: no context
    ((100, 4, 64), torch.float16),
    ((40, 50), torch.float32),
    ((2, 3000), torch.bfloat16),  # stride 3000 against segments of 1500: no element has a context
]


@pytest.mark.parametrize("shape,dtype", CASES, ids=[f"{NAMES[d]}{list(s)}" for s, d in CASES])
def test_blocks_equal_the_rust_writers(shape, dtype):
    t = activations_like(shape, dtype)
    block = encode_block(t, NAMES[dtype])
    assert block.head[0] == spec.MODE_CODED
    assert block.to_bytes() == reference(t)
    width = t.element_size()
    values, end = spec.decode_block(block.to_bytes(), 0, t.numel(), width)
    assert end == len(block)
    assert np.asarray(values).tobytes() == t.reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(63, dtype=torch.bfloat16),  # under 64 elements: raw
        lambda: torch.full((300,), 1.5, dtype=torch.bfloat16),  # one symbol: 1-bit codes
        # every bit pattern equally likely: coding does not pay, stored raw
        lambda: torch.randint(-(2**15), 2**15, (4096,), dtype=torch.int16).view(torch.bfloat16),
        lambda: torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 1e-40] * 20, dtype=torch.float32),
    ],
    ids=["short", "one-symbol", "incompressible", "special-values"],
)
def test_edge_cases_equal_the_rust_writers(make):
    t = make()
    block = encode_block(t, NAMES[t.dtype])
    assert block.to_bytes() == reference(t)
    values, _ = spec.decode_block(block.to_bytes(), 0, t.numel(), t.element_size())
    assert np.asarray(values).tobytes() == t.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_a_records_payload_equals_the_rust_writers():
    hidden = activations_like((48, 3, 128), torch.bfloat16, seed=1)
    ids = torch.arange(48, dtype=torch.int64)
    header = build_header(
        [("hidden_states", "BF16", tuple(hidden.shape)), ("token_ids", "I64", (48,))], {"num_tokens": "48"}
    )
    raw = header + hidden.view(torch.uint8).numpy().tobytes() + ids.view(torch.uint8).numpy().tobytes()
    # The I64 tensor is stored as it is: exp-huf codes only BF16, F16 and F32.
    payload = header + encode_block(hidden, "BF16").to_bytes() + ids.view(torch.uint8).numpy().tobytes()
    assert payload == _native.exphuf_encode(raw, by="element")
    assert bytes(spec.decode(payload, len(raw))) == raw


def test_a_dtype_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="2-byte elements"):
        encode_block(torch.zeros(100, dtype=torch.float32), "BF16")


def test_the_block_stays_on_the_inputs_device():
    block = encode_block(activations_like((16, 2, 64), torch.bfloat16), "BF16")
    assert isinstance(block, Block) and block.body.device == torch.device("cpu")
    assert block.body.dtype == torch.uint8


def test_without_the_native_module_the_python_code_lengths_give_a_valid_block(monkeypatch):
    import layertap.gpu.exphuf as gpu_exphuf

    t = activations_like((32, 3, 128), torch.bfloat16, seed=2)
    hist = np.random.default_rng(0).integers(0, 1000, (2, 512))
    monkeypatch.setitem(sys.modules, "layertap._native", None)  # import fails as without the build
    python_lengths = gpu_exphuf.code_lengths(hist)
    assert python_lengths.tolist() == [np_exphuf.code_lengths(h) for h in hist]
    block = encode_block(t, "BF16")
    values, _ = spec.decode_block(block.to_bytes(), 0, t.numel(), 2)
    assert np.asarray(values).tobytes() == t.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_the_native_helpers_refuse_bad_input_with_typed_errors():
    with pytest.raises(InvalidInputError, match="whole number of 512-symbol"):
        _native.exphuf_code_lengths(b"\0" * 100)
    with pytest.raises(InvalidInputError, match="not a blob exp-huf can encode"):
        _native.exphuf_encode(b"\x05")


def test_a_batch_gives_each_tensor_its_own_block():
    """One pass over tensors of different shapes, a short one and an incompressible one among
    them: each block is the one the tensor gets alone (the Rust encoder's)."""
    tensors = [
        activations_like((40, 3, 96), torch.bfloat16, seed=3),
        torch.zeros(10, dtype=torch.bfloat16),
        activations_like((7, 1000), torch.bfloat16, seed=4),
        torch.randint(-(2**15), 2**15, (2048,), dtype=torch.int16).view(torch.bfloat16),
        activations_like((3000,), torch.bfloat16, seed=5) * 1e-30,  # exponents far from the others'
    ]
    blocks = encode_blocks(tensors, "BF16")
    assert [b.to_bytes() for b in blocks] == [reference(t) for t in tensors]
    assert [b.head[0] for b in blocks][:4] == [spec.MODE_CODED, spec.MODE_RAW, spec.MODE_CODED, spec.MODE_RAW]


@pytest.mark.parametrize("order", ["mixed", "raw-first", "one", "raw-only"])
def test_contiguous_blocks_are_the_batchs_blocks_back_to_back(order):
    """What the connector copies to the host in one piece (compress_on="gpu"): every block in
    its place, heads included, raw blocks (short, incompressible) among coded ones."""
    coded = [activations_like((40, 3, 96), torch.bfloat16, seed=s) for s in (6, 7)]
    short = torch.zeros(10, dtype=torch.bfloat16)
    noise = torch.randint(-(2**15), 2**15, (2048,), dtype=torch.int16).view(torch.bfloat16)
    tensors = {
        "mixed": [coded[0], short, noise, coded[1]],
        "raw-first": [noise, short, coded[0]],
        "one": [coded[1]],
        "raw-only": [short, noise],
    }[order]
    buf, sizes = encode_contiguous(tensors, "BF16")
    want = [reference(t) for t in tensors]
    assert sizes == [len(w) for w in want]
    assert buf.dtype == torch.uint8 and buf.numel() == sum(sizes)
    assert buf.numpy().tobytes() == b"".join(want)


def test_canonical_codes_equal_the_references(monkeypatch):
    """The Rust core's codes (what the encoder uses where the extension is built) and those
    without the extension equal the spec's reference."""
    rng = np.random.default_rng(1)
    lengths = code_lengths(rng.integers(0, 50, (6, 512)) * (rng.random((6, 512)) < 0.3))
    want = [spec.reversed_codes(list(ln)) for ln in lengths]
    assert reversed_codes_of(lengths).tolist() == want
    monkeypatch.setitem(sys.modules, "layertap._native", None)  # import fails as without the build
    codes = reversed_codes_of(lengths)
    assert codes.dtype == np.uint16 and codes.tolist() == want


def test_the_native_head_and_code_builders_refuse_bad_tables():
    good = np.zeros((1, 16, 512), dtype=np.uint8)
    good[..., :2] = 1
    assert len(_native.exphuf_coded_heads("BF16", [8], [127], good.tobytes(), [1, 1, 1, 1])) == 1
    with pytest.raises(InvalidInputError, match="table 0: code lengths are over-subscribed"):
        _native.exphuf_reversed_codes(bytes([1, 1, 1] + [0] * 509))
    with pytest.raises(InvalidInputError, match="tensor 0: context 0: code length 12 is over 11"):
        bad = good.copy()
        bad[0, 0, 5] = 12
        _native.exphuf_coded_heads("BF16", [8], [127], bad.tobytes(), [1, 1, 1, 1])
    with pytest.raises(InvalidInputError, match="tensor 0: 3 streams"):
        _native.exphuf_coded_heads("BF16", [8], [127], good.tobytes(), [1, 1, 1])
    with pytest.raises(InvalidInputError, match="do not describe the same tensors"):
        _native.exphuf_coded_heads("BF16", [8, 8], [127], good.tobytes(), [1, 1, 1, 1])
    with pytest.raises(InvalidInputError, match="I64"):
        _native.exphuf_coded_heads("I64", [8], [127], good.tobytes(), [1, 1, 1, 1])


@pytest.mark.parametrize("builder", ["exphuf_code_lengths", "exphuf_reversed_codes", "exphuf_coded_heads"])
def test_the_table_builders_release_the_gil(builder):
    """The GPU path's thread builds about 1,000 tables a batch (milliseconds) beside the engine
    thread: each builder releases the GIL around its work. Watched without a clock
    (``helpers.python_runs_during``): another Python thread runs during the call only if the
    call lets the GIL go; the work (100-200 ms here) leaves that thread ample time to run."""
    lengths = np.zeros((16 * 6000, 512), dtype=np.uint8)
    lengths[:, :2] = 1
    heads = 6000  # 16 tables each
    args = {
        "exphuf_code_lengths": (np.ones((12_000, 512), "<u4").tobytes(),),
        "exphuf_reversed_codes": (lengths[:48_000].tobytes(),),
        "exphuf_coded_heads": ("BF16", [8] * heads, [127] * heads, lengths.tobytes(), [1, 1, 1, 1] * heads),
    }[builder]
    call = getattr(_native, builder)
    ran = python_runs_during(lambda: call(*args))
    assert ran > 0, f"no other Python thread ran during {builder}: it kept the GIL"
