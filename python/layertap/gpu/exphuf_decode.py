"""The decoder of codec ``exp-huf`` (docs/FORMAT.md, "Codec 3") as a Triton kernel, for trainers
(issue 32, goal 3): records' stored payloads are copied to the GPU as they are (1.5x fewer bytes
than the raw tensors) and decoded there into tensors bit for bit equal to what the writer took.

``decode_records(payloads)`` takes a batch of payloads (host buffers, or uint8 tensors already on
the device, or a ``Staging``: one host buffer, pinned, that a reader filled with them) and
returns, per record, its tensors (name -> tensor on the device).

Where the parallelism is. Each stream of a block is one sequential chain: an element's code
length says where the next one starts, and its context comes from the element ``d`` back (the
previous row), which the same stream decoded; nothing else in the format cuts a stream. So the
kernel decodes many streams in lockstep, one stream a lane (a thread): lane ``k`` loops over its
segment's elements, and the lanes of a program run for as many steps as their longest segment
(a block's streams share a program, blocks ordered by their longest segment). The writers use 4
streams a tensor, so a batch gives 4 lanes a coded tensor: 64 records of one ``[tokens, layers,
hidden]`` tensor are 256 lanes, a 2048-token record alone 4. The device's speed is lanes x
elements a lane decodes a second, and a lane's step is a chain of dependent work (a table load,
then a dozen integer operations to the next bit position), not bandwidth: the format, not the
kernel, bounds it. An estimate before measuring (benches/gpu/bench_gpu_exphuf_decode.py measures
it): the compiled loop (sm_90) is 87 instructions a step (65 without the word buffer and the
early context, whose loads then stand in the chain), so a lane takes some 100-150 cycles an
element with its tables in L1 and some 300 from L2, 50-150 ns at 2 GHz; 256 lanes (64 x
256-token records) then decode 3-10 GB/s of bf16, and the issue's 50 GB/s takes some
1,500-4,000 lanes in flight (400-1,000 records of one tensor in a batch), or a format with more
streams. Positions, counters and offsets are 32-bit in the loop (int64 costs two instructions
an operation), and 2-byte elements are read in 32-bit words.

Per step a lane: shifts the two words it holds to its next bits (at most 11 code + 23 raw bits
are used) and loads the word after them (the device copy is padded so that two words
after a stream's last one are inside the buffer) beside the table entry rather than before it;
looks its entry up (``2^11`` int16 entries a context: ``top9 << 4 | code length``, 0 where no
code starts), rebuilds ``x = top9 << raw_bits | raw`` and stores it. The next element's table,
picked by the element ``d`` back of it, is loaded a step early, off the chain: from the output
the lane wrote (``.cg``: from L2, its own earlier store, never a stale L1 line) where ``d >= 3``,
from its registers where ``d`` is 1 or 2. It checks what the Rust decoder checks, per lane, into
a status word: a pattern that is no code, a code that runs past the stream's end (so no load
ever leaves the buffer), and at the end the stream's length (``ceil(bits / 8)`` bytes) and its
zero padding. One small read of the statuses after the kernels turns any of them into a
CorruptRecordError naming the record, tensor and stream.

What Triton leaves out of reach: shared memory is not addressable from Triton (only through
``tl.dot``'s and reductions' lowering), so the tables cannot be staged there; they are read
through L1. A program is a warp of 32 lanes (``LANES``); for a small batch it decodes fewer
streams than that, down to 4 (one block's: at most 64 KiB of tables in a multiprocessor's L1),
the other lanes idle, so that 64 records spread over 64 of the H200's 132 multiprocessors rather
than 8, each with one block's tables rather than eight (``live_lanes``; a program narrower than
a warp would leave threads holding copies of a lane, reading back what another thread stored,
an order PTX's memory model does not promise). The benchmark compares 4 to 32 streams a program,
and the kernel without the word buffer or the early context.

The host parses each block's head (mode, contexts, streams, stride, context map, code-length
tables, stream lengths, checked as ``layertap._spec.exphuf.decode_block`` checks them), unpacks
and checks every code-length table of the batch in one numpy pass, then uploads the lengths, a
512-entry map per block from an element's top 9 bits to the table of the context it gives, and
the lanes' descriptors, one copy each; the decode tables are built on the device from the
lengths (``decode_tables``: canonical codes as in RFC 1951, read least significant bit first).
Raw blocks (mode 0) and tensors of other dtypes are copied as they are.

Blocks coded by column (mode 2, what the Rust writer writes since 2026-12-05) are parsed here
too (their tables join the batch's) and decoded by ``layertap.gpu.exphuf_columns``'s kernels: one
lane a stream (4 streams a 32,768 elements, so tens of thousands in a trainer's batch), then an
elementwise pass that puts the raw plane's bits beside each element's top 9 bits. A batch may mix
records of both modes.
"""

from __future__ import annotations

import functools
import math
import struct
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import triton
import triton.language as tl

from layertap._spec import json_text
from layertap._spec.blob import parse_header
from layertap._spec.dtypes import TORCH_NAMES
from layertap._spec.exphuf import (
    CODED,
    MAX_CODE_LEN,
    MAX_CONTEXTS,
    MODE_CODED,
    MODE_COLUMNS,
    MODE_RAW,
    STREAM_COUNTS,
    SYMBOLS,
    segment,
    symbol_of_top,
    top_of_symbol,
)
from layertap._spec.format import FormatProblem, align8
from layertap.errors import CorruptRecordError, InvalidInputError
from layertap.gpu import exphuf_columns
from layertap.gpu.exphuf_columns import check_stream_ends, stream_lanes

