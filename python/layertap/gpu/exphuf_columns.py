"""The Triton kernels that decode exp-huf blocks coded by column (docs/FORMAT.md, "Codec 3",
"Mode 2"; what the Rust writer writes since 2026-12-05), and their launches. The host side (the
heads parsed by the Rust core, the tables, a lane's problem reported) is ``exphuf_decode``'s,
shared with mode 1; these kernels share nothing with mode 1's but the way a stream's bits are
read (``stream_lanes``, ``check_stream_ends``).

Where the parallelism is. A mode-2 stream is a chain in which a code's table is picked by the
symbol of the code before it, and nothing else (no element ``d`` back, no raw bits between the
codes). The writers cut a block into 4 streams a 32,768 elements, so a 64-record batch of an 8B
model's ``[256, layers, 4096]`` records gives tens of thousands of streams: one lane a stream,
lanes ordered by their block's longest stream (a block's streams differ by a column at most).

``_streams_kernel`` stores each code's top 9 bits in stream order. Its table entries
(``chain_tables``) hold the next context beside the top and the length, so a step's chain is one
load and a few integer operations (47 instructions for sm_90); the price is int32 tables, twice
mode 1's int16: which costs more, that or a context-map load in the chain, is for the GPU to say.
``_merge_kernel`` then puts each element's top (a gather from the column-major tops) beside its
raw bits, stored in row-major order: coalesced stores and plane reads, the transposition on the
small int16 tops.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

#: Elements a program of the merge kernel puts together.
MERGE_BLOCK = 1024
#: Bits of a context's table index, and the shift of the next context in a table entry.
TABLE_LEN = 2048
_CTX_SHIFT = 13


# What both decoding kernels (this module's streams kernel, exphuf_decode's mode-1 kernel) do
# alike with a lane's stream: the first rows of its descriptor, and the checks at its end.


@triton.jit
def stream_lanes(words_ptr, desc_ptr, out_ptr, lanes, LANES: tl.constexpr, POS64: tl.constexpr):
    # A program's lanes, and from each one's descriptor rows 0-4: its stream's first word as a
    # pointer, its bit and end bit counted from that word (int32 unless POS64), its output as a
    # pointer, and its count of elements.
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    live = lane < lanes
    wp = words_ptr + tl.load(desc_ptr + lane, mask=live, other=0)
    bit = tl.load(desc_ptr + lanes + lane, mask=live, other=0)
    end = tl.load(desc_ptr + 2 * lanes + lane, mask=live, other=0)
    if not POS64:
        bit = bit.to(tl.int32)
        end = end.to(tl.int32)
    op = out_ptr + tl.load(desc_ptr + 3 * lanes + lane, mask=live, other=0)
    count = tl.load(desc_ptr + 4 * lanes + lane, mask=live, other=0).to(tl.int32)
    return lane, live, wp, bit, end, op, count


@triton.jit
def check_stream_ends(wp, bit, end, count, status, where, status_ptr, lane, lanes, live, WORD: tl.constexpr):
    # A lane whose decode met no problem: its stream takes exactly ceil(bits / 8) bytes, and the
    # bits after its last code are 0 (read in WORD-bit words). Then every lane's status and
    # where it was met are stored.
    LOG_WORD: tl.constexpr = 5 if WORD == 32 else 6
    UWORD: tl.constexpr = tl.uint32 if WORD == 32 else tl.uint64
    done = live & (status == 0)
    too_long = done & (((bit + 7) >> 3) != (end >> 3))
    tail = done & ~too_long & ((bit & 7) != 0)
    last = tl.load(wp + (bit >> LOG_WORD), mask=tail, other=0).to(UWORD, bitcast=True)
    padding = (last >> (bit & (WORD - 1)).to(UWORD)) & ((1 << (8 - (bit & 7))) - 1).to(UWORD)
    bad_padding = tail & (padding != 0)
    status = tl.where(too_long, 3, tl.where(bad_padding, 4, status))
    where = tl.where(too_long | bad_padding, count, where)
    tl.store(status_ptr + lane, status, mask=live)
    tl.store(status_ptr + lanes + lane, where, mask=live)


@triton.jit
def _streams_kernel(
    words_ptr,  # int32 words of the payloads' device copy
    tables_ptr,  # int32 chain tables: next context << 13 | top9 << 4 | code length, 0 no code
    tops_ptr,  # int16 out: each stream's tops, in stream order
    desc_ptr,  # int64 [6, lanes]: first word, bit, end bit (both from the first word), tops
    # start, count, the block's table 0
    status_ptr,  # int32 [2, lanes]: problem (0 none), element where it was met
    lanes,
    LANES: tl.constexpr,
    POS64: tl.constexpr,  # bit positions in int64: a stream of 2^31 bits or more
):
    lane, live, wp, bit, end, op, count = stream_lanes(words_ptr, desc_ptr, tops_ptr, lanes, LANES, POS64)
    table0 = tl.load(desc_ptr + 5 * lanes + lane, mask=live, other=0).to(tl.int32)
    status = tl.zeros([LANES], dtype=tl.int32)
    where = tl.zeros([LANES], dtype=tl.int32)
    steps = tl.max(count, axis=0)
    table = table0  # element 0's context: 0
    lo = tl.load(wp + (bit >> 5), mask=live, other=0).to(tl.uint32, bitcast=True)
    hi = tl.load(wp + (bit >> 5) + 1, mask=live, other=0).to(tl.uint32, bitcast=True)
    for j in range(0, steps):
        active = (j < count) & (status == 0)
        w = bit >> 5
        s = (bit & 31).to(tl.uint32)
        # The word after the two held, loaded beside the entry: a step moves on one word at most.
        after = tl.load(wp + w + 2, mask=active, other=0).to(tl.uint32, bitcast=True)
        word = (lo >> s) | ((hi << 1) << (31 - s))  # no shift by 32
        entry = tl.load(tables_ptr + table + (word & 2047).to(tl.int32), mask=active, other=0)
        length = entry & 15
        nbit = bit + length
        no_code = active & (length == 0)
        past_end = active & (length > 0) & (nbit > end)
        ok = active & (length > 0) & (nbit <= end)
        tl.store(op + j, ((entry >> 4) & 511).to(tl.int16), mask=ok)
        status = tl.where(no_code, 1, tl.where(past_end, 2, status))
        where = tl.where(no_code | past_end, j, where)
        step = ok & ((nbit >> 5) != w)
        lo = tl.where(step, hi, lo)
        hi = tl.where(step, after, hi)
        bit = tl.where(ok, nbit, bit)
        table = table0 + (entry >> 13) * 2048
    check_stream_ends(wp, bit, end, count, status, where, status_ptr, lane, lanes, live, 32)


@triton.jit
def _merge_kernel(
    words_ptr,  # int32 words of the payloads' device copy
    tops_ptr,  # int16: the tops _streams_kernel stored
    out_ptr,  # int16 or int32 elements
    job_ptr,  # int64 [7, programs]: raw plane's bit, tops start, out start, n, columns, rows,
    # first element
    programs,
    RAW_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    p = tl.program_id(0)
    plane = tl.load(job_ptr + p)
    tops0 = tl.load(job_ptr + programs + p)
    out0 = tl.load(job_ptr + 2 * programs + p)
    n = tl.load(job_ptr + 3 * programs + p)
    columns = tl.load(job_ptr + 4 * programs + p)
    rows = tl.load(job_ptr + 5 * programs + p)
    i = tl.load(job_ptr + 6 * programs + p) + tl.arange(0, BLOCK).to(tl.int64)
    m = i < n
    row = i // columns
    col = i - row * columns
    top = tl.load(tops_ptr + tops0 + col * rows + row, mask=m, other=0).to(tl.int32)
    top = (top << 23) >> 23  # the top 9 bits sign-extended: x fits the signed output type
    at = plane + i * RAW_BITS
    w = at >> 5
    s = (at & 31).to(tl.uint32)
    lo = tl.load(words_ptr + w, mask=m, other=0).to(tl.uint32, bitcast=True)
    hi = tl.load(words_ptr + w + 1, mask=m, other=0).to(tl.uint32, bitcast=True)
    raw = ((lo >> s) | ((hi << 1) << (31 - s))) & ((1 << RAW_BITS) - 1)
    x = (top << RAW_BITS) | raw.to(tl.int32)
    tl.store(out_ptr + out0 + i, x.to(out_ptr.dtype.element_ty), mask=m)


def chain_tables(tables: torch.Tensor, ctx_of_top: torch.Tensor) -> torch.Tensor:
    """The streams kernel's ``[T, 2048]`` int32 tables from the mode-1 decoder's (``tables``,
    ``[T, 2048]`` int16 ``top9 << 4 | length``) and, per table, the context each top 9 bits give
    in its block (``ctx_of_top``, ``[T, 512]``, any integer dtype): the next context put in each entry."""
    entries = tables.to(torch.int32)
    top = ((entries >> 4) & 511).long()
    ctx = torch.gather(ctx_of_top, 1, top).to(torch.int32)
    return torch.where(entries != 0, (ctx << _CTX_SHIFT) | entries, 0)


def launch_streams(words, tables, tops, desc, pos64: bool, lanes_per_program: int) -> torch.Tensor:
    """Runs the streams kernel over the lanes ``desc`` describes; returns their ``[2, lanes]`` statuses."""
    lanes = desc.shape[1]
    status = torch.empty((2, lanes), dtype=torch.int32, device=tops.device)
    _streams_kernel[(triton.cdiv(lanes, lanes_per_program),)](
        words, tables, tops, desc, status, lanes, LANES=lanes_per_program, POS64=pos64,
        num_warps=max(1, lanes_per_program // 32), num_stages=1,
    )  # fmt: skip
    return status


def merge_jobs(blocks: np.ndarray) -> np.ndarray:
    """The merge kernel's ``[7, programs]`` int64 jobs for ``blocks`` (rows of raw plane's bit,
    tops start, out start, n, columns, rows): ``MERGE_BLOCK`` elements a program."""
    per = -(-blocks[:, 3] // MERGE_BLOCK)
    jobs = np.repeat(blocks, per, axis=0)
    first = np.arange(int(per.sum())) - np.repeat(np.cumsum(per) - per, per)
    return np.ascontiguousarray(np.concatenate([jobs, (first * MERGE_BLOCK)[:, None]], 1).T)


def launch_merge(words, tops, out, jobs, width: int) -> None:
    """Runs the merge kernel over the jobs ``merge_jobs`` made."""
    programs = jobs.shape[1]
    if programs:
        _merge_kernel[(programs,)](
            words, tops, out, jobs, programs, RAW_BITS=8 * width - 9, BLOCK=MERGE_BLOCK, num_warps=4
        )


__all__ = ["MERGE_BLOCK", "chain_tables", "launch_merge", "launch_streams", "merge_jobs"]
