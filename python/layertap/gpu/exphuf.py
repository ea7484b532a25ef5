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
from layertap._spec.exphuf import CODED, MAX_CODE_LEN, MAX_CONTEXTS, MODE_RAW, SYMBOLS

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
        from layertap._native import exphuf_code_lengths  # where the extension is built
    except ImportError:
        return np.array([_py_exphuf.code_lengths(h) for h in hist], dtype=np.int64)
    got = exphuf_code_lengths(np.ascontiguousarray(hist, dtype="<u4").tobytes())
    return np.frombuffer(got, dtype=np.uint8).reshape(hist.shape).astype(np.int64)


def reversed_codes_of(lengths: np.ndarray) -> np.ndarray:
    """The canonical codes (RFC 1951, 3.2.2) of each row of code lengths, bit-reversed as
    ``_spec.exphuf.reversed_codes`` gives them, for all rows at once."""
    lengths = np.asarray(lengths, dtype=np.int64)
    rows = lengths.shape[0]
    bl_count = np.zeros((rows, MAX_CODE_LEN + 1), dtype=np.int64)
    np.add.at(bl_count, (np.arange(rows)[:, None].repeat(SYMBOLS, 1), lengths), 1)
    bl_count[:, 0] = 0
    next_code = np.zeros((rows, MAX_CODE_LEN + 1), dtype=np.int64)
    code = np.zeros(rows, dtype=np.int64)
    for ln in range(1, MAX_CODE_LEN + 1):
        code = (code + bl_count[:, ln - 1]) << 1
        next_code[:, ln] = code
    # Rank of each symbol among the symbols of its length, in symbol order.
    one_hot = lengths[:, :, None] == np.arange(MAX_CODE_LEN + 1)[None, None, :]
    rank = np.take_along_axis(np.cumsum(one_hot, axis=1) - 1, lengths[:, :, None], axis=2)[:, :, 0]
    codes = np.take_along_axis(next_code, lengths, axis=1) + rank
    rev = _REVERSED[codes & ((1 << MAX_CODE_LEN) - 1)] >> (MAX_CODE_LEN - lengths)
    return np.where(lengths > 0, rev, 0)


#: Bit reversal of every MAX_CODE_LEN-bit value.
_REVERSED = np.array([int(f"{v:0{MAX_CODE_LEN}b}"[::-1], 2) for v in range(1 << MAX_CODE_LEN)], dtype=np.int64)


@dataclass
class _Plan:
    """What the host decided for one tensor of a batch."""

    n: int
    stride: int
    mode: int


def encode_block(t: torch.Tensor, dtype: str) -> Block:
    """The exp-huf block of tensor ``t`` (a contiguous tensor whose element size is that of
    ``dtype``, one of ``BF16``, ``F16``, ``F32``; the shape sets the stride), on ``t``'s device."""
    return encode_blocks([t], dtype)[0]