TABLE_LEN = 1 << MAX_CODE_LEN
_FIXED = struct.Struct("<BBHI")
_TABLE_HEAD = struct.Struct("<HH")
#: The longest block head: mode, fixed fields, context map, 16 full code-length tables, 8
#: stream lengths. A device payload's head is read back in one copy of at most this.
_MAX_HEAD = 1 + _FIXED.size + SYMBOLS // 2 + MAX_CONTEXTS * (4 + SYMBOLS // 2) + 8 * 8
#: The longest header ``_parsed_head`` keeps in its cache (a record's is some 200 bytes).
_CACHED_HEAD = 4096
#: Bytes after the last payload in the device copy: the two words after a stream's last one.
_PAD = 24
#: Lane statuses the kernel writes (0: decoded and checked).
_PROBLEMS = {
    1: "holds a bit pattern that is no code",
    2: "runs past its end",
    3: "holds more bytes than its elements take",
    4: "has padding bits that are not zero",
}
#: Lanes of a program: a warp, one lane a thread. Fewer would leave threads holding copies of a
#: lane, which read back what another thread of the warp stored (the element ``d`` back), an
#: order PTX's memory model does not promise; so a program spreads over fewer streams by leaving
#: lanes idle instead (``live_lanes``).
LANES = 32
#: Lanes of a program of the mode-2 streams kernel on CUDA (4 warps): its lanes share nothing.
COLUMN_LANES = 128
_SYMBOL_OF_TOP = symbol_of_top(np.arange(SYMBOLS))
#: Where a top's context lies in a packed context map: its symbol's byte and nibble.
_TOP_BYTE, _TOP_SHIFT = _SYMBOL_OF_TOP >> 1, ((_SYMBOL_OF_TOP & 1) * 4).astype(np.uint8)
#: A code length's share of the code space, 2^(11 - length) (0 for no code); lengths over 11
#: (refused before this is looked at) count as 11.
_KRAFT = np.array([0] + [1 << (MAX_CODE_LEN - min(n, MAX_CODE_LEN)) for n in range(1, 16)], np.int32)
_REV11 = np.array([int(f"{x:011b}"[::-1], 2) for x in range(TABLE_LEN)], dtype=np.int64)


@dataclass
class _Batch:
    """What the host parsed of a batch: the lanes of each element width, the decode tables,
    the plain copies, and where each record's tensors come from."""

    # per coded block: its code-length tables' bytes (a view of the payload); per table: where
    # its packed nibbles start in those blocks' bytes back to back, its first symbol and count
    packed: list[np.ndarray] = field(default_factory=list)
    packed_len: int = 0
    table_bytes: list[int] = field(default_factory=list)
    firsts: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    table_first: list[int] = field(default_factory=list)  # per coded block: its first table
    ctx_of_top: list[np.ndarray] = field(default_factory=list)  # per coded block: [512] context
    where: list[str] = field(default_factory=list)  # per coded block: "record r, tensor 'name'"
    # per width: lists of lane fields; elements of the width's output buffer so far
    lanes: dict[int, list[tuple]] = field(default_factory=lambda: {2: [], 4: []})
    elements: dict[int, int] = field(default_factory=lambda: {2: 0, 4: 0})
    # blocks coded by column (mode 2): per block its lanes ([S, 7] rows of bit, end bit, tops
    # start, count, block, stream, longest), its first table, and per width the merge rows
    # (raw plane's bit, tops start, out start, n, columns, rows)
    col_lanes: list[np.ndarray] = field(default_factory=list)
    col_ids: list[tuple[int, int, int]] = field(default_factory=list)  # (block, first table, contexts)
    col_blocks: dict[int, list[tuple]] = field(default_factory=lambda: {2: [], 4: []})
    tops: int = 0  # mode-2 elements so far (the streams kernel's output)
    plain: list[tuple[int, int, int]] = field(default_factory=list)  # (src byte, nbytes, out byte)
    plain_bytes: int = 0
    # per record: (name, dtype, shape, ("coded", width, start) | ("plain", out byte))
    records: list[list[tuple]] = field(default_factory=list)


class _Source:
    """A payload's bytes for the parser: a host buffer, or a device tensor whose heads are read
    back in a few small copies."""

    def __init__(self, payload):
        if isinstance(payload, torch.Tensor):
            if payload.dtype != torch.uint8 or payload.dim() != 1:
                raise InvalidInputError(
                    f"payload must be a 1-D uint8 tensor or a bytes-like object, not a {payload.dtype} tensor of shape {tuple(payload.shape)}"
                )
            self.tensor, self.host = payload, None
            self.length = payload.numel()
        else:
            self.tensor, self.host = None, memoryview(payload).cast("B")
            self.length = len(self.host)

    def read(self, a: int, b: int) -> memoryview:
        b = min(b, self.length)
        if self.host is not None:
            return self.host[a:b]
        return memoryview(self.tensor[a:b].cpu().numpy().tobytes())


def _check_lengths(batch: _Batch) -> np.ndarray:
    """Every table's code lengths, ``[T, 512]`` uint8, checked as the format says (padding
    nibble, at most 11 bits, a prefix code); FormatProblem names the first bad table."""
    counts = np.array(batch.counts, np.int64)
    packed = np.concatenate(batch.packed) if batch.packed else np.zeros(0, np.uint8)
    nibbles = np.stack([packed & 15, packed >> 4], 1).reshape(-1)
    # Table t's nibbles start at 2 * (its packed bytes' offset); its count of them are lengths.
    byte_at = np.array(batch.table_bytes, np.int64)
    lengths = np.zeros((len(counts), SYMBOLS), np.uint8)
    starts = np.cumsum(counts) - counts
    j = np.arange(int(counts.sum())) - np.repeat(starts, counts)
    given = nibbles[np.repeat(2 * byte_at, counts) + j]  # the tables' lengths back to back
    lengths[np.repeat(np.arange(len(counts)), counts), np.repeat(np.array(batch.firsts, np.int64), counts) + j] = given
    # Per table, over its given lengths only (tens of a table, of 512): the longest and its
    # codes' share of the code space. A 0 after them closes the last table's span (and stands
    # for an empty table's, masked).
    given = np.append(given, np.uint8(0))
    longest = np.where(counts > 0, np.maximum.reduceat(given, starts), 0) if len(counts) else counts
    kraft = np.where(counts > 0, np.add.reduceat(_KRAFT[given], starts), 0) if len(counts) else counts
    odd = counts % 2 == 1
    bad = [
        (odd & (nibbles[np.minimum(2 * byte_at + counts, len(nibbles) - 1)] != 0), "code lengths' padding nibble is not zero"),
        (longest > MAX_CODE_LEN, f"a code length is over {MAX_CODE_LEN}"),
        (kraft > TABLE_LEN, "code lengths are over-subscribed (not a prefix code)"),
    ]  # fmt: skip
    for flags, problem in bad:
        if flags.any():
            t = int(np.argmax(flags))
            block = int(np.searchsorted(batch.table_first, t, side="right")) - 1
            raise FormatProblem(f"{batch.where[block]}: context {t - batch.table_first[block]}: {problem}")
    return lengths


