"""The decoder of codec ``exp-huf`` (docs/FORMAT.md, "Codec 3") as Triton kernels, for trainers
(issue 32, goal 3): records' stored payloads go to the GPU as they are (1.5x fewer bytes than the
raw tensors) and are decoded there, bit for bit what the writer took (``decode_records``).

Where the parallelism is. Each stream of a block is one sequential chain: an element's code
length says where the next one starts, and its context comes from the element ``d`` back, which
the same stream decoded; nothing else in the format cuts a stream. So the kernel decodes many
streams in lockstep, one stream a lane (a thread), for as many steps as a program's longest
segment (a block's streams share a program, blocks ordered by their longest segment). With 4
streams a tensor, 64 records of one tensor are 256 lanes, a 2048-token record alone 4. A lane's
step is a chain of dependent work (a table load, then a dozen integer operations), not
bandwidth: the format, not the kernel, bounds the speed. Estimated before measuring
(benches/gpu/bench_gpu_exphuf_decode.py): 87 instructions a step for sm_90, some 100-300 cycles
an element, so 256 lanes decode 3-10 GB/s of bf16 and the issue's 50 GB/s takes 1,500-4,000
lanes in flight, or a format with more streams. Positions, counters and offsets are 32-bit in
the loop (int64 costs two instructions an operation).

Off the chain: the word after the two a lane holds is loaded beside the table entry (``_PAD``
keeps it inside the buffer), and the next element's table a step early, from the output the lane
wrote (``.cg``: its own store, from L2, never a stale L1 line) where ``d >= 3``, from registers
where ``d`` is 1 or 2. A lane checks what the Rust decoder checks into a status word (so no load
leaves the buffer); one small read after the kernels turns a problem into a CorruptRecordError
naming the record, tensor and stream.

Triton cannot address shared memory, so the tables are read through L1. A program is a warp of
32 lanes (``LANES``: a narrower one would leave threads reading back what another thread stored,
an order PTX's memory model does not promise); for a small batch it decodes as few as 4 streams
(one block's tables in L1), the others idle, so that 64 records spread over 64 of the H200's 132
multiprocessors rather than 8 (``live_lanes``).

The Rust core parses and checks the batch's headers and block heads in one call, the GIL
released (``_native.exphuf_batch_heads``): 0.8 ms a batch of 64 MiniLM-sized records, where the
Python parse before it took 7.7 (33 on the H100's host) and bounded records/s for narrow records
(``benches/gpu/host_parse_exphuf_decode.py``). Raw blocks and tensors of other dtypes are copied
as they are; blocks coded by column (mode 2, the Rust writer's) are decoded by
``exphuf_columns``'s kernels; a batch may mix both modes.
"""

from __future__ import annotations

import functools
import itertools
import math
import time

import numpy as np
import torch
import triton
import triton.language as tl

from layertap._native import exphuf_batch_heads
from layertap._spec.dtypes import TORCH_NAMES
from layertap._spec.exphuf import MAX_CODE_LEN, SYMBOLS, top_of_symbol
from layertap._spec.format import align8
from layertap.errors import CorruptRecordError, InvalidInputError
from layertap.gpu import exphuf_columns
from layertap.gpu.device_copies import to_device
from layertap.gpu.exphuf_columns import check_stream_ends, stream_lanes

TABLE_LEN = 1 << MAX_CODE_LEN
#: Bytes after the last payload in the device copy: the two words after a stream's last one.
_PAD = 24
#: Lane statuses the kernel writes (0: decoded and checked).
_PROBLEMS = {
    1: "holds a bit pattern that is no code",
    2: "runs past its end",
    3: "holds more bytes than its elements take",
    4: "has padding bits that are not zero",
}
#: Lanes of a program: a warp, one lane a thread (the module's docs say why not fewer).
LANES = 32
#: Lanes of a program of the mode-2 streams kernel on CUDA (4 warps): its lanes share nothing.
COLUMN_LANES = 128
_REV11 = np.array([int(f"{x:011b}"[::-1], 2) for x in range(TABLE_LEN)], dtype=np.int64)