def encode_blocks(tensors: list[torch.Tensor], dtype: str) -> list[Block]:
    """The exp-huf blocks of several tensors of one dtype, on their (common) device, in one pass:
    the same kernels whatever the count, two small copies to the host (the symbol counts, then
    the streams' bit lengths). The bodies are views of one buffer."""
    width, exp_shift = CODED[dtype]
    for t in tensors:
        if t.element_size() != width:
            raise ValueError(f"a {dtype} block needs {width}-byte elements, not {t.element_size()}-byte {t.dtype}")
    blocks: list[Block | None] = [None] * len(tensors)
    coded = []
    for i, t in enumerate(tensors):
        t = t.contiguous()
        if t.numel() < MIN_CODED:
            blocks[i] = Block(bytes([MODE_RAW]), t.reshape(-1).view(torch.uint8))
        else:
            coded.append((i, t))
    if not coded:
        return blocks
    device = coded[0][1].device
    raw_bits = 8 * width - 9
    plans = []
    for _, t in coded:
        n, shape = t.numel(), tuple(t.shape)
        plans.append(_Plan(n=n, stride=shape[-1] if len(shape) >= 2 and shape[-1] < n else 0, mode=0))
    ns = np.array([p.n for p in plans], dtype=np.int64)
    base = np.concatenate([[0], np.cumsum(ns)[:-1]])
    total = int(ns.sum())
    # Segments: STREAMS per tensor, in order; their starts, global and sorted.
    seg_start = np.array([b + k * n // STREAMS for b, n in zip(base, ns) for k in range(STREAMS)], dtype=np.int64)
    seg_stride = np.repeat([p.stride for p in plans], STREAMS)
    # Elements of the sample that picks each tensor's contexts: every max(n // 4096, 1)-th.
    step = np.maximum(ns // 4096, 1)

    x = torch.cat([_as_unsigned(t, width) for _, t in coded])
    top = x >> raw_bits
    idx = torch.arange(total, device=device)
    rec = torch.repeat_interleave(torch.arange(len(plans), device=device), torch.from_numpy(ns).to(device))
    local = idx - torch.from_numpy(base).to(device)[rec]
    seg_start_t = torch.from_numpy(seg_start).to(device)
    seg = torch.searchsorted(seg_start_t, idx, right=True) - 1
    in_sample = local % torch.from_numpy(step).to(device)[rec] == 0
    exps = torch.bincount((rec * 256 + ((top & 0xFF) >> exp_shift))[in_sample], minlength=len(plans) * 256).reshape(
        -1, 256
    )
    mode = 255 - exps.flip(1).argmax(1)  # the last of tied counts, as the Rust encoder
    tt = torch.arange(SYMBOLS, device=device)
    ctx_of_top = (tt[None] >> 8) * 8 | (torch.clamp(((tt[None] & 0xFF) >> exp_shift) - mode[:, None], -4, 3) & 7)
    # Each element's context: that of the element `stride` before it in its segment, if any.
    stride_of = torch.from_numpy(seg_stride).to(device)[seg]
    has_ctx = (stride_of > 0) & (idx - seg_start_t[seg] >= stride_of)
    prev = torch.where(has_ctx, idx - stride_of, idx)
    ctx = torch.where(has_ctx, ctx_of_top.reshape(-1)[rec * SYMBOLS + top[prev]], 0)
    sym = ((top & 0xFF) << 1) | (top >> 8)
    cell = (rec * MAX_CONTEXTS + ctx) * SYMBOLS + sym

    # First copy to the host: the counts of each tensor's contexts, for its code lengths.
    hist = torch.bincount(cell, minlength=len(plans) * MAX_CONTEXTS * SYMBOLS).to(torch.int32).cpu().numpy()
    modes = mode.cpu().numpy()
    lengths = code_lengths(hist.reshape(-1, SYMBOLS)).reshape(len(plans), MAX_CONTEXTS, SYMBOLS)
    codes = reversed_codes_of(lengths.reshape(-1, SYMBOLS))
    len_of_cell = torch.from_numpy(lengths.reshape(-1)).to(device)
    length = len_of_cell[cell]
    values = torch.from_numpy(codes.reshape(-1)).to(device)[cell] | (x & ((1 << raw_bits) - 1)) << length
    nbits = length + raw_bits
    # Second copy: each stream's bit length, which sets the layout of the output.
    seg_bits = torch.zeros(len(seg_start), dtype=torch.int64, device=device).index_add_(0, seg, nbits)
    seg_bytes = (seg_bits.cpu().numpy() + 7) // 8
    seg_base = np.concatenate([[0], np.cumsum(seg_bytes)[:-1]])
    ends = torch.cumsum(nbits, 0)
    before = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), ends])[seg_start_t]
    offset = ends - nbits - before[seg] + 8 * torch.from_numpy(seg_base).to(device)[seg]
    packed = _pack(values, offset, 8 * int(seg_bytes.sum()))

    for j, ((i, t), plan) in enumerate(zip(coded, plans)):
        lens = [int(v) for v in seg_bytes[j * STREAMS : (j + 1) * STREAMS]]
        head = block_head(plan.stride, contexts_of_top(int(modes[j]), exp_shift), lengths[j], lens)
        if len(head) + sum(lens) >= 1 + plan.n * width:
            blocks[i] = Block(bytes([MODE_RAW]), t.reshape(-1).view(torch.uint8))
        else:
            start = int(seg_base[j * STREAMS])
            blocks[i] = Block(bytes(head), packed[start : start + sum(lens)])
    return blocks


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
