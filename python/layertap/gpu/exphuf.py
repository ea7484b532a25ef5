"""The encoder of codec ``exp-huf`` (docs/FORMAT.md, "Codec 3") in torch operations, so that it
runs where the hidden states are: on the GPU, before the copy to the host (issue 21).

It makes the Rust writer's choices (rust/core/src/exphuf/block_encode.rs: 4 streams, 16
contexts around the sample's most common exponent, the last one where counts tie, stride = the
tensor's last dimension) and takes its code lengths from the Rust core, so it emits the bytes of
the Rust encoder, which the tests check on the CPU: what the GPU writes is defined byte for byte
by a reference that runs without a GPU, and every reader of exp-huf reads it. Without the native
module the code lengths come from the pure-Python writer's builder, which may break ties in
Huffman trees differently (still a valid block, not the same bytes).

Why exp-huf and not one of nvCOMP's codecs: on real activations it is the best ratio we have
(1.543 against bp16-zstd's 1.453 on the CPU), it is already specified and read by both readers,
and its work is whole-array arithmetic (counts, a table lookup, prefix sums of bit lengths, a
scatter of bits) that a GPU does well; nvCOMP's standard streams (zstd, gzip) decode on the CPU
but need records cut into many chunks to run fast, and its fast ANS stream is its own format
(benches/RESULTS.md, 2026-12-02).

Per tensor the encoder does one device-to-host copy of the symbol counts (64 KiB, a
synchronisation) between counting and packing: the code lengths are built on the host from
them, as the CPU encoders do. The packed streams stay on the device until the caller copies the
block out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from layertap._py import exphuf as _py_exphuf
from layertap._py.exphuf import MIN_CODED, STREAMS, block_head, contexts_of_top
from layertap._spec.exphuf import CODED, MAX_CONTEXTS, MODE_RAW, SYMBOLS, reversed_codes, segment

#: Bits a packing word holds: a value of at most 11 + 23 bits shifted by at most 15 stays below
#: 2^49, so int64 arithmetic never overflows, and adding the disjoint bits of several values
#: into one word is the same as or-ing them.
_WORD_BITS = 16


@dataclass
class Block:
    """One tensor's block: ``head`` (host bytes: mode byte and, for a coded block, everything
    before the streams) then ``body`` (a uint8 tensor on the input's device: the streams, or for
    a raw block the tensor's bytes)."""

    head: bytes
    body: torch.Tensor

    def __len__(self) -> int:
        return len(self.head) + self.body.numel()

    def to_bytes(self) -> bytes:
        return self.head + self.body.cpu().numpy().tobytes()


def _as_unsigned(t: torch.Tensor, width: int) -> torch.Tensor:
    """The elements' bit patterns as int64 (non-negative), flat."""
    flat = t.reshape(-1)
    if width == 2:
        return flat.view(torch.int16).to(torch.int64) & 0xFFFF
    return flat.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def code_lengths(hist: np.ndarray) -> np.ndarray:
    """Code lengths of each row of symbol counts ``hist`` (``[k, 512]``), from the Rust core
    (a few microseconds a table; the Python builder takes about 2 ms)."""
    try:
        from layertap import _native
    except ImportError:
        return np.array([_py_exphuf.code_lengths(h) for h in hist], dtype=np.int64)
    got = _native.exphuf_code_lengths(np.ascontiguousarray(hist, dtype="<u4").tobytes())
    return np.frombuffer(got, dtype=np.uint8).reshape(hist.shape).astype(np.int64)


def _segment_ids(n: int, device) -> torch.Tensor:
    ids = torch.empty(n, dtype=torch.int64, device=device)
    for k in range(STREAMS):
        seg = segment(n, STREAMS, k)
        ids[seg.start : seg.stop] = k
    return ids


def encode_block(t: torch.Tensor, dtype: str) -> Block:
    """The exp-huf block of tensor ``t`` (a contiguous tensor whose element size is that of
    ``dtype``, one of ``BF16``, ``F16``, ``F32``; the shape sets the stride), on ``t``'s device."""
    width, exp_shift = CODED[dtype]
    if t.element_size() != width:
        raise ValueError(f"a {dtype} block needs {width}-byte elements, not {t.element_size()}-byte {t.dtype}")
    t = t.contiguous()
    n = t.numel()
    raw_body = t.reshape(-1).view(torch.uint8)
    if n < MIN_CODED:
        return Block(bytes([MODE_RAW]), raw_body)
    device = t.device
    shape = tuple(t.shape)
    stride = shape[-1] if len(shape) >= 2 and shape[-1] < n else 0
    raw_bits = 8 * width - 9
    x = _as_unsigned(t, width)
    top = x >> raw_bits

    # Contexts (as _py.exphuf): the sample's most common exponent, then each element's context
    # from the element `stride` before it in its segment.
    sample = (top[:: max(n // 4096, 1)] & 0xFF) >> exp_shift
    mode = 255 - torch.bincount(sample, minlength=256).flip(0).argmax()  # the last of tied counts
    tt = torch.arange(SYMBOLS, device=device)
    ctx_of_top = (tt >> 8) * 8 | (torch.clamp(((tt & 0xFF) >> exp_shift) - mode, -4, 3) & 7)
    seg_id = _segment_ids(n, device)
    ctx = torch.zeros(n, dtype=torch.int64, device=device)
    if stride:
        for k in range(STREAMS):
            seg = segment(n, STREAMS, k)
            if seg.stop - seg.start > stride:
                ctx[seg.start + stride : seg.stop] = ctx_of_top[top[seg.start : seg.stop - stride]]
    sym = ((top & 0xFF) << 1) | (top >> 8)
    cell = ctx * SYMBOLS + sym

    # Counts per segment and cell: the one copy to the host before packing.
    counts = torch.bincount(seg_id * (MAX_CONTEXTS * SYMBOLS) + cell, minlength=STREAMS * MAX_CONTEXTS * SYMBOLS)
    counts = counts.reshape(STREAMS, MAX_CONTEXTS, SYMBOLS).cpu().numpy()
    hist = counts.sum(axis=0)
    lengths = code_lengths(hist)
    stream_bits = (counts * (lengths + raw_bits)[None]).sum(axis=(1, 2))
    stream_lens = [int(b + 7) // 8 for b in stream_bits]
    head = block_head(stride, contexts_of_top(int(mode), exp_shift), lengths, stream_lens)
    if len(head) + sum(stream_lens) >= 1 + n * width:
        return Block(bytes([MODE_RAW]), raw_body)

    codes = np.array([reversed_codes(list(ln)) for ln in lengths], dtype=np.int64)
    code_of_cell = torch.from_numpy(codes.reshape(-1)).to(device)
    len_of_cell = torch.from_numpy(lengths.reshape(-1)).to(device)
    length = len_of_cell[cell]
    values = code_of_cell[cell] | (x & ((1 << raw_bits) - 1)) << length
    nbits = length + raw_bits
    # Bit offset of each element in the block's streams: streams start on byte boundaries.
    stream_base = torch.tensor(np.concatenate([[0], np.cumsum(stream_lens)[:-1]]) * 8, device=device)
    ends = torch.cumsum(nbits, 0)
    seg_start = torch.tensor([segment(n, STREAMS, k).start for k in range(STREAMS)], device=device)
    before = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), ends])[seg_start]
    offset = ends - nbits - before[seg_id] + stream_base[seg_id]
    return Block(head, _pack(values, offset, 8 * sum(stream_lens)))


def _pack(values: torch.Tensor, offset: torch.Tensor, total_bits: int) -> torch.Tensor:
    """The bytes of a bit string of ``total_bits`` bits (a multiple of 8) in which value ``i``
    starts at bit ``offset[i]``, least significant bit first; bits no value covers are 0."""
    words = torch.zeros(total_bits // _WORD_BITS + 4, dtype=torch.int64, device=values.device)
    first = offset // _WORD_BITS
    shifted = values << (offset % _WORD_BITS)
    for k in range(4):  # a value of at most 34 bits, shifted by at most 15, spans 4 words
        words.index_add_(0, first + k, (shifted >> (_WORD_BITS * k)) & 0xFFFF)
    out = torch.stack([words & 0xFF, words >> 8], dim=1).reshape(-1).to(torch.uint8)
    return out[: total_bits // 8]


def encode_blob_tensors(tensors: list[tuple[torch.Tensor, str]]) -> list[Block]:
    """Blocks of a record's tensors, in the order of their data; tensors of other dtypes
    (``dtype`` not in CODED) are stored as they are."""
    out = []
    for t, dtype in tensors:
        if dtype in CODED:
            out.append(encode_block(t, dtype))
        else:
            out.append(Block(b"", t.contiguous().reshape(-1).view(torch.uint8)))
    return out