class _Heads:
    """What the Rust core parsed of a batch (rust/core/src/exphuf/batch_heads.rs), as numpy arrays."""

    def __init__(self, parsed: dict):
        def rows(name: str, width: int) -> np.ndarray:
            return np.frombuffer(parsed[name], np.int64).reshape(-1, width)

        # per record: its tensors are ``record_tensors[r]`` to ``record_tensors[r + 1]``, and its
        # __metadata__; per tensor: name, dtype, shape, and where its data will be (width 2 or 4:
        # its first element in that width's output; 0: its first byte in the copies' output)
        self.record_tensors = np.frombuffer(parsed["record_tensors"], np.int64)
        self.metadata: list[dict[str, str]] = parsed["metadata"]
        self.names, self.dtypes, self.shapes = parsed["names"], parsed["dtypes"], parsed["shapes"]
        self.places = rows("places", 2)
        # every table's code lengths ([T, 512], checked); per coded block: its tensor, first
        # table and contexts, and its map from an element's top 9 bits to the next context
        self.lengths = np.frombuffer(parsed["lengths"], np.uint8).reshape(-1, SYMBOLS)
        self.blocks = rows("blocks", 3)
        self.ctx_of_top = np.frombuffer(parsed["context_of_top"], np.uint8).reshape(-1, SYMBOLS)
        # per width, the lanes of blocks coded by element (mode 1): rows of bit, end bit, out
        # start, count, stride, block, stream; elements of the width's output
        self.lanes = {2: rows("element_lanes_2", 7), 4: rows("element_lanes_4", 7)}
        self.elements = dict(zip((2, 4), parsed["elements"]))
        # blocks coded by column (mode 2): their streams' lanes (rows of bit, end bit, tops
        # start, count, block, stream, longest), the blocks (block, first table, contexts), and
        # per width the merge rows (raw plane's bit, tops start, out start, n, columns, rows)
        self.col_lanes = rows("column_lanes", 7)
        self.col_ids = rows("column_blocks", 3)
        self.col_blocks = {2: rows("merges_2", 6), 4: rows("merges_4", 6)}
        self.tops: int = parsed["tops"]  # mode-2 elements (the streams kernel's output)
        self.plain = rows("plain", 3)  # (src byte, nbytes, out byte)
        self.plain_bytes: int = parsed["plain_bytes"]

    def where(self, block: int) -> str:
        tensor = int(self.blocks[block, 0])
        record = int(np.searchsorted(self.record_tensors, tensor, side="right")) - 1
        return f"record {record} of the batch, tensor {self.names[tensor]!r}"


def _host_bytes(payload) -> memoryview | torch.Tensor:
    """A payload as a flat host buffer, or the 1-D uint8 device tensor it is."""
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise InvalidInputError(
                f"payload must be a 1-D uint8 tensor or a bytes-like object, not a {payload.dtype} tensor of shape {tuple(payload.shape)}"
            )
        return payload
    return memoryview(payload).cast("B")


def decode_tables(lengths: torch.Tensor) -> torch.Tensor:
    """The decode table of each row of ``lengths`` (``[T, 512]`` code lengths, checked):
    ``[T, 2048]`` int16 entries, entry ``x`` for a stream whose next 11 bits (least significant
    first) are ``x``: ``top9 << 4 | code length``, 0 where no code starts. Built where the lengths
    are, every table at once (a few dozen launches, no wait): for each length L, the L bits at
    ``x`` read as a canonical code, and its symbol if it is one (a prefix code: one L at most)."""
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


@functools.cache
def _reversed_prefixes(device: torch.device) -> torch.Tensor:
    """``[12, 2048]``: row L holds the first L bits of each 11-bit ``x`` (least significant
    first) read as an L-bit code (first bit most significant)."""
    x = np.arange(TABLE_LEN)
    rows = [_REV11[x & ((1 << n) - 1)] >> (MAX_CODE_LEN - n) for n in range(1, MAX_CODE_LEN + 1)]
    return torch.from_numpy(np.stack([np.zeros(TABLE_LEN, np.int64), *rows])).to(device)


def _places(lengths: list[int]) -> tuple[list[int], int]:
    """Where each payload starts in the device copy (a multiple of 8), and the copy's length."""
    ends = list(itertools.accumulate(map(align8, lengths), initial=0))
    return ends[:-1], ends[-1] + _PAD


