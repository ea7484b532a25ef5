"""The device work of the exp-huf encoder (``layertap.gpu.exphuf``) as Triton kernels: four
launches a pass where the torch operations take about ninety, the host part (plans, code
lengths, heads, layout) unchanged, so the bytes are the same (tests/test_triton_exphuf_encoder.py
checks them in Triton's interpreter against the Rust encoder).

The elements of the coded tensors lie back to back in one flat array; each tensor has STREAMS
segments and each segment is cut into blocks of ``BLOCK`` elements that never straddle two
segments (the table of blocks is made on the host from the sizes alone: nothing is read back to
cut them). Per pass:

1. ``sample_contexts``: one program a tensor. The histogram of the exponent buckets of every
   ``step``-th element (``tl.histogram``), its mode (the last of tied counts, as the Rust
   encoder), and the tensor's context of each 9-bit top (512 entries).
2. ``count_symbols``: one program a block. Each element's symbol and context (that of the
   element ``stride`` before it in its segment, 0 where there is none), added to the counts of
   its (tensor, context, symbol) cell with atomics. [The host reads the counts once, builds the
   code lengths and codes in the Rust core and sends the tables back.]
3. ``block_bits``: one program a block, the sum of its elements' bit lengths (code length plus
   raw bits); a running sum over the blocks (torch) gives each segment's bits, the second and
   last read, which sets the layout.
4. ``pack``: one program a block. Each element's bit offset (its block's start plus a running
   sum inside the block, ``tl.cumsum``), its value (reversed code, then raw bits), or-ed into
   32-bit words with ``tl.atomic_or`` (a value of at most 11 + 23 bits at a shift of at most 31
   touches at most 3 words; two values of different segments never share a byte, as every
   stream starts on a byte).

Kernels 2 to 4 recompute the symbol and context of each element from its 2 (or 4) bytes and
those of the element ``stride`` before it rather than storing them: a read of the input costs
less than a write then a read of an intermediate. Why atomics for the counts and the packing:
they are the simplest form that is bit-exact; what they cost on the H200 is measured by
``benches/gpu/bench_gpu_exphuf.py --impl`` (against the torch operations).

This module imports triton: it is imported only when the Triton implementation is chosen
(``impl="triton"``), never by vLLM's CPU build.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

#: Streams per tensor, and the symbols and contexts of a table (docs/FORMAT.md, codec 3).
STREAMS = 4
SYMBOLS = 512
CONTEXTS = 16

#: Elements a program of kernels 2 to 4 takes: a power of two.
BLOCK = 1024
#: Elements of the sample a program of kernel 1 takes at a time.
SAMPLE_BLOCK = 1024


@triton.jit
def _top_of(v, MASK: tl.constexpr, RAW_BITS: tl.constexpr):
    """The 9 top bits (sign, then exponent and for F16 the mantissa's first bits) of elements
    loaded as signed integers."""
    return (v.to(tl.int64) & MASK) >> RAW_BITS


@triton.jit
def _sample_contexts_kernel(
    x_ptr,
    base_ptr,
    n_ptr,
    step_ptr,
    mode_ptr,
    ctx_ptr,
    MASK: tl.constexpr,
    RAW_BITS: tl.constexpr,
    EXP_SHIFT: tl.constexpr,
    SAMPLE_BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    base = tl.load(base_ptr + t)
    n = tl.load(n_ptr + t)
    step = tl.load(step_ptr + t)
    per = (n + step - 1) // step
    hist = tl.zeros([256], dtype=tl.int32)
    for k0 in range(0, per, SAMPLE_BLOCK):
        k = k0 + tl.arange(0, SAMPLE_BLOCK)
        m = k < per
        v = tl.load(x_ptr + base + k * step, mask=m, other=0)
        bucket = (_top_of(v, MASK, RAW_BITS) & 0xFF) >> EXP_SHIFT
        hist += tl.histogram(bucket.to(tl.int32), 256, mask=m)
    bins = tl.arange(0, 256)
    most = tl.max(hist, 0)
    mode = tl.max(tl.where(hist == most, bins, -1), 0)  # the last of tied counts
    tl.store(mode_ptr + t, mode)
    tops = tl.arange(0, 512)
    d = tl.minimum(tl.maximum(((tops & 0xFF) >> EXP_SHIFT) - mode, -4), 3)
    tl.store(ctx_ptr + t * 512 + tops, (tops >> 8) * 8 | (d & 7))


@triton.jit
def _cells(
    x_ptr,
    ctx_ptr,
    blk_seg_ptr,
    blk_start_ptr,
    blk_end_ptr,
    seg_start_ptr,
    seg_stride_ptr,
    MASK: tl.constexpr,
    RAW_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Block ``program_id``'s elements: their bit patterns, their cells (tensor, context,
    symbol) in the table of counts, and which lanes hold an element; and the block's segment."""
    b = tl.program_id(0)
    seg = tl.load(blk_seg_ptr + b)
    start = tl.load(blk_start_ptr + b)
    end = tl.load(blk_end_ptr + b)
    seg_start = tl.load(seg_start_ptr + seg)
    stride = tl.load(seg_stride_ptr + seg)
    t = seg // 4
    i = start + tl.arange(0, BLOCK)
    m = i < end
    v = tl.load(x_ptr + i, mask=m, other=0).to(tl.int64) & MASK
    top = v >> RAW_BITS
    sym = ((top & 0xFF) << 1) | (top >> 8)
    has = m & (stride > 0) & (i - seg_start >= stride)
    prev = tl.load(x_ptr + i - stride, mask=has, other=0)
    ctx = tl.load(ctx_ptr + t * 512 + _top_of(prev, MASK, RAW_BITS), mask=has, other=0)
    cell = (t * 16 + ctx) * 512 + sym
    return v, cell, m, seg


@triton.jit
def _count_symbols_kernel(
    x_ptr,
    ctx_ptr,
    blk_seg_ptr,
    blk_start_ptr,
    blk_end_ptr,
    seg_start_ptr,
    seg_stride_ptr,
    counts_ptr,
    MASK: tl.constexpr,
    RAW_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    _, cell, m, _ = _cells(
        x_ptr, ctx_ptr, blk_seg_ptr, blk_start_ptr, blk_end_ptr, seg_start_ptr, seg_stride_ptr, MASK, RAW_BITS, BLOCK
    )
    tl.atomic_add(counts_ptr + cell, tl.full([BLOCK], 1, tl.int32), mask=m)


@triton.jit
def _block_bits_kernel(
    x_ptr,
    ctx_ptr,
    blk_seg_ptr,
    blk_start_ptr,
    blk_end_ptr,
    seg_start_ptr,
    seg_stride_ptr,
    len_ptr,
    blk_bits_ptr,
    MASK: tl.constexpr,
    RAW_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    _, cell, m, _ = _cells(
        x_ptr, ctx_ptr, blk_seg_ptr, blk_start_ptr, blk_end_ptr, seg_start_ptr, seg_stride_ptr, MASK, RAW_BITS, BLOCK
    )
    length = tl.load(len_ptr + cell, mask=m, other=0).to(tl.int64)
    nbits = tl.where(m, length + RAW_BITS, 0)
    tl.store(blk_bits_ptr + tl.program_id(0), tl.sum(nbits, 0))


@triton.jit
def _pack_kernel(
    x_ptr,
    ctx_ptr,
    blk_seg_ptr,
    blk_start_ptr,
    blk_end_ptr,
    seg_start_ptr,
    seg_stride_ptr,
    len_ptr,
    code_ptr,
    blk_before_ptr,
    seg_first_blk_ptr,
    seg_base_ptr,
    words_ptr,
    MASK: tl.constexpr,
    RAW_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    v, cell, m, seg = _cells(
        x_ptr, ctx_ptr, blk_seg_ptr, blk_start_ptr, blk_end_ptr, seg_start_ptr, seg_stride_ptr, MASK, RAW_BITS, BLOCK
    )
    seg_base = tl.load(seg_base_ptr + seg)  # the stream's byte in the output; -1: not written
    m = m & (seg_base >= 0)
    length = tl.load(len_ptr + cell, mask=m, other=0).to(tl.int64)
    code = tl.load(code_ptr + cell, mask=m, other=0).to(tl.int64) & 0xFFFF
    value = code | ((v & ((1 << RAW_BITS) - 1)) << length)
    nbits = tl.where(m, length + RAW_BITS, 0)
    # The block's first bit in its stream: the bits of the stream's blocks before it.
    first = tl.load(blk_before_ptr + tl.program_id(0)) - tl.load(blk_before_ptr + tl.load(seg_first_blk_ptr + seg))
    offset = 8 * seg_base + first + tl.cumsum(nbits, 0) - nbits
    word = offset >> 5
    shift = offset & 31
    # value < 2^34: its bits from `shift` on span at most 3 words; (value << shift) may pass
    # 64 bits, but its low 32 bits are right, and what goes above them is value >> (32 - shift).
    w0 = (value << shift) & 0xFFFFFFFF
    rest = value >> (32 - shift)
    w1 = rest & 0xFFFFFFFF
    w2 = rest >> 32
    tl.atomic_or(words_ptr + word, w0.to(tl.int32), mask=m & (w0 != 0))
    tl.atomic_or(words_ptr + word + 1, w1.to(tl.int32), mask=m & (w1 != 0))
    tl.atomic_or(words_ptr + word + 2, w2.to(tl.int32), mask=m & (w2 != 0))


def _consts(width: int, raw_bits: int) -> dict:
    return {"MASK": (1 << (8 * width)) - 1, "RAW_BITS": raw_bits}


class Blocks:
    """The cut of the flat array into blocks of ``block`` elements within segments (host arrays
    and their copies on the device, made by ``upload``)."""

    def __init__(self, seg_start: np.ndarray, total: int, block: int, upload):
        seg_end = np.append(seg_start[1:], total)
        per_seg = -(-(seg_end - seg_start) // block)
        self.first = np.concatenate([[0], np.cumsum(per_seg)[:-1]]).astype(np.int64)
        self.count = int(per_seg.sum())
        seg = np.repeat(np.arange(len(seg_start), dtype=np.int64), per_seg)
        start = seg_start[seg] + (np.arange(self.count, dtype=np.int64) - self.first[seg]) * block
        end = np.minimum(start + block, seg_end[seg])
        self.seg_t, self.start_t, self.end_t, self.first_t = (
            upload(a.astype(np.int64)) for a in (seg, start, end, self.first)
        )
        self.last = self.first + per_seg  # one past each segment's last block


def sample_contexts(x, base_t, n_t, step_t, count: int, width: int, raw_bits: int, exp_shift: int):
    """Kernel 1: each tensor's mode (int32 ``[count]``) and context of each top (``[count * 512]``)."""
    mode = torch.empty(count, dtype=torch.int32, device=x.device)
    ctx = torch.empty(count * SYMBOLS, dtype=torch.int32, device=x.device)
    _sample_contexts_kernel[(count,)](
        x, base_t, n_t, step_t, mode, ctx, EXP_SHIFT=exp_shift, SAMPLE_BLOCK=SAMPLE_BLOCK, **_consts(width, raw_bits)
    )
    return mode, ctx


def _element_args(x, ctx, blocks: Blocks, seg_start_t, seg_stride_t):
    return (x, ctx, blocks.seg_t, blocks.start_t, blocks.end_t, seg_start_t, seg_stride_t)


def count_symbols(x, ctx, blocks: Blocks, seg_start_t, seg_stride_t, count: int, width: int, raw_bits: int, block: int):
    """Kernel 2: the counts (int32) of each (tensor, context, symbol) cell."""
    counts = torch.zeros(count * CONTEXTS * SYMBOLS, dtype=torch.int32, device=x.device)
    _count_symbols_kernel[(blocks.count,)](
        *_element_args(x, ctx, blocks, seg_start_t, seg_stride_t), counts, BLOCK=block, **_consts(width, raw_bits)
    )
    return counts


def block_bits(x, ctx, blocks: Blocks, seg_start_t, seg_stride_t, lengths_t, width: int, raw_bits: int, block: int):
    """Kernel 3 and a running sum: the bits before each block in the flat order (int64
    ``[blocks + 1]``, the last the total)."""
    bits = torch.empty(blocks.count, dtype=torch.int64, device=x.device)
    _block_bits_kernel[(blocks.count,)](
        *_element_args(x, ctx, blocks, seg_start_t, seg_stride_t),
        lengths_t,
        bits,
        BLOCK=block,
        **_consts(width, raw_bits),
    )
    before = torch.zeros(blocks.count + 1, dtype=torch.int64, device=x.device)
    torch.cumsum(bits, 0, out=before[1:])
    return before


def pack(
    x,
    ctx,
    blocks: Blocks,
    seg_start_t,
    seg_stride_t,
    lengths_t,
    codes_t,
    before,
    seg_base_t,
    n_bytes: int,
    width: int,
    raw_bits: int,
    block: int,
):
    """Kernel 4: the output's bytes (uint8, ``n_bytes``), each stream's bits at its place, 0
    elsewhere."""
    words = torch.zeros(-(-n_bytes // 4) + 2, dtype=torch.int32, device=x.device)
    _pack_kernel[(blocks.count,)](
        *_element_args(x, ctx, blocks, seg_start_t, seg_stride_t),
        lengths_t,
        codes_t,
        before,
        blocks.first_t,
        seg_base_t,
        words,
        BLOCK=block,
        **_consts(width, raw_bits),
    )
    return words.view(torch.uint8)[:n_bytes]
