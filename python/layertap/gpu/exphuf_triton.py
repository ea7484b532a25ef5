"""The device work of the exp-huf encoder (``layertap.gpu.exphuf``) as Triton kernels: four
launches a pass where the torch operations take about ninety, the host part unchanged, so the
bytes are the same (tests/test_triton_exphuf_encoder.py checks them in Triton's interpreter).

The coded tensors' elements lie back to back in one flat array; each tensor's STREAMS segments
are cut into blocks of ``BLOCK`` elements that never straddle two segments (cut on the host from
the sizes alone: nothing is read back to cut them). Per pass, ``_sample_contexts_kernel`` (a program
a tensor) gives each tensor's mode (the last of tied counts, as the Rust encoder) and contexts;
``_count_symbols_kernel`` (a program a block) counts the (tensor, context, symbol) cells with
atomics, and the host reads the counts once and sends the tables back; ``_block_bits_kernel``
gives each block's bits, whose running sum (the second and last read) sets the layout; and
``_pack_kernel`` or-s each value into 32-bit words with ``tl.atomic_or`` (two streams never share
a byte: each starts on one).

With ``tables="device"`` the host builds no table and never reads the counts: between kernels 2
and 3, ``tables`` sorts each table's counts, builds its Huffman code lengths exactly as the Rust
core does (one table a lane, the two-queue build in lockstep, the same bisection where a code
passes 11 bits) and its reversed canonical codes; the one read brings the streams' bits, the
code lengths and the modes. The host's tables cost it about 7 us each, 1,024 for a batch of 64
records: most of its CPU time a batch.

Kernels 2 to 4 recompute each element's symbol and context from its bytes and those of the
element ``stride`` before it rather than storing them: a read of the input costs less than a
write then a read of an intermediate. Atomics for the counts and the packing are the simplest
bit-exact form; ``benches/gpu/bench_gpu_exphuf.py --impl`` measures what they cost.

This module imports triton: it is imported only for ``impl="triton"``, never by vLLM's CPU build.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import triton
import triton.language as tl

from layertap.gpu.device_copies import to_device

#: Streams per tensor, and the symbols and contexts of a table (docs/FORMAT.md, codec 3).
STREAMS = 4
SYMBOLS = 512
CONTEXTS = 16

#: Elements a program of kernels 2 to 4 takes: a power of two.
BLOCK = 1024
#: How kernel 2 adds its counts: "atomic" (an atomic add an element) or "histogram" (a block's
#: counts per context with ``tl.histogram``, then an atomic add a cell seen).
COUNTS = "atomic"
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
    seg_first_ptr,
    seg_start_ptr,
    seg_end_ptr,
    seg_stride_ptr,
    MASK: tl.constexpr,
    RAW_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Block ``program_id``'s elements' bits and cells (tensor, context, symbol), its mask, its segment."""
    b = tl.program_id(0)
    seg = tl.load(blk_seg_ptr + b)
    seg_start = tl.load(seg_start_ptr + seg)
    start = seg_start + (b - tl.load(seg_first_ptr + seg)) * BLOCK
    end = tl.minimum(start + BLOCK, tl.load(seg_end_ptr + seg))
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
    seg_first_ptr,
    seg_start_ptr,
    seg_end_ptr,
    seg_stride_ptr,
    counts_ptr,
    MASK: tl.constexpr,
    RAW_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    HISTOGRAM: tl.constexpr,
):
    _, cell, m, seg = _cells(
        x_ptr, ctx_ptr, blk_seg_ptr, seg_first_ptr, seg_start_ptr, seg_end_ptr, seg_stride_ptr, MASK, RAW_BITS, BLOCK
    )
    if HISTOGRAM:
        # The block's counts per context first (tl.histogram), then one atomic a cell seen:
        # most elements of a tensor fall in a few cells, whose atomics would queue.
        base = (seg // 4) * (16 * 512)
        local = cell - base
        sym = (local & 511).to(tl.int32)
        bins = tl.arange(0, 512)
        for c in tl.static_range(16):
            mc = m & ((local >> 9) == c)
            if tl.max(mc.to(tl.int32), 0) > 0:
                h = tl.histogram(sym, 512, mask=mc)
                tl.atomic_add(counts_ptr + base + c * 512 + bins, h, mask=h > 0)
    else:
        tl.atomic_add(counts_ptr + cell, tl.full([BLOCK], 1, tl.int32), mask=m)


@triton.jit
def _block_bits_kernel(
    x_ptr,
    ctx_ptr,
    blk_seg_ptr,
    seg_first_ptr,
    seg_start_ptr,
    seg_end_ptr,
    seg_stride_ptr,
    len_ptr,
    blk_bits_ptr,
    MASK: tl.constexpr,
    RAW_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    _, cell, m, _ = _cells(
        x_ptr, ctx_ptr, blk_seg_ptr, seg_first_ptr, seg_start_ptr, seg_end_ptr, seg_stride_ptr, MASK, RAW_BITS, BLOCK
    )
    length = tl.load(len_ptr + cell, mask=m, other=0).to(tl.int64)
    nbits = tl.where(m, length + RAW_BITS, 0)
    tl.store(blk_bits_ptr + tl.program_id(0), tl.sum(nbits, 0))


@triton.jit
def _pack_kernel(
    x_ptr,
    ctx_ptr,
    blk_seg_ptr,
    seg_first_ptr,
    seg_start_ptr,
    seg_end_ptr,
    seg_stride_ptr,
    len_ptr,
    code_ptr,
    blk_before_ptr,
    seg_base_ptr,
    words_ptr,
    MASK: tl.constexpr,
    RAW_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    v, cell, m, seg = _cells(
        x_ptr, ctx_ptr, blk_seg_ptr, seg_first_ptr, seg_start_ptr, seg_end_ptr, seg_stride_ptr, MASK, RAW_BITS, BLOCK
    )
    seg_base = tl.load(seg_base_ptr + seg)  # the stream's byte in the output; -1: not written
    m = m & (seg_base >= 0)
    length = tl.load(len_ptr + cell, mask=m, other=0).to(tl.int64)
    code = tl.load(code_ptr + cell, mask=m, other=0).to(tl.int64) & 0xFFFF
    value = code | ((v & ((1 << RAW_BITS) - 1)) << length)
    nbits = tl.where(m, length + RAW_BITS, 0)
    # The block's first bit in its stream: the bits of the stream's blocks before it.
    first = tl.load(blk_before_ptr + tl.program_id(0)) - tl.load(blk_before_ptr + tl.load(seg_first_ptr + seg))
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


def _on(device: torch.device):
    """Triton launches on the current CUDA device, which need not be the tensors'."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class TritonPass:
    """One pass's device work in the four kernels (``layertap.gpu.exphuf``'s ``_TorchPass``'s)."""

    def __init__(self, x: torch.Tensor, layout, width: int, exp_shift: int, device: torch.device):
        self.layout, self.exp_shift, self.device = layout, exp_shift, device
        self.x = x.view(torch.int16 if width == 2 else torch.int32)
        self.consts = {"MASK": (1 << (8 * width)) - 1, "RAW_BITS": 8 * width - 9}
        self.block_consts = {**self.consts, "BLOCK": BLOCK}  # kernels 2 to 4's
        # The cut of the flat array into blocks of BLOCK elements within segments, and the
        # segments' places: one copy to the device, of which the ``*_t`` are views.
        seg_start = layout.seg_start
        seg_end = np.append(seg_start[1:], layout.total)
        per_seg = -(-(seg_end - seg_start) // BLOCK)
        last = np.cumsum(per_seg)  # one past each segment's last block
        self.n_blocks = int(last[-1])
        seg = np.repeat(np.arange(len(seg_start), dtype=np.int64), per_seg)
        tab = np.concatenate([seg_start, seg_end, layout.seg_stride, last - per_seg, last, seg]).astype(np.int64)
        start_t, end_t, stride_t, self.first_t, self.last_t, seg_t = to_device(tab, device).split(
            [len(seg_start)] * 5 + [self.n_blocks]
        )
        # Each tensor's context of each top (kernel 1's output), and kernels 2 to 4's first arguments.
        self.ctx = torch.empty(len(layout.ns) * SYMBOLS, dtype=torch.int32, device=device)
        self.elements = (self.x, self.ctx, seg_t, self.first_t, start_t, end_t, stride_t)

    def counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Kernels 1 and 2: the counts (int32) of each (tensor, context, symbol) cell, and the modes."""
        layout, count, device = self.layout, len(self.layout.ns), self.device
        per_tensor = to_device(np.concatenate([layout.base, layout.ns, layout.step]).astype(np.int64), device)
        mode = torch.empty(count, dtype=torch.int32, device=device)
        counts = torch.zeros(count * CONTEXTS * SYMBOLS, dtype=torch.int32, device=device)
        sample = (self.x, *per_tensor.view(3, count), mode, self.ctx)  # base, n, step of each tensor
        with _on(device):
            _sample_contexts_kernel[(count,)](
                *sample, EXP_SHIFT=self.exp_shift, SAMPLE_BLOCK=SAMPLE_BLOCK, **self.consts
            )
            _count_symbols_kernel[(self.n_blocks,)](
                *self.elements, counts, HISTOGRAM=COUNTS == "histogram", **self.block_consts
            )
        return counts, mode

    def stream_bits(self, lengths: np.ndarray, codes: np.ndarray) -> torch.Tensor:
        """Each stream's length in bits (int64, on the device), from the code tables."""
        self.lengths_t = to_device(np.ascontiguousarray(lengths).reshape(-1), self.device)
        self.codes_t = to_device(np.ascontiguousarray(codes).reshape(-1).view(np.int16), self.device)
        return self._stream_bits()

    def stream_bits_device_tables(self, counts: torch.Tensor) -> torch.Tensor:
        """``stream_bits`` with the tables built on the device from ``counts``."""
        self.lengths_t, self.codes_t = tables(counts)
        return self._stream_bits()

    def _stream_bits(self) -> torch.Tensor:
        # Kernel 3, then the bits before each block in the flat order (the last the total).
        bits = torch.empty(self.n_blocks, dtype=torch.int64, device=self.device)
        with _on(self.device):
            _block_bits_kernel[(self.n_blocks,)](*self.elements, self.lengths_t, bits, **self.block_consts)
        self.before = torch.zeros(self.n_blocks + 1, dtype=torch.int64, device=self.device)
        torch.cumsum(bits, 0, out=self.before[1:])
        return self.before[self.last_t] - self.before[self.first_t]

    def pack(self, seg_base: np.ndarray, end: int) -> torch.Tensor:
        """Kernel 4: the output's first ``end`` bytes, each stream at ``seg_base`` (-1: not written)."""
        words = torch.zeros(-(-end // 4) + 2, dtype=torch.int32, device=self.device)
        args = (*self.elements, self.lengths_t, self.codes_t, self.before, to_device(seg_base, self.device), words)
        with _on(self.device):
            _pack_kernel[(self.n_blocks,)](*args, **self.block_consts)
        return words.view(torch.uint8)[:end]


#: Tables a program of the code-length kernel builds, one a lane of its one warp (what a lane
#: reads of its tree was written by the same thread, and a barrier follows every step).
TABLES_PER_PROGRAM = 32
#: Leaves a step of that kernel loads at a time (the registers of one warp).
_LEAF_CHUNK = 64
#: Scratch entries a table's Huffman tree takes: 2 * 512 - 1 nodes, rounded up.
_NODES = 1024
_BIG = tl.constexpr(1 << 62)


@triton.jit
def _sort_counts_kernel(counts_ptr, sorted_ptr, n_ptr, RC: tl.constexpr):
    """One table's symbols with a count, by count then symbol (``count << 9 | symbol``; the
    absent after them), and how many have a count. Each (distinct) key goes to its rank, ``RC``
    keys at a time against all 512: cheaper than ``tl.sort``, and as cheap in the interpreter."""
    t = tl.program_id(0).to(tl.int64)
    sym = tl.arange(0, 512)
    c = tl.load(counts_ptr + t * 512 + sym).to(tl.int64)
    key = tl.where(c > 0, (c << 9) | sym, sym.to(tl.int64) + _BIG)
    tl.store(n_ptr + t, tl.sum((c > 0).to(tl.int64), 0))
    for ch in tl.static_range(512 // RC):
        rows = ch * RC + tl.arange(0, RC)
        cr = tl.load(counts_ptr + t * 512 + rows).to(tl.int64)
        kr = tl.where(cr > 0, (cr << 9) | rows, rows.to(tl.int64) + _BIG)
        rank = tl.sum((key[None, :] < kr[:, None]).to(tl.int32), 1)
        tl.store(sorted_ptr + t * 512 + rank, kr)


@triton.jit
def _huffman_build(sorted_ptr, lane, n, h, live, w_ptr, p_ptr, d_ptr, maxn, TB: tl.constexpr, CH: tl.constexpr):
    """The depths of the leaves of the Huffman tree of each lane's sorted counts divided by
    ``2^h`` rounding up, built as the Rust core builds it (two queues; on equal weights the leaf
    first), in ``d_ptr``'s rows; returns each lane's deepest leaf. Its loops over the leaves are
    runtime loops, ``CH`` leaves a step: unrolled over all 512 they took 18 s to compile, not 4."""
    base = lane * 1024
    for c0 in range(0, maxn, CH):
        idx = c0 + tl.arange(0, CH)[None, :]
        m = live[:, None] & (idx < n[:, None])
        cnt = tl.load(sorted_ptr + lane[:, None] * 512 + idx, mask=m, other=0) >> 9
        tl.store(
            w_ptr + base[:, None] + idx, (cnt + (tl.full([TB], 1, tl.int64) << h)[:, None] - 1) >> h[:, None], mask=m
        )
    tl.debug_barrier()
    leaf = tl.zeros([TB], dtype=tl.int64)
    merged = n
    for it in range(0, maxn - 1):
        nxt = n + it
        act = live & (it < n - 1)
        # The first of the two nodes to merge.
        wl = tl.load(w_ptr + base + leaf, mask=act & (leaf < n), other=0)
        wm = tl.load(w_ptr + base + merged, mask=act & (merged < nxt), other=0)
        ta = (leaf < n) & ((merged >= nxt) | (wl <= wm))
        a = tl.where(ta, leaf, merged)
        wa = tl.where(ta, wl, wm)
        leaf = tl.where(act & ta, leaf + 1, leaf)
        merged = tl.where(act & ~ta, merged + 1, merged)
        # The second.
        wl = tl.load(w_ptr + base + leaf, mask=act & (leaf < n), other=0)
        wm = tl.load(w_ptr + base + merged, mask=act & (merged < nxt), other=0)
        tb = (leaf < n) & ((merged >= nxt) | (wl <= wm))
        b = tl.where(tb, leaf, merged)
        wb = tl.where(tb, wl, wm)
        leaf = tl.where(act & tb, leaf + 1, leaf)
        merged = tl.where(act & ~tb, merged + 1, merged)
        tl.store(w_ptr + base + nxt, wa + wb, mask=act)
        tl.store(p_ptr + base + a, nxt, mask=act)
        tl.store(p_ptr + base + b, nxt, mask=act)
        tl.debug_barrier()
    # Depths from the root (node 2n - 2) down: a parent always comes after its children.
    root = 2 * n - 2
    tl.store(d_ptr + base + root, tl.zeros([TB], dtype=tl.int64), mask=live & (n >= 2))
    tl.store(d_ptr + base, tl.full([TB], 1, tl.int64), mask=live & (n == 1))  # a lone symbol: 1 bit
    tl.debug_barrier()
    for j in range(0, 2 * maxn - 2):
        i = root - 1 - j
        act = live & (i >= 0)
        p = tl.load(p_ptr + base + i, mask=act, other=0)
        dp = tl.load(d_ptr + base + p, mask=act, other=0)
        tl.store(d_ptr + base + i, dp + 1, mask=act)
        tl.debug_barrier()
    deepest = tl.zeros([TB], dtype=tl.int64)
    for c0 in range(0, maxn, CH):
        idx = c0 + tl.arange(0, CH)[None, :]
        d = tl.load(d_ptr + base[:, None] + idx, mask=live[:, None] & (idx < n[:, None]), other=0)
        deepest = tl.maximum(deepest, tl.max(d, 1))
    return deepest


@triton.jit
def _code_lengths_kernel(
    sorted_ptr, n_ptr, n_tables, w_ptr, p_ptr, d_ptr, lengths_ptr, TB: tl.constexpr, CH: tl.constexpr
):
    """Code lengths of TB tables, one a lane, as the Rust core's ``huffman::code_lengths`` makes
    them: the Huffman code of the counts, or where a code would pass 11 bits, of the counts
    divided by the ``2^h`` found by the same bisection. Step 0 builds every table at ``h = 0``,
    steps 1 to 7 bisect those that did not fit (counts of at most 31 bits need 5), the last
    builds again at the ``h`` found those whose last build was at another h.

    Why one runtime loop with ``_huffman_build`` inlined once: inlined nine times, the kernel came
    to 9.5 M characters of PTX and 6 minutes to compile for sm_90, so the H100's calls that built
    tables on the device ran out of time before their first launch; as one loop it takes 4 s
    (tests/triton_kernels/check_exphuf_encoder.py's PTX_LIMIT)."""
    lane = tl.program_id(0).to(tl.int64) * TB + tl.arange(0, TB)
    live = lane < n_tables
    n = tl.load(n_ptr + lane, mask=live, other=0)
    maxn = tl.max(n, 0)
    # Bisection between 0 and the bit length of the largest count, as the Rust core.
    top = tl.load(sorted_ptr + lane * 512 + n - 1, mask=live & (n > 0), other=0) >> 9
    hi = tl.zeros([TB], dtype=tl.int64)
    for bit in tl.static_range(40):
        hi = tl.where((top >> bit) > 0, bit + 1, hi)
    lo = tl.zeros([TB], dtype=tl.int64)
    fit0 = tl.zeros([TB], dtype=tl.int1)
    last = tl.full([TB], -1, tl.int64)  # the h of each table's last build
    for step in range(0, 9):
        bisect = (step > 0) & (step < 8)
        # The tables this step builds, and with which h.
        act = tl.where(step == 0, live, live & ~fit0 & (((step == 8) & (last != hi)) | (bisect & (hi - lo > 1))))
        h = tl.where(step == 0, 0, tl.where(bisect, (lo + hi) // 2, hi))
        most = tl.max(tl.where(act, n, 0), 0)  # the steps of the build: the most leaves it takes
        if most > 0:
            fits = _huffman_build(sorted_ptr, lane, n, h, act, w_ptr, p_ptr, d_ptr, most, TB, CH) <= 11
            fit0 = tl.where(step == 0, fits, fit0)
            hi = tl.where(bisect & act & fits, h, hi)
            lo = tl.where(bisect & act & ~fits, h, lo)
            last = tl.where(act, h, last)
    for c0 in range(0, maxn, CH):
        idx = c0 + tl.arange(0, CH)[None, :]
        m = live[:, None] & (idx < n[:, None])
        key = tl.load(sorted_ptr + lane[:, None] * 512 + idx, mask=m, other=0)
        d = tl.load(d_ptr + lane[:, None] * 1024 + idx, mask=m, other=0)
        tl.store(lengths_ptr + lane[:, None] * 512 + (key & 511), d.to(tl.uint8), mask=m)


@triton.jit
def _reversed_codes_kernel(lengths_ptr, codes_ptr):
    """The canonical codes (RFC 1951, 3.2.2) of one table of code lengths, bit-reversed, as the
    Rust core's ``huffman::reversed_codes`` (0 for absent symbols)."""
    t = tl.program_id(0).to(tl.int64)
    sym = tl.arange(0, 512)
    ln = tl.load(lengths_ptr + t * 512 + sym).to(tl.int32)
    lens = tl.arange(0, 16)
    one_hot = (ln[:, None] == lens[None, :]).to(tl.int32)  # [512, 16]
    count = tl.where(lens == 0, 0, tl.sum(one_hot, 0))  # symbols of each length
    # The first code of each length: the sum over shorter lengths l of count[l] << (len - l).
    shift = lens[:, None] - lens[None, :]  # [len, l]
    first = tl.sum(tl.where((shift > 0) & (lens[None, :] >= 1), count[None, :] << tl.maximum(shift, 0), 0), 1)
    # Each symbol's rank among the symbols of its length, in symbol order.
    rank = tl.sum(tl.where(one_hot > 0, tl.cumsum(one_hot, 0), 0), 1) - 1
    code = tl.sum(tl.where(one_hot > 0, first[None, :], 0), 1) + rank
    rev = tl.zeros([512], dtype=tl.int32)
    for b in tl.static_range(11):
        rev = tl.where(b < ln, rev | (((code >> b) & 1) << tl.maximum(ln - 1 - b, 0)), rev)
    tl.store(codes_ptr + t * 512 + sym, tl.where(ln > 0, rev, 0).to(tl.int16))


def tables(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The code lengths (uint8) and reversed codes (int16) of each 512-symbol table of
    ``counts`` (int32), on the device: the Rust core's ``exphuf_code_lengths`` and
    ``exphuf_reversed_codes``, without the counts going to the host."""
    n_tables, device = counts.numel() // SYMBOLS, counts.device
    keys = torch.empty(n_tables * SYMBOLS, dtype=torch.int64, device=device)
    n = torch.empty(n_tables, dtype=torch.int64, device=device)
    scratch = torch.empty(3, n_tables * _NODES, dtype=torch.int64, device=device)
    lengths = torch.zeros(n_tables * SYMBOLS, dtype=torch.uint8, device=device)
    codes = torch.empty(n_tables * SYMBOLS, dtype=torch.int16, device=device)
    with _on(device):
        _sort_counts_kernel[(n_tables,)](counts, keys, n, RC=32, num_warps=8)
        _code_lengths_kernel[(-(-n_tables // TABLES_PER_PROGRAM),)](
            keys, n, n_tables, *scratch, lengths, TB=TABLES_PER_PROGRAM, CH=_LEAF_CHUNK, num_warps=1
        )
        _reversed_codes_kernel[(n_tables,)](lengths, codes)
    return lengths, codes