class Staging:
    """A batch's payloads in one host buffer as ``decode_records`` copies them to the device: each
    at a multiple of 8, the gaps and ``_PAD`` bytes after the last zeroed (what a damaged stream
    reads past its end is then always the same); pinned for a GPU (torch's host allocator keeps
    it for the next batch). Fill ``views[i]`` (``os.preadv`` or ``readinto`` into it) with
    payload ``i`` and pass the Staging to ``decode_records``: the stored bytes are written on the
    host once, where the file is read, and copied to the device as they are."""

    def __init__(self, lengths, device):
        self.device = torch.device(device)
        self.lengths = [int(n) for n in lengths]
        self.bases, total = _places(self.lengths)
        self.host = torch.empty(total, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        array = self.host.numpy()
        for b, n, e in zip(self.bases, self.lengths, [*self.bases[1:], total]):
            array[b + n : e] = 0
        whole = memoryview(array)
        self.views = [whole[b : b + n] for b, n in zip(self.bases, self.lengths)]

    def __len__(self) -> int:
        return len(self.lengths)


def _device_copy(payloads, device) -> tuple[torch.Tensor, np.ndarray, list[int], list[int]]:
    """The payloads in one uint8 buffer on ``device`` as ``Staging`` lays them out, the same bytes
    on the host (the heads are parsed from them), where each starts, and their lengths. A batch
    holding device tensors is put together on the device and copied back whole."""
    if isinstance(payloads, Staging):
        host = payloads.host
        return host.to(device, non_blocking=True), host.numpy(), payloads.bases, payloads.lengths
    lengths = [p.numel() if isinstance(p, torch.Tensor) else len(p) for p in payloads]
    if not any(isinstance(p, torch.Tensor) for p in payloads):
        staging = Staging(lengths, device)
        for view, p in zip(staging.views, payloads):
            np.frombuffer(view, np.uint8)[:] = np.frombuffer(p, np.uint8)
        return staging.host.to(device, non_blocking=True), staging.host.numpy(), staging.bases, lengths
    bases, total = _places(lengths)
    buf = torch.zeros(total, dtype=torch.uint8, device=device)
    for p, b, n in zip(payloads, bases, lengths):
        buf[b : b + n].copy_(p if isinstance(p, torch.Tensor) else torch.frombuffer(bytearray(p), dtype=torch.uint8))
    return buf, buf.cpu().numpy(), bases, lengths


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
    metadata: list | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Decodes exp-huf record payloads (the ``stored`` bytes of codec-3 records, each bytes-like or
    a 1-D uint8 tensor, or a ``Staging`` its caller filled) on ``device`` (the tensors' device,
    else CUDA where there is one, else the CPU, through Triton's interpreter). Returns, per
    payload, its tensors by name, on the device, bit for bit the writer's (a batch's tensors
    share its output buffers). Raises CorruptRecordError naming the record, tensor and stream
    where a payload is not valid. Host buffers are the fast way in: a batch holding device
    tensors is copied back to the host whole for its heads to be parsed.

    For the benchmark's comparisons: ``lanes_per_program`` (a multiple of 32 on CUDA, ``LANES``
    by default), ``live_lanes`` (the streams a program decodes, the others idle; by default as
    few as give each multiprocessor two programs, at least 4), ``ahead`` (the next element's
    context loaded a step early), ``buffered`` (a stream's words kept from step to step) and
    ``column_lanes`` (the mode-2 streams kernel's lanes a program: a power of two, a multiple of
    32 on CUDA, ``COLUMN_LANES`` by default) choose the kernels' variants; ``timings`` receives
    the host's times (``parse_s``: ``stage_s``, the payloads staged and copied, ``records_s``,
    their heads parsed, ``tables_s``, the tables built) and on CUDA the kernels' (``kernel_s``),
    in seconds; ``metadata`` is extended with each record's ``__metadata__``."""
    t0 = time.perf_counter()
    if isinstance(payloads, Staging):
        device = payloads.device if device is None else device
    else:
        payloads = [_host_bytes(p) for p in payloads]
        if device is None:
            on = [p.device for p in payloads if isinstance(p, torch.Tensor)]
            device = on[0] if on else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    src_buf, host, bases, lengths = _device_copy(payloads, device)
    t1 = time.perf_counter()
    batch = _Heads(exphuf_batch_heads(host, bases, lengths))
    if timings is not None:
        # parse_s is the host's part before the kernels, its pieces say which to work on (the
        # H100 run of 2026-12-05 measured it at 4-8x the kernels' time, before the core parsed).
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
    for src_byte, nbytes, out_byte in batch.plain.tolist():
        plain[out_byte : out_byte + nbytes].copy_(src_buf[src_byte : src_byte + nbytes])
    records = []
    bounds, places = batch.record_tensors.tolist(), batch.places.tolist()
    for first, end in itertools.pairwise(bounds):
        tensors = {}
        for t in range(first, end):
            tdtype = getattr(torch, TORCH_NAMES[batch.dtypes[t]])
            shape = batch.shapes[t]
            n = math.prod(shape)
            width, start = places[t]
            if width:
                flat = outs[width][start : start + n]
            else:
                flat = plain[start : start + n * tdtype.itemsize]
            tensors[batch.names[t]] = flat.view(tdtype).reshape(shape)
        records.append(tensors)
    if metadata is not None:
        metadata.extend(batch.metadata)
    return records


