"""The encoder of codec ``exp-huf`` for the reference writer (``layertap._py.write``; docs/FORMAT.md, "Codec 3"), in
numpy: contexts, symbol counts and bit packing are whole-array operations. It makes the same
choices as the Rust encoder, though its codes may differ where Huffman trees tie: blocks coded
by column (mode 2; columns = the tensor's last dimension, or its element count for a
1-dimensional tensor; one stream per 8,192 elements, 1 to the number of columns), 16 contexts
(8 exponent buckets around the most common exponent, times the sign). ``by="element"`` gives
the blocks coded by element (mode 1; 4 streams, stride = the last dimension) that the Rust
encoder writes when asked (``_native.exphuf_encode(raw, by="element")``) and the GPU encoder
writes.
"""

from __future__ import annotations

import heapq
import struct

import numpy as np

from layertap._spec.blob import parse_header
from layertap._spec.exphuf import (
    CODED,
    MAX_CODE_LEN,
    MAX_CONTEXTS,
    MODE_CODED,
    MODE_COLUMNS,
    MODE_RAW,
    SYMBOLS,
    reversed_codes,
    segment,
    stream_columns,
    symbol_of_top,
    top_of_symbol,
)

#: Streams of a block coded by element.
STREAMS = 4
#: Elements per stream of a block coded by column, about (the Rust encoder's
#: ``ELEMENTS_PER_STREAM``): its streams are ``n // 8192`` rounded down to a multiple of 4,
#: clamped to ``min(4, columns)`` to the columns (a CPU decodes streams 4 side by side).
ELEMENTS_PER_STREAM = 8192
#: Tensors of fewer elements are stored raw.
MIN_CODED = 64


