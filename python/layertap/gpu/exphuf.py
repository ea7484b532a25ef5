"""The encoder of codec ``exp-huf`` (docs/FORMAT.md, "Codec 3") in torch operations, so that it
runs where the hidden states are: on the GPU, before the copy to the host (issue 21).

It writes blocks coded by element (mode 1) with the Rust encoder's choices and the Rust core's
code lengths: the bytes of ``_native.exphuf_encode(raw, by="element")``, which the tests check on
the CPU, so what the GPU writes is defined by a reference that runs without a GPU. Without the
native module the Python builder may break ties in Huffman trees differently (still a valid
block, not the same bytes).

Why exp-huf and not one of nvCOMP's codecs: on real activations it is the best ratio we have
(1.543 against bp16-zstd's 1.453 on the CPU), both readers read it already, and its work is
whole-array arithmetic that a GPU does well; nvCOMP's zstd and gzip streams need records cut
into many chunks to run fast, and its fast ANS stream is its own format (benches/RESULTS.md,
2026-12-02).

Per pass the host waits for the device twice, asleep on a blocking event: for the symbol counts
(the code lengths are built on the host) and for the streams' bit lengths (the output's layout).
Nothing else reads back (but the mask that drops the streams of a tensor coded larger than its
bytes, rare): no boolean mask, ``bincount`` or ``.item()``, each a wait with the thread spinning
for as long as the GPU, shared with the model, takes (``benches/gpu/bench_gpu_exphuf.py``).

The device work has two implementations (``impl``, the same bytes): ``"triton"``, four Triton
kernels (``exphuf_triton``), the default where Triton imports and the tensors are on CUDA (or
under ``TRITON_INTERPRET=1``); ``"torch"``, about 90 torch operations (``_TorchPass``).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch

from layertap._py import exphuf as _py_exphuf
from layertap._py.exphuf import MIN_CODED, STREAMS, block_head, contexts_of_top
from layertap._spec.exphuf import CODED, MAX_CONTEXTS, MODE_RAW, SYMBOLS, reversed_codes
from layertap.errors import InvalidInputError
from layertap.gpu.device_copies import to_device, to_host

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


def code_lengths(hist: np.ndarray) -> np.ndarray:
    """Code lengths (uint8) of each row of symbol counts ``hist`` (``[k, 512]``), from the Rust
    core (a few microseconds a table; the Python builder takes about 2 ms)."""
    try:
        from layertap._native import exphuf_code_lengths
    except ImportError:  # the extension is not built
        return np.array([_py_exphuf.code_lengths(h) for h in hist], dtype=np.uint8)
    if hist.dtype not in (np.dtype("<u4"), np.dtype("<i4")):
        hist = hist.astype("<u4")
    got = exphuf_code_lengths(np.ascontiguousarray(hist).view("<u4").tobytes())
    return np.frombuffer(got, dtype=np.uint8).reshape(hist.shape)


def reversed_codes_of(lengths: np.ndarray) -> np.ndarray:
    """The canonical codes (RFC 1951, 3.2.2) of each row of code lengths, bit-reversed as
    ``_spec.exphuf.reversed_codes`` gives them, for all rows at once: from the Rust core where
    it is built, else from that reference (without the extension the code lengths, 2 ms a table
    in Python, cost far more)."""
    try:
        from layertap._native import exphuf_reversed_codes
    except ImportError:
        return np.array([reversed_codes(row) for row in np.asarray(lengths).tolist()], dtype=np.uint16)
    got = exphuf_reversed_codes(np.ascontiguousarray(lengths, dtype=np.uint8).tobytes())
    return np.frombuffer(got, dtype="<u2").reshape(np.shape(lengths))


def encode_block(t: torch.Tensor, dtype: str, impl: str | None = None, tables: str | None = None) -> Block:
    """The exp-huf block of tensor ``t`` (elements of ``dtype``'s size, one of ``BF16``, ``F16``,
    ``F32``; the shape sets the stride), on ``t``'s device. ``impl``: ``"triton"`` or ``"torch"``
    (``default_impl``); ``tables``: where the code tables are built, ``"host"`` (the Rust core,
    from the counts read back) or ``"device"`` (``impl="triton"`` only; the same tables)."""
    return encode_blocks([t], dtype, impl, tables)[0]


def encode_blocks(
    tensors: list[torch.Tensor], dtype: str, impl: str | None = None, tables: str | None = None
) -> list[Block]:
    """The exp-huf blocks of several tensors of one dtype, on their device, in one pass: the same
    kernels whatever the count, two small copies to the host (one with ``tables="device"``). The
    bodies are views of one buffer."""
    return _encode(tensors, dtype, contiguous=False, impl=impl, tables=tables)


def encode_contiguous(
    tensors: list[torch.Tensor], dtype: str, impl: str | None = None, tables: str | None = None
) -> tuple[torch.Tensor, list[int]]:
    """The exp-huf blocks of several tensors of one dtype, back to back in one uint8 tensor on
    their device (heads included), and each block's length: what the connector copies to the
    host in one copy (``compress_on="gpu"``). The same bytes as ``encode_blocks``."""
    return _encode(tensors, dtype, contiguous=True, impl=impl, tables=tables)


IMPLS = ("triton", "torch")
TABLES = ("host", "device")
#: Where the code tables are built unless ``tables`` says: on the host until the device's
#: builder has been measured on the GPU.
DEFAULT_TABLES = "host"


def default_impl(device: torch.device) -> str:
    """``"triton"`` where Triton imports and the tensors are on CUDA (or under Triton's interpreter,
    ``TRITON_INTERPRET=1``: the tests); ``"torch"`` otherwise (vLLM's CPU build has no Triton)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "torch"
    return "triton" if _triton_imports() else "torch"


@functools.cache
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class _Layout:
    """Where the coded tensors' elements lie in the flat array the device pass reads (host arrays)."""

    ns: np.ndarray  # elements of each coded tensor
    base: np.ndarray  # each tensor's first element
    seg_start: np.ndarray  # each segment's first element: STREAMS segments a tensor, in order
    seg_stride: np.ndarray  # each segment's stride (its tensor's; 0: no context)
    step: np.ndarray  # the sample that picks each tensor's contexts: every step-th element
    total: int


def _encode(tensors: list[torch.Tensor], dtype: str, contiguous: bool, impl: str | None, tables: str | None = None):
    width, exp_shift = CODED[dtype]
    for t in tensors:
        if t.element_size() != width:
            raise InvalidInputError(
                f"a {dtype} block needs {width}-byte elements, not {t.element_size()}-byte {t.dtype}"
            )
    if impl is not None and impl not in IMPLS:
        raise InvalidInputError(f"impl {impl!r} is not one of {', '.join(IMPLS)}")
    if tables is not None and tables not in TABLES:
        raise InvalidInputError(f"tables {tables!r} is not one of {', '.join(TABLES)}")
    tensors = [t.contiguous() for t in tensors]
    coded = [(i, t) for i, t in enumerate(tensors) if t.numel() >= MIN_CODED]
    heads: list[bytes] = [bytes([MODE_RAW])] * len(tensors)
    """Each block's head; a raw block is its mode byte, then the tensor's bytes."""
    body_len = [t.numel() * width for t in tensors]
    if not coded:
        return _assemble(tensors, heads, body_len, {}, None, contiguous)
    device = coded[0][1].device
    impl = impl or default_impl(device)
    if impl == "triton" and not _triton_imports():
        raise InvalidInputError('impl="triton" needs the triton package, which does not import here; use impl="torch"')
    if tables == "device" and impl != "triton":
        raise InvalidInputError('tables="device" needs impl="triton" (the torch operations read the counts back)')
    tables = tables or (DEFAULT_TABLES if impl == "triton" else "host")
    ns = np.array([t.numel() for _, t in coded], dtype=np.int64)
    strides = [t.shape[-1] if t.dim() >= 2 and t.shape[-1] < t.numel() else 0 for _, t in coded]
    base = np.concatenate([[0], np.cumsum(ns)[:-1]]).astype(np.int64)
    layout = _Layout(
        ns=ns,
        base=base,
        seg_start=np.array([b + k * n // STREAMS for b, n in zip(base, ns) for k in range(STREAMS)], dtype=np.int64),
        seg_stride=np.repeat(np.array(strides, dtype=np.int64), STREAMS),
        step=np.maximum(ns // 4096, 1),
        total=int(ns.sum()),
    )
    x = torch.cat([t.reshape(-1) for _, t in coded])
    if impl == "triton":
        from layertap.gpu.exphuf_triton import TritonPass

        work = TritonPass(x, layout, width, exp_shift, device)
    else:
        work = _TorchPass(x, layout, width, exp_shift, device)
    del x

    counts, mode = work.counts()
    if tables == "device":
        # The code tables built where the counts are; one copy to the host: each stream's bit
        # length (which sets the layout of the output), the code lengths and modes (the heads).
        seg_bits, lengths, modes = to_host(work.stream_bits_device_tables(counts), work.lengths_t, mode)
        lengths = lengths.numpy().reshape(len(ns), MAX_CONTEXTS, SYMBOLS)
    else:
        # First copy to the host: the counts of each tensor's contexts, for its code lengths.
        hist, modes = to_host(counts, mode)
        lengths = code_lengths(hist.numpy().reshape(-1, SYMBOLS)).reshape(len(ns), MAX_CONTEXTS, SYMBOLS)
        codes = reversed_codes_of(lengths.reshape(-1, SYMBOLS))
        # Second copy: each stream's bit length, which sets the layout of the output.
        (seg_bits,) = to_host(work.stream_bits(lengths, codes))
    modes = modes.numpy()
    seg_bytes = (seg_bits.numpy() + 7) // 8

    # Each coded tensor's head, and whether its block is coded at all (not if raw is smaller).
    # (The layout is whole-array arithmetic over the tensors: a batch holds hundreds.)
    coded_heads = _coded_heads(dtype, exp_shift, strides, modes, lengths, seg_bytes)
    seg_bytes = seg_bytes.reshape(-1, STREAMS).astype(np.int64)
    streams_len = seg_bytes.sum(1)
    head_len = np.fromiter(map(len, coded_heads), dtype=np.int64, count=len(coded_heads))
    ok = head_len + streams_len < 1 + ns * width
    coded_at = np.array([i for i, _ in coded], dtype=np.int64)  # each coded tensor's index
    for j in np.flatnonzero(ok).tolist():
        i = int(coded_at[j])
        heads[i], body_len[i] = coded_heads[j], int(streams_len[j])
    sizes = np.fromiter(map(len, heads), dtype=np.int64, count=len(heads)) + np.array(body_len, dtype=np.int64)
    block_at = np.cumsum(sizes) - sizes
    # Where each tensor's streams go: with `contiguous`, into its block's place in the output
    # (after its head); else the coded tensors' streams back to back.
    if contiguous:
        body_start = block_at[coded_at] + head_len
        end = int(sizes.sum())
    else:
        kept = np.where(ok, streams_len, 0)
        body_start = np.cumsum(kept) - kept
        end = int(kept.sum())
    # Each stream's first byte in the output; -1 for the streams of a tensor stored raw after
    # all, which are not written.
    seg_base = np.where(ok[:, None], body_start[:, None] + np.cumsum(seg_bytes, 1) - seg_bytes, -1).reshape(-1)
    body_at = dict(zip(coded_at[ok].tolist(), body_start[ok].tolist()))
    packed = work.pack(seg_base, end)
    return _assemble(tensors, heads, body_len, body_at, packed, contiguous)


class _TorchPass:
    """The device work in torch operations (about 90 a pass): what runs without Triton."""

    def __init__(self, x: torch.Tensor, layout: _Layout, width: int, exp_shift: int, device: torch.device):
        self.layout, self.width, self.exp_shift, self.device = layout, width, exp_shift, device
        self.raw_bits = 8 * width - 9
        # The elements' bit patterns as int64, non-negative.
        self.x = x.view(torch.int16 if width == 2 else torch.int32).to(torch.int64) & ((1 << (8 * width)) - 1)

    def counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The counts (int32) of each (tensor, context, symbol) cell, and each tensor's mode."""
        layout, device, exp_shift = self.layout, self.device, self.exp_shift
        ns, base, step, total = layout.ns, layout.base, layout.step, layout.total
        count = len(ns)
        # The intermediates are int64 per element (about 8 live at the peak, 64 bytes an element):
        # each is dropped as soon as it is used, which bounds the encoder's memory.
        top = self.x >> self.raw_bits
        idx = torch.arange(total, device=device)
        seg_start_t = to_device(layout.seg_start, device)
        # Each element's segment and tensor, as running counts of the segment starts passed (a
        # tensor of at least MIN_CODED elements has STREAMS non-empty segments, in order): a
        # cumulative sum, where repeat_interleave or a search cost several times more on the GPU.
        marks = torch.zeros(total, dtype=torch.int64, device=device)
        marks[seg_start_t[1:]] = 1
        seg = torch.cumsum(marks, 0)
        del marks
        rec = seg // STREAMS
        # The sample's elements by their places: how many each tensor has is known on the host,
        # so nothing is read back (a boolean mask would read its count back, a synchronisation).
        per = -(-ns // step)
        first = np.concatenate([[0], np.cumsum(per)[:-1]])
        of = torch.repeat_interleave(
            torch.arange(count, device=device), to_device(per, device), output_size=int(per.sum())
        )
        k = torch.arange(int(per.sum()), device=device)
        sample = to_device(base, device)[of] + (k - to_device(first, device)[of]) * to_device(step, device)[of]
        del of, k
        exps = _counts(rec[sample] * 256 + ((top[sample] & 0xFF) >> exp_shift), count * 256).reshape(-1, 256)
        del sample
        mode = 255 - exps.flip(1).argmax(1)  # the last of tied counts, as the Rust encoder
        tt = torch.arange(SYMBOLS, device=device)
        ctx_of_top = (tt[None] >> 8) * 8 | (torch.clamp(((tt[None] & 0xFF) >> exp_shift) - mode[:, None], -4, 3) & 7)
        # Each element's context: that of the element `stride` before it in its segment, if any.
        stride_of = to_device(layout.seg_stride, device)[seg]
        has_ctx = (stride_of > 0) & (idx - seg_start_t[seg] >= stride_of)
        prev = torch.where(has_ctx, idx - stride_of, idx)
        del idx, stride_of
        ctx = torch.where(has_ctx, ctx_of_top.reshape(-1)[rec * SYMBOLS + top[prev]], 0)
        del has_ctx, prev
        sym = ((top & 0xFF) << 1) | (top >> 8)
        del top
        self.cell = (rec * MAX_CONTEXTS + ctx) * SYMBOLS + sym
        self.seg, self.seg_start_t = seg, seg_start_t
        del rec, ctx, sym
        return _counts(self.cell, count * MAX_CONTEXTS * SYMBOLS).to(torch.int32), mode

    def stream_bits(self, lengths: np.ndarray, codes: np.ndarray) -> torch.Tensor:
        """Each stream's length in bits (int64, on the device), from the code tables."""
        device, raw_bits, cell = self.device, self.raw_bits, self.cell
        # The tables go to the device as they are (uint8 lengths, 11-bit codes as int16: a sixth
        # of the bytes of int64) and are widened there.
        len_of_cell = to_device(lengths.reshape(-1), device).to(torch.int64)
        length = len_of_cell[cell]
        code_of_cell = to_device(codes.reshape(-1).view(np.int16), device).to(torch.int64)
        self.values = code_of_cell[cell] | (self.x & ((1 << raw_bits) - 1)) << length
        del self.cell, self.x
        self.nbits = length + raw_bits
        del length
        # (A stream's bits are a difference of running sums: an index_add_ into a few segments
        # serialises on its atomics.)
        self.ends = torch.cumsum(self.nbits, 0)
        ends0 = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), self.ends])
        seg_end_t = torch.cat([self.seg_start_t[1:], to_device(np.array([self.layout.total], dtype=np.int64), device)])
        self.before = ends0[self.seg_start_t]
        return ends0[seg_end_t] - self.before

    def pack(self, seg_base: np.ndarray, end: int) -> torch.Tensor:
        """The output's first ``end`` bytes: each stream at ``seg_base`` (its first byte; -1: not
        written), 0 elsewhere."""
        seg, values, nbits = self.seg, self.values, self.nbits
        offset = self.ends - nbits - self.before[seg] + 8 * to_device(seg_base, self.device)[seg]
        del self.ends
        if (seg_base < 0).any():
            # Tensors stored raw after all: their streams are not written (the packing needs the
            # streams in the order of the output).
            keep = to_device(seg_base >= 0, self.device)[seg]
            values, offset, nbits = values[keep], offset[keep], nbits[keep]
        del self.seg, self.values, self.nbits
        return _pack(values, offset, nbits, 8 * end, self.raw_bits + 1)


def _coded_heads(dtype, exp_shift, strides, modes, lengths, seg_bytes) -> list[bytes]:
    """The head of each coded tensor's block (everything before its streams): written by the
    Rust core, as its own encoder writes them, in one call for the batch; without the extension,
    by the pure-Python writer's ``block_head`` (about 0.2 ms a tensor)."""
    try:
        from layertap._native import exphuf_coded_heads
    except ImportError:
        rows = np.asarray(seg_bytes).reshape(-1, STREAMS).tolist()
        return [
            bytes(block_head(stride, contexts_of_top(int(mode), exp_shift), ln, row))
            for stride, mode, ln, row in zip(strides, modes, lengths, rows)
        ]
    lengths = np.ascontiguousarray(lengths, dtype=np.uint8).tobytes()
    modes = np.asarray(modes, dtype=np.uint8).tolist()
    return exphuf_coded_heads(dtype, strides, modes, lengths, np.asarray(seg_bytes, dtype=np.uint64).tolist())


def _assemble(tensors, heads, body_len, body_at, packed, contiguous):
    """The blocks out of the packed streams: ``Block``s (bodies are views), or with
    ``contiguous`` one buffer with every head written in its place and each raw block's bytes
    copied in."""
    if not contiguous:
        raw = [t.reshape(-1).view(torch.uint8) for t in tensors]
        bodies = [packed[body_at[i] : body_at[i] + n] if i in body_at else raw[i] for i, n in enumerate(body_len)]
        return [Block(head, body) for head, body in zip(heads, bodies)]
    head_len = np.fromiter(map(len, heads), dtype=np.int64, count=len(heads))
    sizes = head_len + np.array(body_len, dtype=np.int64)
    block_at = np.cumsum(sizes) - sizes
    end = int(sizes.sum())
    sizes = sizes.tolist()
    device = tensors[0].device if tensors else torch.device("cpu")
    buf = packed[:end] if packed is not None else torch.zeros(end, dtype=torch.uint8, device=device)
    for i, t in enumerate(tensors):
        if i not in body_at:  # a raw block: its mode byte (a head) and the tensor's bytes
            at = int(block_at[i]) + 1
            buf[at : at + body_len[i]].copy_(t.reshape(-1).view(torch.uint8))
    if not tensors:
        return buf, sizes
    # Every head in one small copy to the device and one scatter.
    where = np.arange(int(head_len.sum()), dtype=np.int64) + np.repeat(
        block_at - (np.cumsum(head_len) - head_len), head_len
    )
    head_bytes = np.frombuffer(b"".join(heads), dtype=np.uint8)
    buf[to_device(where, device)] = to_device(head_bytes.copy(), device)
    return buf, sizes


def _counts(index: torch.Tensor, n: int) -> torch.Tensor:
    """``torch.bincount(index, minlength=n)`` for indices in ``[0, n)``, without reading anything
    back: CUDA's bincount copies the indices' min and max to the host to size its output, a wait
    with the thread spinning for as long as the GPU, shared with the model, takes to get there."""
    out = torch.zeros(n, dtype=torch.int64, device=index.device)
    return out.scatter_add_(0, index, torch.ones(1, dtype=torch.int64, device=index.device).expand(index.shape))


def _pack(
    values: torch.Tensor, offset: torch.Tensor, nbits: torch.Tensor, total_bits: int, min_bits: int
) -> torch.Tensor:
    """The bytes of a bit string of ``total_bits`` bits (a multiple of 8) in which value ``i``
    (``nbits[i]`` bits, at least ``min_bits``) starts at bit ``offset[i]``, least significant
    bit first (``offset`` ascending, no overlaps; other bits 0). Each 16-bit word gathers the
    values that overlap it (a binary search over their ends, then the next few): no scatter,
    whose atomics collide when neighbouring values share a word."""
    device = values.device
    n_words = (total_bits + _WORD_BITS - 1) // _WORD_BITS
    words = torch.zeros(n_words, dtype=torch.int64, device=device)
    if values.numel() and n_words:
        ends = offset + nbits
        lo = torch.arange(n_words, device=device) * _WORD_BITS
        first = torch.searchsorted(ends, lo, right=True)  # the first value ending past the word's start
        last = values.numel() - 1
        # Values that can overlap one word: those starting in it, and one started before.
        for k in range(-(-_WORD_BITS // min_bits) + 1):
            j = first + k
            at = torch.clamp(j, max=last)
            rel = offset[at] - lo  # where the value starts, relative to the word
            v = values[at]
            part = torch.where(rel >= 0, v << rel.clamp(0, _WORD_BITS), v >> (-rel).clamp(0, 63))
            words |= torch.where((j <= last) & (rel < _WORD_BITS), part & 0xFFFF, 0)
    out = torch.stack([words & 0xFF, words >> 8], dim=1).reshape(-1).to(torch.uint8)
    return out[: total_bits // 8]