def _run(
    batch: _Heads, src_buf: torch.Tensor, device, tuning: tuple[int, int | None, bool, bool], timings, column_lanes: int
) -> dict[int, torch.Tensor]:
    """Launches the kernel for each element width's lanes; returns the output buffers (int16,
    int32). Raises CorruptRecordError when a lane reports a problem."""
    outs = {2: torch.empty(batch.elements[2], dtype=torch.int16, device=device),
            4: torch.empty(batch.elements[4], dtype=torch.int32, device=device)}  # fmt: skip
    if not len(batch.blocks):
        return outs
    t0 = time.perf_counter()
    table_first = batch.blocks[:, 1] * TABLE_LEN
    tables_d = decode_tables(to_device(batch.lengths, device)).reshape(-1)
    # Per block, top 9 bits -> the offset of its context's table in ``tables``.
    table_of_top = (batch.ctx_of_top.astype(np.int64) * TABLE_LEN + table_first[:, None]).astype(np.int32)
    table_of_top_d = to_device(table_of_top.reshape(-1), device)
    if timings is not None:
        timings["tables_s"] = time.perf_counter() - t0
        timings["parse_s"] += timings["tables_s"]
    cuda = device.type == "cuda"
    if cuda and timings is not None:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    launched = []
    for width, lanes in batch.lanes.items():
        if not len(lanes):
            continue
        # Blocks by their longest segment, a block's streams together: a program's lanes run about
        # as many steps, and share their tables.
        longest = np.zeros(len(batch.blocks), np.int64)
        np.maximum.at(longest, lanes[:, 5], lanes[:, 3])
        order = np.lexsort((lanes[:, 6], lanes[:, 5], -longest[lanes[:, 5]]))
        per, live, ahead, buffered = tuning
        live = live or _live_lanes(len(lanes), per, device)
        # Program p's lanes are slots p * per to p * per + live; the others idle (count 0).
        slots = np.full(-(-len(order) // live) * per, -1, np.int64)
        at = np.arange(len(order))
        slots[(at // live) * per + at % live] = order
        arr = np.zeros((len(slots), 7), dtype=np.int64)
        arr[slots >= 0] = lanes[order]
        desc = _descriptors(arr, table_first, width)
        desc_d = to_device(desc, device)
        pos64 = int(desc[2].max()) >= _POS32_LIMIT
        status = _launch(src_buf, tables_d, table_of_top_d, outs[width], desc_d, width, pos64, per, ahead, buffered)
        launched.append((width, arr, status))  # idle slots' rows are 0: they report nothing
    if len(batch.col_lanes):
        launched.append((None, *_run_columns(batch, src_buf, tables_d, outs, column_lanes)))
    if cuda and timings is not None:
        stop.record()
    # The one read back (a wait for the kernels): which lanes met a problem (none, almost always).
    flags = torch.cat([status[0] for *_, status in launched]).cpu()
    if cuda and timings is not None:
        timings["kernel_s"] = start.elapsed_time(stop) / 1e3
    problems, first = [], 0
    for width, rows, status in launched:  # width None: the mode-2 lanes
        bad = torch.nonzero(flags[first : first + status.shape[1]]).reshape(-1).tolist()
        first += status.shape[1]
        if bad:
            at = status[:, bad].cpu().numpy()
            problems += [(width, rows[slot], int(code), int(j)) for slot, code, j in zip(bad, at[0], at[1])]
    if problems:
        raise CorruptRecordError(
            _describe(batch, problems[0])
            + (f" ({len(problems) - 1} more streams are bad)" if len(problems) > 1 else "")
        )
    return outs


def _run_columns(batch: _Heads, src_buf, tables_d, outs, lanes_per_program: int):
    """Launches the kernels of the blocks coded by column: the streams kernel over all their
    streams, then the merge kernel per width. Returns the lanes (rows as ``_Heads.col_lanes``, in
    launch order) and their statuses."""
    device = src_buf.device
    words = src_buf.view(torch.int32)
    lanes = batch.col_lanes
    # Blocks by their longest stream, a block's streams together: a program's lanes run about as
    # many steps and share their tables.
    lanes = lanes[np.lexsort((lanes[:, 5], lanes[:, 4], -lanes[:, 6]))]
    # The blocks' own tables, with the context each code leads to in its entries.
    ids, firsts, contexts = batch.col_ids.T
    rows = (
        np.repeat(firsts, contexts)
        + np.arange(int(contexts.sum()))
        - np.repeat(np.cumsum(contexts) - contexts, contexts)
    )
    ctx_of_top = batch.ctx_of_top[ids][np.repeat(np.arange(len(ids)), contexts)]
    chain = exphuf_columns.chain_tables(
        tables_d.view(-1, TABLE_LEN)[to_device(rows, device)], to_device(ctx_of_top, device)
    )
    # Per block number, its context 0's table in ``chain``.
    table0 = np.zeros(len(batch.blocks), np.int64)
    table0[ids] = (np.cumsum(contexts) - contexts) * TABLE_LEN
    desc = np.ascontiguousarray(np.stack([*_positions(lanes, 5), lanes[:, 2], lanes[:, 3], table0[lanes[:, 4]]]))
    pos64 = int(desc[2].max()) >= _POS32_LIMIT
    tops = torch.empty(batch.tops, dtype=torch.int16, device=device)
    status = exphuf_columns.launch_streams(
        words, chain.reshape(-1), tops, to_device(desc, device), pos64, lanes_per_program
    )
    for width, blocks in batch.col_blocks.items():
        if len(blocks):
            jobs = exphuf_columns.merge_jobs(blocks)
            exphuf_columns.launch_merge(words, tops, outs[width], to_device(jobs, device), width)
    return lanes, status


def _describe(batch: _Heads, problem) -> str:
    mode, lane, code, j = problem
    if mode is None:  # a stream of a block coded by column: rows as _Heads.col_lanes
        block, k, at = lane[4], lane[5], f"after its {j} codes" if code >= 3 else f"at code {j}"
    else:
        block, k, at = lane[5], lane[6], f"after its {j} elements" if code >= 3 else f"at element {j} of its segment"
    problem = _PROBLEMS.get(code, f"fails check {code}")
    return f"{batch.where(int(block))} is corrupt: its exp-huf stream {k} {problem} ({at})"


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
    fields = [arr[:, 2], arr[:, 3], arr[:, 4], arr[:, 5] * SYMBOLS, table_first[arr[:, 5]]]
    return np.ascontiguousarray(np.stack([*_positions(arr, 5 if width == 2 else 6), *fields]))


def _positions(lanes: np.ndarray, log_word: int) -> list[np.ndarray]:
    """The first rows of a descriptor of ``lanes`` (rows starting with bit, end bit): each
    stream's first word, and its bit and end bit counted from that word."""
    first_word = lanes[:, 0] >> log_word
    base = first_word << log_word
    return [first_word, lanes[:, 0] - base, lanes[:, 1] - base]


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


__all__ = ["LANES", "Staging", "decode_records", "decode_tables"]