def _check_contexts(contexts: int) -> None:
    if not 1 <= contexts <= MAX_CONTEXTS:
        raise FormatProblem(f"block has {contexts} contexts (1 to 16 allowed)")


def _context_tables(head, p: int, contexts: int, batch: _Batch) -> tuple[np.ndarray, int, int]:
    """The context map at ``head[p:]`` (a 4-bit context a symbol) and the ``contexts`` code-length
    tables after it, as both block modes' heads hold them: checked, the tables added to
    ``batch``. Returns the map (``[512]``, by an element's top 9 bits), the offset after the tables and the batch's index of the
    block's first table."""
    packed = np.frombuffer(head, np.uint8, SYMBOLS // 2, p)
    # The map read in top-9-bits order straight from its nibbles (a permutation of the symbols:
    # the same largest context as in symbol order).
    ctx_of_top = ((packed[_TOP_BYTE] >> _TOP_SHIFT) & 15).astype(np.int64)
    if ctx_of_top.max() >= contexts:
        raise FormatProblem(f"context map names context {ctx_of_top.max()} of {contexts}")
    p += SYMBOLS // 2
    table_first = len(batch.counts)
    # Each table's place follows from the one before (its count says its length): a short walk
    # over the heads' fixed fields; the nibbles themselves are taken and checked with the
    # batch's others, in one numpy pass (``_check_lengths``).
    start, end, tables = p, len(head), []
    for c in range(contexts):
        if p + 4 > end:
            raise FormatProblem(f"context {c}: block is cut off")
        first, count = _TABLE_HEAD.unpack_from(head, p)
        if first + count > SYMBOLS:
            raise FormatProblem(f"context {c}: code lengths of symbols {first}..{first + count} are out of range")
        tables.append((first, count, p + 4))
        p += 4 + (count + 1) // 2
        if p > end:
            raise FormatProblem(f"context {c}: block is cut off")
    shift = batch.packed_len - start
    for first, count, at in tables:
        batch.firsts.append(first)
        batch.counts.append(count)
        batch.table_bytes.append(at + shift)
    batch.packed.append(np.frombuffer(head, np.uint8, p - start, start))
    batch.packed_len += p - start
    return ctx_of_top, p, table_first


def _parse_block(src: _Source, at: int, base: int, n: int, width: int, batch: _Batch, out, where: str) -> int:
    """Parses the block at ``at`` (payload offset; ``base``: the payload's offset in the device
    copy) of ``n`` elements and adds its lanes or plain copy to ``batch``; ``out`` receives where
    the tensor's data will be. Returns where the block ends."""
    if at >= src.length:
        raise FormatProblem("block is cut off")
    head = src.read(at, at + _MAX_HEAD)
    mode = head[0]
    if mode == MODE_RAW:
        if at + 1 + n * width > src.length:
            raise FormatProblem("raw block is cut off")
        out.append(("plain", _add_plain(batch, base + at + 1, n * width)))
        return at + 1 + n * width
    if mode == MODE_COLUMNS:
        return _parse_columns(src, at, base, n, width, batch, out, where, head)
    if mode != MODE_CODED:
        raise FormatProblem(f"block mode {mode} is unknown")
    if 1 + _FIXED.size + SYMBOLS // 2 > len(head):
        raise FormatProblem("block is cut off")
    contexts, streams, reserved, stride = _FIXED.unpack_from(head, 1)
    _check_contexts(contexts)
    if streams not in STREAM_COUNTS:
        raise FormatProblem(f"block has {streams} streams (1, 2, 4 or 8 allowed)")
    if reserved:
        raise FormatProblem("block's reserved bytes are not zero")
    ctx_of_top, p, table_first = _context_tables(head, 1 + _FIXED.size, contexts, batch)
    if p + 8 * streams > len(head):
        raise FormatProblem("block is cut off")
    sizes = struct.unpack_from(f"<{streams}Q", head, p)
    stream_at = at + p + 8 * streams
    if sum(sizes) > src.length - stream_at:
        raise FormatProblem("a stream runs past the payload")
    block = len(batch.table_first)
    batch.table_first.append(table_first)
    batch.ctx_of_top.append(ctx_of_top)
    batch.where.append(where)
    start = batch.elements[width]
    for k, size in enumerate(sizes):
        seg = segment(n, streams, k)
        bit = 8 * (base + stream_at)
        batch.lanes[width].append((bit, bit + 8 * size, start + seg.start, len(seg), stride, block, k))
        stream_at += size
    batch.elements[width] += n
    out.append(("coded", width, start))
    return stream_at


_COLUMN_FIXED = struct.Struct("<B3sII")
#: Stream numbers 0, 1, ... of a block coded by column (most have a few hundred at most).
_STREAM_IDS = np.arange(4096, dtype=np.int64)


def _parse_columns(src: _Source, at: int, base: int, n: int, width: int, batch: _Batch, out, where: str, head) -> int:
    """``_parse_block`` for a block coded by column (mode 2), whose first bytes are ``head``:
    checked as the Rust decoder checks it (``column.rs``'s ``Head::parse``, the raw plane and
    the streams inside the payload, the raw plane's padding); its streams' lanes and its merge
    row go to ``batch``."""
    p = 1 + _COLUMN_FIXED.size
    if p + SYMBOLS // 2 > len(head):
        raise FormatProblem("block is cut off")
    contexts, reserved, columns, streams = _COLUMN_FIXED.unpack_from(head, 1)
    _check_contexts(contexts)
    if reserved != b"\0\0\0":
        raise FormatProblem("block's reserved bytes are not zero")
    if columns == 0 or n % columns:
        raise FormatProblem(f"block of {n} elements in rows of {columns} columns")
    if not 1 <= streams <= columns:
        raise FormatProblem(f"block has {streams} streams for {columns} columns (1 to {columns} allowed)")
    ctx_of_top, p, table_first = _context_tables(head, p, contexts, batch)
    lengths_at = at + p
    if lengths_at + 8 * streams > src.length:
        raise FormatProblem("block is cut off")
    sizes = np.frombuffer(src.read(lengths_at, lengths_at + 8 * streams), "<u8").astype(np.uint64)
    raw_bits = 8 * width - 9
    plane_at = lengths_at + 8 * streams
    plane_len = (n * raw_bits + 7) // 8
    if plane_at + plane_len > src.length:
        raise FormatProblem("the raw plane runs past the payload")
    stream_at = plane_at + plane_len
    room = src.length - stream_at
    ends = np.cumsum(sizes)  # uint64; the last is the sizes' sum (streams >= 1, checked above)
    if int(sizes.max()) > room or int(ends[-1]) > room:
        raise FormatProblem("a stream runs past the payload")
    if (n * raw_bits) % 8 and src.read(stream_at - 1, stream_at)[0] >> ((n * raw_bits) % 8):
        raise FormatProblem("the raw plane's padding bits are not zero")
    sizes, ends = sizes.astype(np.int64), ends.astype(np.int64)
    block = len(batch.table_first)
    batch.table_first.append(table_first)
    batch.ctx_of_top.append(ctx_of_top)
    batch.where.append(where)
    batch.col_ids.append((block, table_first, contexts))
    rows = n // columns
    # The lanes' rows (see _Batch.col_lanes), filled column by column: fewer numpy steps than
    # stacking them.
    lanes = np.empty((streams, 7), np.int64)
    k = _STREAM_IDS[:streams] if streams <= len(_STREAM_IDS) else np.arange(streams, dtype=np.int64)
    lanes[:, 5] = k
    first_col = k * columns // streams
    lanes[:, 3] = ((k + 1) * columns // streams - first_col) * rows
    lanes[:, 2] = first_col * rows + batch.tops
    lanes[:, 1] = ends
    lanes[:, 0] = ends - sizes
    lanes[:, :2] += base + stream_at
    lanes[:, :2] *= 8
    lanes[:, 4] = block
    lanes[:, 6] = lanes[:, 3].max(initial=0)
    batch.col_lanes.append(lanes)
    start = batch.elements[width]
    batch.col_blocks[width].append((8 * (base + plane_at), batch.tops, start, n, columns, rows))
    batch.tops += n
    batch.elements[width] += n
    out.append(("coded", width, start))
    return stream_at + int(ends[-1])


def _add_plain(batch: _Batch, src_byte: int, nbytes: int) -> int:
    out = batch.plain_bytes
    batch.plain.append((src_byte, nbytes, out))
    batch.plain_bytes += align8(nbytes)
    return out


def _raw_len(head: memoryview) -> int:
    """The raw blob's length as the header's data offsets give it (checked by parse_header)."""
    n = int.from_bytes(head[:8], "little")
    try:
        doc = json_text.parse(head[8 : 8 + n])
    except ValueError as e:
        raise FormatProblem(f"safetensors header: {e}") from None
    if not isinstance(doc, dict):
        raise FormatProblem("safetensors header is not a JSON object")
    ends = [v["data_offsets"][1] for k, v in doc.items() if k != "__metadata__" and isinstance(v, dict) and isinstance(v.get("data_offsets"), list) and len(v["data_offsets"]) == 2 and isinstance(v["data_offsets"][1], int)]  # fmt: skip
    return 8 + n + max(ends, default=0)


class _HeadOnly:
    """A blob as ``parse_header`` reads it: its header bytes, and the length the data would
    give it (the data itself is still coded)."""

    def __init__(self, head: memoryview, length: int):
        self.head, self.length = head, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, item):
        return self.head[item]


@functools.lru_cache(maxsize=1024)
def _parsed_head(head: bytes) -> tuple[int, tuple | FormatProblem]:
    """A payload's safetensors header (length prefix and JSON) parsed: the raw length its data
    offsets give, and ``parse_header``'s ``(metadata, tensors, data start)`` or the problem it
    found. Cached by the header's bytes: a batch's records (and the next batch's) mostly share
    their header, and ``stored_metadata`` reads the metadata again without a third JSON parse.
    Raises FormatProblem where the JSON itself is bad (not cached)."""
    raw_len = _raw_len(head)
    try:
        parsed = parse_header(_HeadOnly(head, raw_len))
    except FormatProblem as e:
        return raw_len, e
    return raw_len, parsed


def _head_bytes(src: _Source) -> bytes:
    if src.length < 8:
        raise FormatProblem("payload shorter than a safetensors header")
    head_len = 8 + int.from_bytes(src.read(0, 8), "little")
    if head_len > src.length:
        raise FormatProblem(f"safetensors header length {head_len - 8} does not fit the payload")
    return bytes(src.read(0, head_len))


def stored_metadata(payload) -> dict[str, str]:
    """The ``__metadata__`` of a payload ``decode_records`` decoded (its header was checked
    then, and is read again here from the cache, without parsing)."""
    _, parsed = _parsed_head(_head_bytes(_Source(payload)))
    if isinstance(parsed, FormatProblem):
        raise FormatProblem(str(parsed))
    return dict(parsed[0])


def _parse_record(src: _Source, base: int, batch: _Batch) -> None:
    head = _head_bytes(src)
    head_len = len(head)
    if head_len > _CACHED_HEAD:
        raw_len, parsed = _parsed_head.__wrapped__(head)  # not kept: the cache holds short ones
    else:
        raw_len, parsed = _parsed_head(head)
    if raw_len > 2 * src.length:
        raise FormatProblem(f"raw length {raw_len} is more than {src.length} stored bytes can decode to")
    if isinstance(parsed, FormatProblem):
        raise FormatProblem(str(parsed))
    _, tensors, _ = parsed
    at, out = head_len, []
    for t in tensors:
        size = t.end - t.begin
        try:
            if t.dtype in CODED:
                width = CODED[t.dtype][0]
                at = _parse_block(
                    src,
                    at,
                    base,
                    size // width,
                    width,
                    batch,
                    out,
                    f"record {len(batch.records)} of the batch, tensor {t.name!r}",
                )
            else:
                if at + size > src.length:
                    raise FormatProblem("payload is cut off")
                out.append(("plain", _add_plain(batch, base + at, size)))
                at += size
        except FormatProblem as e:
            raise FormatProblem(f"tensor {t.name!r}: {e}") from None
    if at != src.length:
        raise FormatProblem(f"{src.length - at} bytes after the last tensor's block")
    batch.records.append([(t.name, t.dtype, t.shape, where) for t, where in zip(tensors, out)])


def decode_tables(lengths: torch.Tensor) -> torch.Tensor:
    """The decode table of each row of ``lengths`` (``[T, 512]`` code lengths, checked, on any
    device): ``[T, 2048]`` int16 entries; entry ``x`` of a table decodes a stream whose next 11
    bits (least significant first) are ``x``: ``top9 << 4 | code length``, or 0 where no code
    starts. Built where the lengths are, in torch operations over every table at once (a few
    dozen launches, no wait): for each length L, the L bits at ``x`` read as a canonical code of
    that length, and the symbol that code is if it is one (a prefix code: at most one L is)."""
    t_count, device = lengths.shape[0], lengths.device
    ln = lengths.long()
    bl_count = torch.zeros((t_count, MAX_CODE_LEN + 1), dtype=torch.long, device=device)
    bl_count.scatter_add_(1, ln, torch.ones_like(ln))
    # The symbols ordered by (length, symbol): those of length L start at ``start[:, L]``.
    order = torch.argsort(ln * SYMBOLS + torch.arange(SYMBOLS, device=device), dim=1)
    start = torch.cumsum(bl_count, 1) - bl_count
    entries = torch.zeros((t_count, TABLE_LEN), dtype=torch.int32, device=device)
    rev = _reversed_prefixes(device)
    code = torch.zeros(t_count, dtype=torch.long, device=device)
    for length in range(1, MAX_CODE_LEN + 1):
        code = (code + (bl_count[:, length - 1] if length > 1 else 0)) << 1  # first code (RFC 1951)
        k = rev[length][None, :] - code[:, None]  # rank of the code among those of its length
        valid = (k >= 0) & (k < bl_count[:, length : length + 1])
        pos = (start[:, length : length + 1] + k).clamp(0, SYMBOLS - 1)
        sym = torch.gather(order, 1, pos)
        entries = torch.where(valid, ((top_of_symbol(sym) << 4) | length).to(torch.int32), entries)
    return entries.to(torch.int16)


_REVERSED: dict = {}


def _reversed_prefixes(device) -> torch.Tensor:
    """``[12, 2048]``: row L holds the first L bits of each 11-bit ``x`` (least significant
    first) read as an L-bit code (first bit most significant)."""
    key = str(device)
    if key not in _REVERSED:
        x = np.arange(TABLE_LEN)
        rows = [np.zeros(TABLE_LEN, np.int64)] + [
            _REV11[x & ((1 << n) - 1)] >> (MAX_CODE_LEN - n) for n in range(1, MAX_CODE_LEN + 1)
        ]
        _REVERSED[key] = torch.from_numpy(np.stack(rows)).to(device)
    return _REVERSED[key]


def _upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(array)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class Staging:
    """A batch's payloads laid out in one host buffer as ``decode_records`` copies them to the
    device: back to back, each at a multiple of 8, the gaps and ``_PAD`` bytes after the last
    zeroed (what a damaged stream reads past its end is then always the same); pinned where
    the copy goes to a GPU (torch's host allocator keeps it for the next batch).

    ``Staging(lengths, device)``, then fill ``views[i]`` (a writable memoryview of
    ``lengths[i]`` bytes: ``os.preadv`` or ``readinto`` into it) with payload ``i`` and pass the
    Staging to ``decode_records``: the stored bytes are then written on the host once, where
    the file is read, and copied to the device as they are."""

    def __init__(self, lengths, device):
        self.device = torch.device(device)
        self.lengths = [int(n) for n in lengths]
        self.bases, at = [], 0
        for n in self.lengths:
            self.bases.append(at)
            at = align8(at + n)
        total = at + _PAD
        self.host = torch.empty(total, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        array = self.host.numpy()
        for b, n, e in zip(self.bases, self.lengths, [*self.bases[1:], total]):
            array[b + n : e] = 0
        whole = memoryview(array)
        self.views = [whole[b : b + n] for b, n in zip(self.bases, self.lengths)]

    def __len__(self) -> int:
        return len(self.lengths)


def _device_copy(payloads, sources, device) -> tuple[torch.Tensor, list[int]]:
    """The payloads back to back in one uint8 buffer on ``device`` (as ``Staging`` lays them
    out); and where each starts. Host buffers are staged with one copy each, then copied to the
    device in one; a ``Staging`` is copied as it is."""
    if isinstance(payloads, Staging):
        return payloads.host.to(device, non_blocking=True), payloads.bases
    if all(s.host is not None for s in sources):
        staging = Staging([s.length for s in sources], device)
        for view, s in zip(staging.views, sources):
            np.frombuffer(view, np.uint8)[:] = np.frombuffer(s.host, np.uint8)
        return staging.host.to(device, non_blocking=True), staging.bases
    bases, at = [], 0
    for s in sources:
        bases.append(at)
        at = align8(at + s.length)
    buf = torch.zeros(at + _PAD, dtype=torch.uint8, device=device)
    for p, s, b in zip(payloads, sources, bases):
        buf[b : b + s.length].copy_(
            p if isinstance(p, torch.Tensor) else torch.frombuffer(bytearray(s.host), dtype=torch.uint8)
        )
    return buf, bases


def decode_records(
    payloads,
    device=None,
    *,
    lanes_per_program: int | None = None,
    live_lanes: int | None = None,
    ahead: bool = True,
    buffered: bool = True,
    column_lanes: int | None = None,
    timings: dict | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Decodes exp-huf record payloads (each a bytes-like object, or a 1-D uint8 tensor; the
    ``stored`` bytes of a codec-3 record: safetensors header then blocks) on ``device`` (the
    tensors' device, else CUDA where there is one, else the CPU, through Triton's interpreter).
    Returns, per payload, its tensors by name, on the device, bit for bit the writer's; tensors
    of one batch share the batch's output buffers. Raises CorruptRecordError naming the record,
    tensor and stream where a payload is not a valid exp-huf payload.

    ``payloads`` may also be a ``Staging`` its caller filled (read from files straight into
    it): its buffer is then copied to the device as it is, no host copy first. Host buffers are
    the fast way in: a device tensor's block heads are read back in one small copy each. ``lanes_per_program`` (a multiple of 32 on CUDA; ``LANES`` there by default),
    ``live_lanes`` (the streams a program decodes, the others idle; by default as few as give
    each multiprocessor two programs, at least 4), ``ahead`` (the next element's context loaded a step early)
    and ``buffered`` (a stream's words kept from step to step, the next one loaded beside the
    table entry) choose the kernel's variant, for the benchmark's comparison, as
    ``column_lanes`` (a power of two, a multiple of 32 on CUDA; ``COLUMN_LANES`` there by
    default) chooses the lanes of a program of the mode-2 streams kernel; ``timings``, if given,
    receives the host's parse and table time (``parse_s``: the payloads staged and copied,
    ``stage_s``; their heads parsed, ``records_s``; the tables checked and built, ``tables_s``)
    and, on CUDA, the kernels' time (seconds)."""
    t0 = time.perf_counter()
    if isinstance(payloads, Staging):
        device = payloads.device if device is None else device
        sources = [_Source(v) for v in payloads.views]
    else:
        payloads = list(payloads)
        if device is None:
            on = [p.device for p in payloads if isinstance(p, torch.Tensor)]
            device = on[0] if on else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        sources = [_Source(p) for p in payloads]
    device = torch.device(device)
    src_buf, bases = _device_copy(payloads, sources, device)
    t1 = time.perf_counter()
    batch = _Batch()
    for r, (s, b) in enumerate(zip(sources, bases)):
        try:
            _parse_record(s, b, batch)
        except FormatProblem as e:
            raise CorruptRecordError(f"record {r} of the batch is not a valid exp-huf payload: {e}") from None
    if timings is not None:
        # parse_s is the host's whole part before the kernels; its pieces say which to work on
        # (the H100 run of 2026-12-05 measured it at 4-8x the kernels' time).
        timings["stage_s"], timings["records_s"] = t1 - t0, time.perf_counter() - t1
        timings["parse_s"] = timings["stage_s"] + timings["records_s"]
        timings.pop("kernel_s", None)
    if lanes_per_program is None:  # the interpreter runs programs one after another: one will do
        lanes_per_program = LANES if device.type == "cuda" else 64
    if device.type == "cuda" and lanes_per_program % 32:
        raise InvalidInputError(f"lanes_per_program must be a multiple of 32 (a warp) on CUDA, not {lanes_per_program}")
    if live_lanes is not None and not 1 <= live_lanes <= lanes_per_program:
        raise InvalidInputError(f"live_lanes must be 1 to lanes_per_program ({lanes_per_program}), not {live_lanes}")
    if column_lanes is None:  # mode 2's lanes read nothing another lane wrote: 4 warps a program
        column_lanes = COLUMN_LANES if device.type == "cuda" else 64
    if column_lanes < 1 or column_lanes & (column_lanes - 1) or (device.type == "cuda" and column_lanes % 32):
        raise InvalidInputError(f"column_lanes must be a power of two (at least 32 on CUDA), not {column_lanes}")
    outs = _run(batch, src_buf, device, (lanes_per_program, live_lanes, ahead, buffered), timings, column_lanes)
    plain = torch.empty(batch.plain_bytes, dtype=torch.uint8, device=device)
    for src_byte, nbytes, out_byte in batch.plain:
        plain[out_byte : out_byte + nbytes].copy_(src_buf[src_byte : src_byte + nbytes])
    records = []
    for rec in batch.records:
        tensors = {}
        for name, dtype, shape, where in rec:
            tdtype = getattr(torch, TORCH_NAMES[dtype])
            n = math.prod(shape)
            if where[0] == "coded":
                flat = outs[where[1]][where[2] : where[2] + n]
            else:
                flat = plain[where[1] : where[1] + n * tdtype.itemsize]
            tensors[name] = flat.view(tdtype).reshape(shape)
        records.append(tensors)
    return records


def _run(
    batch: _Batch, src_buf: torch.Tensor, device, tuning: tuple[int, int | None, bool, bool], timings, column_lanes: int
) -> dict[int, torch.Tensor]:
    """Launches the kernel for each element width's lanes; returns the output buffers (int16,
    int32). Raises CorruptRecordError when a lane reports a problem."""
    outs = {2: torch.empty(batch.elements[2], dtype=torch.int16, device=device),
            4: torch.empty(batch.elements[4], dtype=torch.int32, device=device)}  # fmt: skip
    if not batch.table_first:
        return outs
    t0 = time.perf_counter()
    try:
        lengths = _check_lengths(batch)
    except FormatProblem as e:
        raise CorruptRecordError(f"not a valid exp-huf payload: {e}") from None
    table_first = np.array(batch.table_first, np.int64) * TABLE_LEN
    tables_d = decode_tables(_upload(lengths, device)).reshape(-1)
    # Per block, top 9 bits -> the offset of its context's table in ``tables``.
    table_of_top = (np.stack(batch.ctx_of_top) * TABLE_LEN + table_first[:, None]).astype(np.int32)
    table_of_top_d = _upload(table_of_top.reshape(-1), device)
    if timings is not None:
        timings["tables_s"] = time.perf_counter() - t0
        timings["parse_s"] += timings["tables_s"]
    cuda = device.type == "cuda"
    if cuda and timings is not None:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    launched = []
    for width, lanes in batch.lanes.items():
        if not lanes:
            continue
        # Blocks by their longest segment, a block's streams together: a program's lanes run about
        # as many steps, and share their tables.
        longest = {}
        for lane in lanes:
            longest[lane[5]] = max(longest.get(lane[5], 0), lane[3])
        order = sorted(range(len(lanes)), key=lambda i: (-longest[lanes[i][5]], lanes[i][5], lanes[i][6]))
        per, live, ahead, buffered = tuning
        live = live or _live_lanes(len(lanes), per, device)
        # Program p's lanes are slots p * per to p * per + live; the others idle (count 0).
        slots = np.full(-(-len(order) // live) * per, -1, np.int64)
        at = np.arange(len(order))
        slots[(at // live) * per + at % live] = order
        arr = np.zeros((len(slots), 7), dtype=np.int64)
        arr[slots >= 0] = np.array([lanes[i] for i in order], dtype=np.int64)
        desc = _descriptors(arr, table_first, width)
        desc_d = _upload(desc, device)
        pos64 = int(desc[2].max()) >= _POS32_LIMIT
        status = _launch(src_buf, tables_d, table_of_top_d, outs[width], desc_d, width, pos64, per, ahead, buffered)
        launched.append((width, lanes, slots, status))
    col_status = None
    if batch.col_lanes:
        col_status = _run_columns(batch, src_buf, tables_d, outs, column_lanes)
        launched.append((None, None, None, col_status[1]))
    if cuda and timings is not None:
        stop.record()
    # The one read back (a wait for the kernels): which lanes met a problem (none, almost always).
    flags = torch.cat([status[0] for *_, status in launched]).cpu()
    if cuda and timings is not None:
        timings["kernel_s"] = start.elapsed_time(stop) / 1e3
    problems, first = [], 0
    for width, lanes, slots, status in launched:
        if width is None:  # the mode-2 lanes: described apart
            bad = torch.nonzero(flags[first:]).reshape(-1).tolist()
            if bad:
                at = status[:, bad].cpu().numpy()
                problems += [(None, col_status[0][slot], int(code), int(j)) for slot, code, j in zip(bad, at[0], at[1])]
            continue
        bad = torch.nonzero(flags[first : first + len(slots)]).reshape(-1).tolist()
        first += len(slots)
        if bad:
            at = status[:, bad].cpu().numpy()
            for slot, code, j in zip(bad, at[0], at[1]):
                problems.append((width, lanes[slots[slot]], int(code), int(j)))
    if problems:
        raise CorruptRecordError(
            _describe(batch, problems[0])
            + (f" ({len(problems) - 1} more streams are bad)" if len(problems) > 1 else "")
        )
    return outs


def _run_columns(batch: _Batch, src_buf, tables_d, outs, lanes_per_program: int):
    """Launches the kernels of the blocks coded by column (``exphuf_columns``): the streams
    kernel once over every such block's streams, then the merge kernel per element width.
    Returns the lanes (rows as ``_Batch.col_lanes``, in launch order) and their statuses."""
    device = src_buf.device
    words = src_buf.view(torch.int32)
    lanes = np.concatenate(batch.col_lanes)
    # Blocks by their longest stream, a block's streams together: a program's lanes run about as
    # many steps and share their tables.
    lanes = lanes[np.lexsort((lanes[:, 5], lanes[:, 4], -lanes[:, 6]))]
    # The blocks' own tables, with the context each code leads to in its entries.
    ids, firsts, contexts = (np.array(c, np.int64) for c in zip(*batch.col_ids))
    rows = (
        np.repeat(firsts, contexts)
        + np.arange(int(contexts.sum()))
        - np.repeat(np.cumsum(contexts) - contexts, contexts)
    )
    ctx_of_top = np.stack([batch.ctx_of_top[b] for b in ids])[np.repeat(np.arange(len(ids)), contexts)]
    chain = exphuf_columns.chain_tables(
        tables_d.view(-1, TABLE_LEN)[_upload(rows, device)], _upload(ctx_of_top, device)
    )
    # Per block number, its context 0's table in ``chain``.
    table0 = np.zeros(len(batch.table_first), np.int64)
    table0[ids] = (np.cumsum(contexts) - contexts) * TABLE_LEN
    first_word = lanes[:, 0] >> 5
    base = first_word << 5
    block_table = table0[lanes[:, 4]]
    desc = np.ascontiguousarray(np.stack([first_word, lanes[:, 0] - base, lanes[:, 1] - base, lanes[:, 2], lanes[:, 3], block_table]))  # fmt: skip
    pos64 = len(lanes) > 0 and int(desc[2].max()) >= _POS32_LIMIT
    tops = torch.empty(batch.tops, dtype=torch.int16, device=device)
    status = exphuf_columns.launch_streams(
        words, chain.reshape(-1), tops, _upload(desc, device), pos64, lanes_per_program
    )
    for width, blocks in batch.col_blocks.items():
        if blocks:
            jobs = exphuf_columns.merge_jobs(np.array(blocks, dtype=np.int64))
            exphuf_columns.launch_merge(words, tops, outs[width], _upload(jobs, device), width)
    return lanes, status


def _describe(batch: _Batch, problem) -> str:
    if problem[0] is None:  # a stream of a block coded by column
        _, (_, _, _, _, block, k, _), code, j = problem
        at = f"after its {j} codes" if code >= 3 else f"at code {j}"
        return f"{batch.where[block]} is corrupt: its exp-huf stream {k} {_PROBLEMS.get(code, f'fails check {code}')} ({at})"
    width, (_, _, start, _, _, _, k), code, j = problem
    where = "a tensor"
    for r, rec in enumerate(batch.records):
        for name, _, shape, w in rec:
            if w[0] == "coded" and w[2] <= start < w[2] + int(np.prod(shape, dtype=np.int64)) and w[1] == width:
                where = f"record {r} of the batch, tensor {name!r}"
    at = f"after its {j} elements" if code >= 3 else f"at element {j} of its segment"
    return f"{where} is corrupt: its exp-huf stream {k} {_PROBLEMS.get(code, f'fails check {code}')} ({at})"


@triton.jit
def _decode_kernel(
    words_ptr,  # the payloads as words: int32 for 2-byte elements (18 bits a step), else int64
    tables_ptr,  # int16 decode tables, 2048 entries each
    table_of_top_ptr,  # int32, per block 512: top 9 bits -> its context's table offset
    out_ptr,  # int16 or int32 elements
    desc_ptr,  # int64 [8, lanes]: first word, bit, end bit (from the first word), out start,
    # count, stride, map offset, table 0
    status_ptr,  # int32 [2, lanes]: problem (0 none), element where it was met
    lanes,
    RAW_BITS: tl.constexpr,
    LANES: tl.constexpr,
    AHEAD: tl.constexpr,
    BUFFERED: tl.constexpr,
    POS64: tl.constexpr,  # bit positions in int64: a stream of 2^31 bits or more
):
    WORD: tl.constexpr = words_ptr.dtype.element_ty.primitive_bitwidth
    LOG_WORD: tl.constexpr = 5 if WORD == 32 else 6
    UWORD: tl.constexpr = tl.uint32 if WORD == 32 else tl.uint64
    # Per lane, once: its stream's first word and its output as pointers; then 32-bit counters.
    lane, live, wp, bit, end, op, count = stream_lanes(words_ptr, desc_ptr, out_ptr, lanes, LANES, POS64)
    stride = tl.load(desc_ptr + 5 * lanes + lane, mask=live, other=0).to(tl.int32)
    map0 = tl.load(desc_ptr + 6 * lanes + lane, mask=live, other=0).to(tl.int32)
    table0 = tl.load(desc_ptr + 7 * lanes + lane, mask=live, other=0).to(tl.int32)
    status = tl.zeros([LANES], dtype=tl.int32)
    where = tl.zeros([LANES], dtype=tl.int32)
    raw_mask = (1 << RAW_BITS) - 1
    steps = tl.max(count, axis=0)
    table = table0  # element 0's context: 0
    pend = tl.zeros([LANES], dtype=tl.int32)  # AHEAD, d >= 3: the element d back of the next
    last_x = tl.zeros([LANES], dtype=tl.int32)  # AHEAD: the element decoded a step ago
    # BUFFERED: the two words holding the next bits, kept from step to step
    lo = tl.load(wp + (bit >> LOG_WORD), mask=live, other=0).to(UWORD, bitcast=True)
    hi = tl.load(wp + (bit >> LOG_WORD) + 1, mask=live, other=0).to(UWORD, bitcast=True)
    for j in range(0, steps):
        active = (j < count) & (status == 0)
        if AHEAD:
            # The next element's table, off this element's chain: from the element d back of
            # it (loaded a step ago) where d >= 3; and that element for the step after next.
            has_next = active & (stride > 0) & (j + 1 >= stride) & (j + 1 < count)
            top_pend = (pend >> RAW_BITS) & 511  # sign-extended 16 or 32 bits: the top 9
            early = tl.load(table_of_top_ptr + map0 + top_pend, mask=has_next & (stride >= 3), other=0)
            soon = active & (stride >= 3) & (j + 2 >= stride) & (j + 2 < count)
            pend = tl.load(op + (j + 2 - stride), mask=soon, other=0, cache_modifier=".cg").to(tl.int32)
        else:
            # The context: the table the element d back (same segment) picks, else context 0.
            has_prev = active & (stride > 0) & (j >= stride)
            prev = tl.load(op + (j - stride), mask=has_prev, other=0, cache_modifier=".cg").to(tl.int32)
            top_prev = (prev >> RAW_BITS) & 511
            table = tl.load(table_of_top_ptr + map0 + top_prev, mask=has_prev, other=0)
            table = tl.where(has_prev, table, table0)
        # The stream's next bits: two words, funnel-shifted (a shift by the word's width is
        # avoided); a step takes at most 18 bits of 32-bit words, 34 of 64-bit ones.
        w = bit >> LOG_WORD
        s = (bit & (WORD - 1)).to(UWORD)
        if BUFFERED:
            # The word after them, loaded beside this step's table entry rather than before
            # it: a step moves on by one word at most, so the next step needs it at most.
            after = tl.load(wp + w + 2, mask=active, other=0).to(UWORD, bitcast=True)
        else:
            lo = tl.load(wp + w, mask=active, other=0).to(UWORD, bitcast=True)
            hi = tl.load(wp + w + 1, mask=active, other=0).to(UWORD, bitcast=True)
        word = (lo >> s) | ((hi << 1) << (WORD - 1 - s))
        entry = tl.load(tables_ptr + table + (word & 2047).to(tl.int32), mask=active, other=0).to(tl.int32)
        length = entry & 15
        nbit = bit + length + RAW_BITS
        no_code = active & (length == 0)
        past_end = active & (length > 0) & (nbit > end)
        ok = active & (length > 0) & (nbit <= end)
        raw = ((word >> length.to(UWORD)) & raw_mask).to(tl.int32)
        x = ((entry >> 4) << RAW_BITS) | raw
        tl.store(op + j, x.to(out_ptr.dtype.element_ty), mask=ok)
        status = tl.where(no_code, 1, tl.where(past_end, 2, status))
        where = tl.where(no_code | past_end, j, where)
        if BUFFERED:
            step = ok & ((nbit >> LOG_WORD) != w)
            lo = tl.where(step, hi, lo)
            hi = tl.where(step, after, hi)
        bit = tl.where(ok, nbit, bit)
        if AHEAD:
            # d of 1 or 2: the element d back of the next is this one or the last one.
            near = tl.where(stride == 1, x, last_x)
            late = tl.load(table_of_top_ptr + map0 + ((near >> RAW_BITS) & 511), mask=has_next & (stride < 3), other=0)
            table = tl.where(has_next, tl.where(stride >= 3, early, late), table0)
            last_x = x
    check_stream_ends(wp, bit, end, count, status, where, status_ptr, lane, lanes, live, WORD)


def _live_lanes(lanes: int, per: int, device) -> int:
    """Streams a program decodes: fewer than its lanes while that gives the device's
    multiprocessors two programs each (down to 4, a block's streams: one block's tables in a
    multiprocessor's L1), so that a small batch spreads over the device."""
    if device.type != "cuda":
        return per
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    live = per
    while live > 4 and -(-lanes // live) < 2 * sms:
        live //= 2
    return live


#: Bit positions past this take the kernel's int64 variant (a stream of 2^31 bits, 256 MiB, or
#: more; a bit position may run 34 past its stream's end before the check stops it).
_POS32_LIMIT = (1 << 31) - 128
#: The words a lane reads its stream in: 32 bits where an element takes at most 18 (11 code + 7
#: raw), 64 where it takes up to 34 (float32's 23 raw bits).
_WORDS = {2: torch.int32, 4: torch.int64}


def _descriptors(arr: np.ndarray, table_first: np.ndarray, width: int) -> np.ndarray:
    """The kernel's ``[8, lanes]`` int64 descriptors of the lanes ``arr`` (rows of bit, end bit,
    out start, count, stride, block, stream): positions from the stream's first word."""
    log_word = 5 if width == 2 else 6
    first_word = arr[:, 0] >> log_word
    base = first_word << log_word
    fields = [first_word, arr[:, 0] - base, arr[:, 1] - base, arr[:, 2], arr[:, 3], arr[:, 4], arr[:, 5] * SYMBOLS, table_first[arr[:, 5]]]  # fmt: skip
    return np.ascontiguousarray(np.stack(fields))


def _launch(src_buf, tables, table_of_top, out, desc, width, pos64, lanes_per_program, ahead, buffered) -> torch.Tensor:
    """Runs the kernel over the lanes ``desc`` describes (as ``_descriptors`` makes them);
    returns their statuses ``[2, lanes]``."""
    lanes = desc.shape[1]
    status = torch.empty((2, lanes), dtype=torch.int32, device=out.device)
    raw_bits = 8 * width - 9
    _decode_kernel[(triton.cdiv(lanes, lanes_per_program),)](
        src_buf.view(_WORDS[width]), tables, table_of_top, out, desc, status, lanes,
        RAW_BITS=raw_bits, LANES=lanes_per_program,
        AHEAD=ahead, BUFFERED=buffered, POS64=pos64, num_warps=max(1, lanes_per_program // 32),
        num_stages=1,
    )  # fmt: skip
    return status


__all__ = ["LANES", "Staging", "decode_records", "decode_tables", "stored_metadata"]
