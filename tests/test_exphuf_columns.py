"""exp-huf blocks coded by column (docs/FORMAT.md, codec 3, "Mode 2"): the Python reference
encoder writes what the Rust one writes (mode 2 by default, mode 1 by element), both decoders
read both, and every block that the format says a decoder MUST reject is refused by both."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from layertap import _native
from layertap._decoder import record_decoder
from layertap._py import exphuf as py_encoder
from layertap._spec import exphuf as spec
from layertap._spec.blob import build_header
from layertap._spec.format import CODEC_EXP_HUF, FormatProblem
from layertap.errors import CorruptRecordError, InvalidInputError

NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def _blob(*tensors: torch.Tensor) -> tuple[bytes, int]:
    """The safetensors blob of ``tensors`` (named t0, t1, ...) and its header's length."""
    header = build_header([(f"t{i}", NAMES[t.dtype], tuple(t.shape)) for i, t in enumerate(tensors)], {"key": "k"})
    return header + b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors), len(header)


def _activations(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[..., 3 % shape[-1]] *= 30.0  # an outlier channel
    return x.to(dtype)


def _rust_decode(stored: bytes, raw_len: int) -> bytes | str:
    """The blob the core decodes from ``stored``, or "corrupt"."""
    try:
        _, tensors = record_decoder("rust").decode(
            stored, key="k", codec=CODEC_EXP_HUF, raw_len=raw_len, payload_crc=None, path="p", offset=0
        )
    except CorruptRecordError:
        return "corrupt"
    return b"".join(bytes(memoryview(b).cast("B")) for *_, b in tensors)


#: (shape, dtype, the streams the writers choose): 4 per 32,768 elements, at least 4 where there
#: are 4 columns, at most the columns; columns that do not split evenly among the
#: streams; a 1-dimensional tensor (one row); f32's 23 raw bits.
SHAPES = [
    ((64, 2, 32), torch.bfloat16, 4),
    ((64, 257), torch.bfloat16, 4),
    ((100, 512), torch.bfloat16, 4),
    ((130, 512), torch.bfloat16, 8),
    ((5000, 2), torch.bfloat16, 2),
    ((3, 9000), torch.float16, 4),
    ((20000,), torch.float16, 4),
    ((40, 3, 170), torch.float32, 4),
]


@pytest.mark.parametrize("shape,dtype,streams", SHAPES)
def test_the_reference_encoder_writes_what_the_rust_encoder_writes(shape, dtype, streams):
    x = _activations(shape, dtype)
    raw, head = _blob(x)
    columns = shape[-1] if len(shape) > 1 else x.numel()
    for by, mode in (("column", spec.MODE_COLUMNS), ("element", spec.MODE_CODED)):
        ours, rusts = py_encoder.encode(raw, by=by), _native.exphuf_encode(raw, by=by)
        assert ours[head] == rusts[head] == mode
        if by == "column":
            assert struct.unpack_from("<II", ours, head + 5) == (columns, streams)
        # The same bytes, but for codes of equally frequent symbols (Huffman trees that tie).
        assert len(ours) == len(rusts) or abs(len(ours) - len(rusts)) <= 8, by
        for stored in (ours, rusts):
            assert bytes(spec.decode(stored, len(raw))) == raw
            assert _rust_decode(stored, len(raw)) == raw[head:]


def test_small_and_empty_blocks_and_any_stream_count():
    # Each stream count a block of 24 columns can have, with uneven splits; the columns one
    # row (1-D), and an empty tensor beside them.
    x = _activations((64, 24), torch.bfloat16, seed=1)
    for streams in range(1, 25):
        raw, head = _blob(x, torch.zeros(0, 24, dtype=torch.bfloat16), x.reshape(-1))
        stored = py_encoder.encode(raw, streams=streams)
        assert stored[head] == spec.MODE_COLUMNS and struct.unpack_from("<I", stored, head + 9)[0] == streams
        assert bytes(spec.decode(stored, len(raw))) == raw
        assert _rust_decode(stored, len(raw)) == raw[head:]
    with pytest.raises(ValueError, match="25 streams for 24 columns"):
        py_encoder.encode(raw, streams=25)


def _block(streams: int = 3) -> tuple[bytes, int, int, dict]:
    """A mode-2 payload of one bf16 tensor ``[64, 24]`` in ``streams`` streams, its raw length,
    the block's start, and where its stream lengths are."""
    raw, head = _blob(_activations((64, 24), torch.bfloat16, seed=2))
    stored = py_encoder.encode(raw, streams=streams)
    assert stored[head] == spec.MODE_COLUMNS
    at = head + 1 + 12 + 256
    for _ in range(16):
        at += 4 + (struct.unpack_from("<H", stored, at + 2)[0] + 1) // 2
    return stored, len(raw), head, {"lens": at, "stream_lens": struct.unpack_from(f"<{streams}Q", stored, at)}


def _uniform(rows: int, columns: int, streams: int, damage=None) -> tuple[bytes, int]:
    """A mode-2 payload made by hand of a bf16 ``[rows, columns]`` of ones (top 0x7F, raw bits
    0): one context whose only code is symbol 0x7F's, 1 bit ``0``; ``damage(block, plane_end)``
    may change the block's bytes (its streams start at ``plane_end``). And its raw length."""
    raw, head = _blob(torch.ones(rows, columns, dtype=torch.bfloat16))
    n = rows * columns
    block = bytearray([spec.MODE_COLUMNS, 1, 0, 0, 0]) + struct.pack("<II", columns, streams) + bytes(256)
    block += struct.pack("<HH", spec.symbol_of_top(0x7F), 1) + bytes([1])
    lens = [(len(spec.stream_columns(columns, streams, k)) * rows + 7) // 8 for k in range(streams)]
    block += struct.pack(f"<{streams}Q", *lens) + bytes((n * 7 + 7) // 8)
    plane_end = len(block)
    block += bytes(sum(lens))
    if damage:
        damage(block, plane_end)
    return raw[:head] + bytes(block), len(raw)


def _set(stored: bytes, at: int, fmt: str, value) -> bytes:
    out = bytearray(stored)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


def _damaged() -> list[tuple[str, bytes, int, str]]:
    """(case, payload, raw length, what the reference decoder says) of each MUST-reject case."""
    stored, raw_len, head, f = _block()

    def set_bit(at, mask):
        return lambda b, plane_end: b.__setitem__(at(plane_end), b[at(plane_end)] | mask)

    # [5, 9] in 1 stream: 45 one-bit codes (6 bytes, 3 bits of padding) and 315 raw bits (40
    # bytes, 5 of padding).
    return [
        ("mode 3", _set(stored, head, "<B", 3), raw_len, "block mode 3 is unknown"),
        ("no contexts", _set(stored, head + 1, "<B", 0), raw_len, "0 contexts"),
        ("17 contexts", _set(stored, head + 1, "<B", 17), raw_len, "17 contexts"),
        ("reserved", _set(stored, head + 3, "<B", 1), raw_len, "reserved bytes"),
        ("0 columns", _set(stored, head + 5, "<I", 0), raw_len, "rows of 0 columns"),
        ("columns not dividing n", _set(stored, head + 5, "<I", 25), raw_len, "rows of 25 columns"),
        ("0 streams", _set(stored, head + 9, "<I", 0), raw_len, "0 streams for 24 columns"),
        ("more streams than columns", _set(stored, head + 9, "<I", 25), raw_len, "25 streams for 24 columns"),
        ("context map past C", _set(stored, head + 1, "<B", 15), raw_len, "names context 15 of 15"),
        ("stream longer", _set(stored, f["lens"], "<Q", f["stream_lens"][0] + 1), raw_len, "stream 0 holds"),
        ("stream shorter", _set(stored, f["lens"], "<Q", f["stream_lens"][0] - 1), raw_len, "stream 0 holds"),
        ("stream past the payload", _set(stored, f["lens"] + 16, "<Q", 1 << 40), raw_len, "runs past"),
        ("streams end before the payload", stored + b"\0", raw_len, "1 bytes after the last tensor"),
        ("streams end after the payload", stored[:-1], raw_len, "runs past"),
        ("raw plane cut", stored[: f["lens"] + 24 + 64 * 24 * 7 // 8 - 4], raw_len, "raw plane runs past"),
        ("no code", *_uniform(5, 9, 1, set_bit(lambda e: e, 1)), "no code"),
        ("no code in stream 2", *_uniform(5, 9, 4, set_bit(lambda e: e + 2 + 1 + 1, 2)), "no code"),
        ("stream padding", *_uniform(5, 9, 1, set_bit(lambda e: e + 5, 0x80)), "stream 0: padding"),
        ("raw plane padding", *_uniform(5, 9, 1, set_bit(lambda e: e - 1, 0x80)), "raw plane's padding"),
    ]


@pytest.mark.parametrize("case,stored,raw_len,says", _damaged(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_must_reject_case_is_refused_by_both_decoders(case, stored, raw_len, says):
    with pytest.raises(FormatProblem, match=says):
        spec.decode(stored, raw_len)
    assert _rust_decode(stored, raw_len) == "corrupt", case


#: The MUST-reject cases only a stream's decode finds: the Triton decoder's kernels check them,
#: not its host's parse of the heads.
IN_THE_STREAMS = {"no code", "no code in stream 2", "stream padding"}
#: Where the parse finds a case by other means: a stream's length off by one moves the end of
#: the last stream off the payload's.
PARSE_SAYS = {"stream longer": "a stream runs past the payload", "stream shorter": "1 bytes after the last tensor's"}


def _staged(stored: bytes, at: int = 16) -> np.ndarray:
    """``stored`` at byte ``at`` of a buffer, as the Triton decoder's Staging lays a batch out."""
    staged = np.full(at + len(stored) + 24, 0xAB, np.uint8)
    staged[at : at + len(stored)] = np.frombuffer(stored, np.uint8)
    return staged


@pytest.mark.parametrize("case,stored,raw_len,says", _damaged(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_device_decoders_parse_refuses_every_case_the_heads_show(case, stored, raw_len, says):
    # The Triton decoder's host part (``_native.exphuf_batch_heads``) in the reference's words,
    # naming the record of the batch; the cases in the streams are the kernels' to find.
    sound, _, _, _ = _block()
    staged = np.concatenate([_staged(sound), _staged(stored)])
    bases, lengths = [16, len(sound) + 40 + 16], [len(sound), len(stored)]
    if case in IN_THE_STREAMS:
        heads = _native.exphuf_batch_heads(staged, bases, lengths)
        assert heads["names"] == ["t0", "t0"]
        return
    with pytest.raises(CorruptRecordError, match=PARSE_SAYS.get(case, says)) as info:
        _native.exphuf_batch_heads(staged, bases, lengths)
    assert str(info.value).startswith("record 1 of the batch is not a valid exp-huf payload: "), info.value


def test_the_device_decoders_parse_takes_payloads_inside_its_buffer():
    stored, _, _, f = _block()
    staged = _staged(stored)
    heads = _native.exphuf_batch_heads(staged, [16, 16], [len(stored), len(stored)])
    assert heads["metadata"] == [{"key": "k"}] * 2 and heads["shapes"] == [[64, 24]] * 2
    # each stream's bits in the buffer: after the 3 stream lengths and the raw plane
    first = 16 + f["lens"] + 3 * 8 + 64 * 24 * 7 // 8
    ends = first + np.cumsum(f["stream_lens"])
    lanes = np.frombuffer(heads["column_lanes"], np.int64).reshape(-1, 7)
    assert lanes[:3, :2].tolist() == [[8 * (e - n), 8 * e] for e, n in zip(ends, f["stream_lens"])]
    with pytest.raises(InvalidInputError, match="payload 1 .* lies outside the"):
        _native.exphuf_batch_heads(staged, [16, 41], [len(stored), len(stored)])
    with pytest.raises(InvalidInputError, match="2 bases for 1 lengths"):
        _native.exphuf_batch_heads(staged, [16, 16], [len(stored)])
    with pytest.raises(TypeError, match="buffer protocol"):
        _native.exphuf_batch_heads(3, [], [])


@pytest.mark.parametrize("rows,columns,streams", [(5, 9, 1), (5, 9, 4), (8, 8, 8), (1, 64, 3)])
def test_a_block_made_by_hand_decodes_alike_in_both(rows, columns, streams):
    # The smallest codes a block can have (one context, one symbol of 1 bit), any stream count,
    # padding in the streams and in the raw plane.
    stored, raw_len = _uniform(rows, columns, streams)
    raw, _ = _blob(torch.ones(rows, columns, dtype=torch.bfloat16))
    assert bytes(spec.decode(stored, raw_len)) == raw
    assert _rust_decode(stored, raw_len) == raw[len(raw) - 2 * rows * columns :]