def code_lengths(counts) -> list[int]:
    """Huffman code lengths of at most MAX_CODE_LEN bits (0: absent); counts are halved until
    the code fits. A lone symbol gets 1 bit."""
    weights = [(int(c), s) for s, c in enumerate(counts) if c]
    lengths = [0] * len(counts)
    if len(weights) == 1:
        lengths[weights[0][1]] = 1
    while len(weights) > 1:
        heap = [(w, i, [s]) for i, (w, s) in enumerate(weights)]
        heapq.heapify(heap)
        depth = dict.fromkeys((s for _, s in weights), 0)
        tick = len(heap)
        while len(heap) > 1:
            a, b = heapq.heappop(heap), heapq.heappop(heap)
            for s in a[2] + b[2]:
                depth[s] += 1
            heapq.heappush(heap, (a[0] + b[0], tick, a[2] + b[2]))
            tick += 1
        if max(depth.values()) <= MAX_CODE_LEN:
            for s, d in depth.items():
                lengths[s] = d
            break
        weights = [((w + 1) // 2, s) for w, s in weights]
    return lengths


def _pack_bits(values: np.ndarray, nbits: np.ndarray) -> bytes:
    """Concatenates the low ``nbits[i]`` bits of each ``values[i]``, least significant first."""
    if values.size == 0:
        return b""
    ends = np.cumsum(nbits, dtype=np.int64)
    starts = ends - nbits
    bits = np.zeros(int(ends[-1]), dtype=np.uint8)
    for b in range(int(nbits.max())):
        sel = nbits > b
        bits[starts[sel] + b] = (values[sel] >> np.uint64(b)) & np.uint64(1)
    return np.packbits(bits, bitorder="little").tobytes()


def _context_map(top: np.ndarray, exp_shift: int) -> np.ndarray:
    """The context of each top-9-bit value for the elements whose tops are ``top``: exponent
    bucket around the sample's most common exponent, and sign."""
    sample = (top[:: max(top.size // 4096, 1)] & 0xFF) >> exp_shift
    return contexts_of_top(int(np.bincount(sample, minlength=256).argmax()), exp_shift)


def _codes(ctx: np.ndarray, sym: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Code lengths and reversed codes (``[context, symbol]``) for symbols ``sym`` coded in
    contexts ``ctx``."""
    hist = np.bincount(ctx * SYMBOLS + sym, minlength=MAX_CONTEXTS * SYMBOLS).reshape(MAX_CONTEXTS, SYMBOLS)
    lengths = np.array([code_lengths(h) for h in hist], dtype=np.int64)
    codes = np.array([reversed_codes(list(ln)) for ln in lengths], dtype=np.uint64)
    return lengths, codes


def encode_block(data, shape: tuple[int, ...], dtype: str, by: str = "column", streams: int | None = None) -> bytes:
    """The block of a tensor's bytes ``data`` (mode byte included): coded ``by`` column (mode
    2) or element (mode 1), or raw where coding would not make it smaller. ``streams`` (mode 2
    only, 1 to the columns) replaces the writer's choice: the test vectors use it for small
    blocks of several streams."""
    width, exp_shift = CODED[dtype]
    x = np.frombuffer(data, "<u2" if width == 2 else "<u4").astype(np.uint64)
    raw = bytes([MODE_RAW]) + bytes(data)
    if x.size < MIN_CODED:
        return raw
    if by == "column":
        out = _encode_by_column(x, shape, exp_shift, 8 * width - 9, streams)
    elif by == "element" and streams is None:
        out = _encode_by_element(x, shape, exp_shift, 8 * width - 9)
    else:
        raise ValueError(f"by={by!r}, streams={streams!r}: by is 'column' or 'element', streams for 'column' only")
    return bytes(out) if len(out) < len(raw) else raw


def _encode_by_element(x: np.ndarray, shape: tuple[int, ...], exp_shift: int, raw_bits: int) -> bytearray:
    """Mode 1: each element's code (context: the element ``stride`` back in its segment) and
    raw bits, in element order, in ``STREAMS`` segments."""
    n = x.size
    top = (x >> np.uint64(raw_bits)).astype(np.int64)
    stride = shape[-1] if len(shape) >= 2 and shape[-1] < n else 0
    ctx_of_top = _context_map(top, exp_shift)
    ctx = np.zeros(n, dtype=np.int64)
    if stride:
        for k in range(STREAMS):
            seg = segment(n, STREAMS, k)
            if seg.stop - seg.start > stride:
                ctx[seg.start + stride : seg.stop] = ctx_of_top[top[seg.start : seg.stop - stride]]
    sym = symbol_of_top(top)
    lengths, codes = _codes(ctx, sym)
    length = lengths[ctx, sym]
    values = codes[ctx, sym] | (x & np.uint64((1 << raw_bits) - 1)) << length.astype(np.uint64)
    streams = [_pack_bits(values[seg.start : seg.stop], (length + raw_bits)[seg.start : seg.stop])
               for seg in (segment(n, STREAMS, k) for k in range(STREAMS))]  # fmt: skip
    out = block_head(stride, ctx_of_top, lengths, [len(s) for s in streams])
    for s in streams:
        out += s
    return out


def _encode_by_column(
    x: np.ndarray, shape: tuple[int, ...], exp_shift: int, raw_bits: int, streams: int | None
) -> bytearray:
    """Mode 2: the tops' codes in streams of whole columns (context: the element before in the
    stream), then the raw bits in a plane of their own, in element order."""
    n = x.size
    columns = shape[-1] if len(shape) >= 2 and shape[-1] and n % shape[-1] == 0 else n
    rows = n // columns
    if streams is None:
        streams = min(max(n // ELEMENTS_PER_STREAM // 4 * 4, min(4, columns)), columns)
    if not 1 <= streams <= columns:
        raise ValueError(f"{streams} streams for {columns} columns (1 to {columns} allowed)")
    top = (x >> np.uint64(raw_bits)).astype(np.int64)
    ctx_of_top = _context_map(top, exp_shift)
    # Stream order is column order: by_column[c * rows + r] is row r of column c.
    by_column = top.reshape(rows, columns).T.reshape(-1)
    ctx = np.zeros(n, dtype=np.int64)
    cuts = [range(cols.start * rows, cols.stop * rows) for cols in (stream_columns(columns, streams, k) for k in range(streams))]  # fmt: skip
    for run in cuts:
        ctx[run.start + 1 : run.stop] = ctx_of_top[by_column[run.start : run.stop - 1]]
    sym = symbol_of_top(by_column)
    lengths, codes = _codes(ctx, sym)
    length, code = lengths[ctx, sym], codes[ctx, sym]
    coded = [_pack_bits(code[run.start : run.stop], length[run.start : run.stop]) for run in cuts]

    out = bytearray([MODE_COLUMNS])
    out += struct.pack("<B3xII", MAX_CONTEXTS, columns, streams)
    out += _tables(ctx_of_top, lengths)
    out += struct.pack(f"<{streams}Q", *(len(s) for s in coded))
    out += _pack_bits(x & np.uint64((1 << raw_bits) - 1), np.full(n, raw_bits, dtype=np.int64))
    for s in coded:
        out += s
    return out


def contexts_of_top(mode: int, exp_shift: int) -> np.ndarray:
    """The context of each top-9-bit value: its exponent's bucket around ``mode`` (the sample's
    most common exponent), clamped to -4..3, and its sign."""
    t = np.arange(SYMBOLS)
    return (t >> 8) * 8 | (np.clip(((t & 0xFF) >> exp_shift) - mode, -4, 3) & 7)


def block_head(stride: int, ctx_of_top, lengths, stream_lens) -> bytearray:
    """A coded block up to its streams: mode byte, fixed fields, context map, code-length
    tables and the streams' byte lengths (shared with the torch encoder, ``layertap.gpu``)."""
    out = bytearray([MODE_CODED])
    out += struct.pack("<BBHI", MAX_CONTEXTS, len(stream_lens), 0, stride)
    out += _tables(ctx_of_top, lengths)
    out += struct.pack(f"<{len(stream_lens)}Q", *stream_lens)
    return out


def _tables(ctx_of_top, lengths) -> bytearray:
    """The context map and the code-length tables, as both coded modes write them."""
    cmap = np.asarray(ctx_of_top)[top_of_symbol(np.arange(SYMBOLS))]
    out = bytearray((cmap[0::2] | cmap[1::2] << 4).astype(np.uint8))
    for ln in lengths:
        ln = np.asarray(ln)
        used = np.flatnonzero(ln)
        first, count = (int(used[0]), int(used[-1]) - int(used[0]) + 1) if used.size else (0, 0)
        nib = [int(v) for v in ln[first : first + count]] + [0] * (count % 2)
        out += struct.pack("<HH", first, count) + bytes(a | b << 4 for a, b in zip(nib[0::2], nib[1::2]))
    return out


def encode(raw, by: str = "column", streams: int | None = None) -> bytes:
    """The ``exp-huf`` payload of the blob ``raw``, its blocks coded ``by`` column (what the
    writers write) or element (see ``encode_block``, which also says what ``streams`` does)."""
    raw = memoryview(raw).cast("B")
    _, tensors, data_start = parse_header(raw)
    out = bytearray(raw[:data_start])
    for t in tensors:
        data = raw[t.begin : t.end]
        out += encode_block(data, t.shape, t.dtype, by, streams) if t.dtype in CODED else data
    return bytes(out)
