"""Codec ``exp-huf`` (docs/FORMAT.md, "Codec 3"): what both implementations share (the symbol of
an element, canonical Huffman codes, the block layout) and the reference decoder.

The decoder follows the format step by step, one element at a time in Python, for the three
block modes (raw, coded by element, coded by column): it is the readable twin of
``rust/core/src/exphuf`` and checks the same things, at a few hundred thousand elements a
second. The reference encoder is ``layertap._py.exphuf``.
"""

from __future__ import annotations

import struct

import numpy as np

from layertap._spec.blob import parse_header
from layertap._spec.format import FormatProblem

#: Longest code in bits; decoders index their tables with this many bits.
MAX_CODE_LEN = 11
#: Symbols: an element's top 9 bits.
SYMBOLS = 512
MAX_CONTEXTS = 16
STREAM_COUNTS = (1, 2, 4, 8)
#: Block modes: stored as it is, coded by element (codes and raw bits in element order), coded
#: by column (codes in streams of whole columns, raw bits in a plane of their own).
MODE_RAW, MODE_CODED, MODE_COLUMNS = 0, 1, 2
#: Coded dtypes: element size in bytes, and mantissa bits among the 8 after the sign (the
#: encoder's contexts follow the exponent).
CODED: dict[str, tuple[int, int]] = {"BF16": (2, 0), "F16": (2, 3), "F32": (4, 0)}
#: No payload decodes to more than this many times its stored length.
MAX_RATIO = 2
_FIXED = struct.Struct("<BBHI")
#: Mode 2's fields after the mode byte: contexts, 3 reserved bytes, columns, streams.
_COLUMN_FIXED = struct.Struct("<B3sII")


def symbol_of_top(t):
    """The symbol of top-9-bit value(s) ``t``: the sign moves to the lowest bit."""
    return ((t & 0xFF) << 1) | (t >> 8)


def top_of_symbol(s):
    return ((s & 1) << 8) | (s >> 1)


def segment(n: int, streams: int, k: int) -> range:
    """Element range of segment ``k``."""
    return range(k * n // streams, (k + 1) * n // streams)


def stream_columns(columns: int, streams: int, k: int) -> range:
    """The columns of stream ``k`` of a mode-2 block."""
    return range(k * columns // streams, (k + 1) * columns // streams)


def check_lengths(lengths) -> None:
    kraft = 0
    for ln in lengths:
        if ln > MAX_CODE_LEN:
            raise FormatProblem(f"code length {ln} is over {MAX_CODE_LEN}")
        if ln:
            kraft += 1 << (MAX_CODE_LEN - ln)
    if kraft > 1 << MAX_CODE_LEN:
        raise FormatProblem("code lengths are over-subscribed (not a prefix code)")


def reversed_codes(lengths) -> list[int]:
    """Canonical codes (RFC 1951, 3.2.2) of ``lengths``, bit-reversed: written least significant
    bit first they send the code's first bit first. 0 for absent symbols."""
    count = [0] * (MAX_CODE_LEN + 1)
    for ln in lengths:
        count[ln] += 1
    count[0] = 0
    next_code = [0] * (MAX_CODE_LEN + 2)
    code = 0
    for ln in range(1, MAX_CODE_LEN + 1):
        code = (code + count[ln - 1]) << 1
        next_code[ln] = code
    out = [0] * len(lengths)
    for s, ln in enumerate(lengths):
        if ln:
            c = next_code[ln]
            next_code[ln] += 1
            out[s] = int(f"{c:0{ln}b}"[::-1], 2)
    return out


def _table(lengths, shift: int) -> list[int]:
    """Entry ``x`` decodes a stream whose next bits are ``x``: ``top << shift | length``, or 0
    (``shift`` at least 4, the bits of a length)."""
    table = [0] * (1 << MAX_CODE_LEN)
    for s, (ln, code) in enumerate(zip(lengths, reversed_codes(lengths))):
        if ln:
            # Every entry whose low `ln` bits are the (reversed) code.
            table[code :: 1 << ln] = [top_of_symbol(s) << shift | ln] * (len(table) >> ln)
    return table


def _lengths(src, at: int) -> tuple[list[int], int]:
    if at + 4 > len(src):
        raise FormatProblem("block is cut off")
    first, count = struct.unpack_from("<HH", src, at)
    if first + count > SYMBOLS:
        raise FormatProblem(f"code lengths of symbols {first}..{first + count} are out of range")
    packed = bytes(src[at + 4 : at + 4 + (count + 1) // 2])
    if len(packed) < (count + 1) // 2:
        raise FormatProblem("block is cut off")
    lengths = [0] * SYMBOLS
    for j in range(count):
        lengths[first + j] = (packed[j // 2] >> (4 * (j % 2))) & 15
    if count % 2 and packed[-1] >> 4:
        raise FormatProblem("code lengths' padding nibble is not zero")
    check_lengths(lengths)
    return lengths, at + 4 + len(packed)


def _context_map(src, at: int, contexts: int) -> list[int]:
    """The context of each symbol, from the map's 256 bytes at ``at``."""
    cmap = [(src[at + s // 2] >> (4 * (s % 2))) & 15 for s in range(SYMBOLS)]
    if max(cmap) >= contexts:
        raise FormatProblem(f"context map names context {max(cmap)} of {contexts}")
    return cmap


def _code_tables(src, at: int, contexts: int, shift: int) -> tuple[list[int], list[list[int]], int]:
    """The context map at ``at``, the decoding tables (see ``_table``) of the ``contexts``
    code-length tables after it, and where they end."""
    cmap = _context_map(src, at, contexts)
    at += SYMBOLS // 2
    tables = []
    for c in range(contexts):
        try:
            lengths, at = _lengths(src, at)
        except FormatProblem as e:
            raise FormatProblem(f"context {c}: {e}") from None
        tables.append(_table(lengths, shift))
    return cmap, tables, at


def _stream_sizes(src, at: int, streams: int) -> tuple[tuple[int, ...], int]:
    if at + 8 * streams > len(src):
        raise FormatProblem("block is cut off")
    return struct.unpack_from(f"<{streams}Q", src, at), at + 8 * streams


def _check_stream_end(src, at: int, size: int, used: int, k: int) -> None:
    """Stream ``k`` (``size`` bytes at ``at``) holds exactly the ``used`` bits its elements
    took, padded with zero bits."""
    if (used + 7) // 8 != size:
        raise FormatProblem(f"stream {k} holds {size} bytes but its elements take {used} bits")
    if used % 8 and src[at + size - 1] >> (used % 8):
        raise FormatProblem(f"stream {k}: padding bits are not zero")


def decode_block(src, at: int, n: int, width: int) -> tuple[np.ndarray, int]:
    """The ``n`` elements (``width`` bytes each) of the block at ``at``, as unsigned integers,
    and where the block ends."""
    udtype = np.dtype("<u2" if width == 2 else "<u4")
    if at >= len(src):
        raise FormatProblem("block is cut off")
    mode = src[at]
    at += 1
    if mode == MODE_RAW:
        if at + n * width > len(src):
            raise FormatProblem("raw block is cut off")
        return np.frombuffer(src, udtype, n, at).copy(), at + n * width
    if mode == MODE_COLUMNS:
        return _decode_columns(src, at, n, width)
    if mode != MODE_CODED:
        raise FormatProblem(f"block mode {mode} is unknown")
    if at + _FIXED.size + SYMBOLS // 2 > len(src):
        raise FormatProblem("block is cut off")
    contexts, streams, reserved, stride = _FIXED.unpack_from(src, at)
    if not 1 <= contexts <= MAX_CONTEXTS:
        raise FormatProblem(f"block has {contexts} contexts (1 to 16 allowed)")
    if streams not in STREAM_COUNTS:
        raise FormatProblem(f"block has {streams} streams (1, 2, 4 or 8 allowed)")
    if reserved:
        raise FormatProblem("block's reserved bytes are not zero")
    raw_bits = 8 * width - 9
    raw_mask = (1 << raw_bits) - 1
    cmap, tables, at = _code_tables(src, at + _FIXED.size, contexts, raw_bits)
    # The table of the context each top-9 value picks.
    table_of_top = [tables[cmap[symbol_of_top(t)]] for t in range(SYMBOLS)]
    sizes, at = _stream_sizes(src, at, streams)
    out = [0] * n
    for k, size in enumerate(sizes):
        if size > len(src) - at:
            raise FormatProblem("a stream runs past the payload")
        bit, seg = 8 * at, segment(n, streams, k)
        for j, i in enumerate(seg):
            table = tables[0] if stride == 0 or j < stride else table_of_top[out[i - stride] >> raw_bits]
            p = bit >> 3
            word = int.from_bytes(src[p : p + 8], "little") >> (bit & 7)
            e = table[word & ((1 << MAX_CODE_LEN) - 1)]
            length = e & 15
            if not length:
                raise FormatProblem("a stream holds a bit pattern that is no code")
            out[i] = (e & ~raw_mask) | ((word >> length) & raw_mask)
            bit += length + raw_bits
        _check_stream_end(src, at, size, bit - 8 * at, k)
        at += size
    return np.array(out, dtype=udtype), at


def _decode_columns(src, at: int, n: int, width: int) -> tuple[np.ndarray, int]:
    """``decode_block`` of a mode-2 block ("coded by column") whose mode byte ends at ``at``."""
    if at + _COLUMN_FIXED.size + SYMBOLS // 2 > len(src):
        raise FormatProblem("block is cut off")
    contexts, reserved, columns, streams = _COLUMN_FIXED.unpack_from(src, at)
    if not 1 <= contexts <= MAX_CONTEXTS:
        raise FormatProblem(f"block has {contexts} contexts (1 to 16 allowed)")
    if reserved != bytes(3):
        raise FormatProblem("block's reserved bytes are not zero")
    if columns == 0 or n % columns:
        raise FormatProblem(f"block of {n} elements in rows of {columns} columns")
    if not 1 <= streams <= columns:
        raise FormatProblem(f"block has {streams} streams for {columns} columns (1 to {columns} allowed)")
    cmap, tables, at = _code_tables(src, at + _COLUMN_FIXED.size, contexts, 4)
    # The context each top-9 value gives the element after it in its stream.
    ctx_of_top = [cmap[symbol_of_top(t)] for t in range(SYMBOLS)]
    sizes, at = _stream_sizes(src, at, streams)
    raw_bits = 8 * width - 9
    plane_len = (n * raw_bits + 7) // 8
    if plane_len > len(src) - at:
        raise FormatProblem("the raw plane runs past the payload")
    plane = np.frombuffer(src, np.uint8, plane_len, at)
    at += plane_len

    # The tops in stream order, which is column order: tops[c * rows + r] is row r of column c,
    # and stream k holds a run of whole columns.
    rows = n // columns
    tops = [0] * n
    for k, size in enumerate(sizes):
        if size > len(src) - at:
            raise FormatProblem("a stream runs past the payload")
        cols = stream_columns(columns, streams, k)
        bit, ctx = 8 * at, 0
        for i in range(cols.start * rows, cols.stop * rows):
            p = bit >> 3
            word = int.from_bytes(src[p : p + 3], "little") >> (bit & 7)
            e = tables[ctx][word & ((1 << MAX_CODE_LEN) - 1)]
            length = e & 15
            if not length:
                raise FormatProblem("a stream holds a bit pattern that is no code")
            tops[i] = e >> 4
            ctx = ctx_of_top[tops[i]]
            bit += length
        _check_stream_end(src, at, size, bit - 8 * at, k)
        at += size

    # The raw plane: element i's raw bits at bits [i * raw_bits, (i + 1) * raw_bits).
    used = n * raw_bits
    if used % 8 and plane[-1] >> (used % 8):
        raise FormatProblem("the raw plane's padding bits are not zero")
    bits = np.unpackbits(plane, bitorder="little")[:used].reshape(n, raw_bits).astype(np.uint64)
    raw = (bits << np.arange(raw_bits, dtype=np.uint64)).sum(axis=1, dtype=np.uint64)
    by_row = np.array(tops, dtype=np.uint64).reshape(columns, rows).T.reshape(-1)
    udtype = np.dtype("<u2" if width == 2 else "<u4")
    return (by_row << np.uint64(raw_bits) | raw).astype(udtype), at


def decode(stored, raw_len: int) -> bytearray:
    """Decodes an ``exp-huf`` payload into the blob of ``raw_len`` bytes. Raises FormatProblem."""
    src = memoryview(stored).cast("B")
    if raw_len > MAX_RATIO * len(src):
        raise FormatProblem(f"raw length {raw_len} is more than {len(src)} stored bytes can decode to")
    if len(src) < 8:
        raise FormatProblem("payload shorter than a safetensors header")
    head_len = 8 + int.from_bytes(src[:8], "little")
    if head_len > min(len(src), raw_len):
        raise FormatProblem(f"safetensors header length {head_len - 8} does not fit the payload")
    out = bytearray(raw_len)
    out[:head_len] = src[:head_len]
    _, tensors, _ = parse_header(out)
    at = head_len
    for t in tensors:
        size = t.end - t.begin
        if t.dtype in CODED:
            width = CODED[t.dtype][0]
            try:
                values, at = decode_block(src, at, size // width, width)
            except FormatProblem as e:
                raise FormatProblem(f"tensor {t.name!r}: {e}") from None
            out[t.begin : t.end] = values.tobytes()
        else:
            if at + size > len(src):
                raise FormatProblem(f"tensor {t.name!r}: payload is cut off")
            out[t.begin : t.end] = src[at : at + size]
            at += size
    if at != len(src):
        raise FormatProblem(f"{len(src) - at} bytes after the last tensor's block")
    return out
