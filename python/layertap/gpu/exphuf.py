"""The encoder of codec ``exp-huf`` (docs/FORMAT.md, "Codec 3") in torch operations, so that it
runs where the hidden states are: on the GPU, before the copy to the host (issue 21).

It writes blocks coded by element (block mode 1), with the Rust encoder's choices for them
(rust/core/src/exphuf/block_encode.rs: 4 streams, 16 contexts around the sample's most common
exponent, the last one where counts tie, stride = the tensor's last dimension), and takes its
code lengths from the Rust core, so it emits the bytes of the Rust encoder asked for that layout
(``_native.exphuf_encode(raw, by="element")``; the Rust writer itself codes by column, mode 2),
which the tests check on the CPU: what the GPU writes is defined byte for byte
by a reference that runs without a GPU, and every reader of exp-huf reads it. Without the native
module the code lengths come from the pure-Python writer's builder, which may break ties in
Huffman trees differently (still a valid block, not the same bytes).

Why exp-huf and not one of nvCOMP's codecs: on real activations it is the best ratio we have
(1.543 against bp16-zstd's 1.453 on the CPU), it is already specified and read by both readers,
and its work is whole-array arithmetic (counts, a table lookup, prefix sums of bit lengths, a
scatter of bits) that a GPU does well; nvCOMP's standard streams (zstd, gzip) decode on the CPU
but need records cut into many chunks to run fast, and its fast ANS stream is its own format
(benches/RESULTS.md, 2026-12-02).

Per pass the encoder waits for the device twice, each time asleep on a blocking event: for the
symbol counts (64 KiB a tensor), whose code lengths are built on the host as the CPU encoders
build them, and for the streams' bit lengths, which set the output's layout. Nothing else reads
back from the device (but for a tensor whose coded block comes out larger than its bytes, rare,
whose streams a boolean mask drops): no boolean mask (its count), no ``bincount`` (its min and
max), no ``.item()``, each of which would wait with the thread spinning for as long as the GPU,
shared with the model, takes (``benches/gpu/bench_gpu_exphuf.py`` counts them: ``host_syncs``).
The packed streams stay on the device until the caller copies the block out.

The host part (the plans, the tables, the heads, raw or coded, the layout) is one; the device
work has two implementations, chosen by ``impl``: ``"triton"``, four Triton kernels
(``layertap.gpu.exphuf_triton``), the default where Triton imports and the tensors are on CUDA
(or under Triton's interpreter, ``TRITON_INTERPRET=1``); ``"torch"``, about 90 torch operations
(``_TorchPass``), everywhere else. Both give the same bytes (tests/test_triton_exphuf_encoder.py).
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from layertap._py import exphuf as _py_exphuf
from layertap._py.exphuf import MIN_CODED, STREAMS, block_head, contexts_of_top
from layertap._spec.exphuf import CODED, MAX_CODE_LEN, MAX_CONTEXTS, MODE_RAW, SYMBOLS
from layertap.errors import InvalidInputError

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


def _native():
    """The extension's exp-huf pieces, or None where it is not built (the pure-Python writer's
    builders then stand in)."""
    try:
        from layertap._native import exphuf_code_lengths, exphuf_coded_heads, exphuf_reversed_codes
    except ImportError:
        return None
    return SimpleNamespace(
        exphuf_code_lengths=exphuf_code_lengths,
        exphuf_coded_heads=exphuf_coded_heads,
        exphuf_reversed_codes=exphuf_reversed_codes,
    )


def code_lengths(hist: np.ndarray) -> np.ndarray:
    """Code lengths (uint8) of each row of symbol counts ``hist`` (``[k, 512]``), from the Rust
    core (a few microseconds a table; the Python builder takes about 2 ms). Counts given as
    ``<u4`` or ``<i4`` (the encoder's, non-negative) are not converted first."""
    native = _native()
    if native is None:
        return np.array([_py_exphuf.code_lengths(h) for h in hist], dtype=np.uint8)
    if hist.dtype not in (np.dtype("<u4"), np.dtype("<i4")):
        hist = hist.astype("<u4")
    got = native.exphuf_code_lengths(np.ascontiguousarray(hist).view("<u4").tobytes())
    return np.frombuffer(got, dtype=np.uint8).reshape(hist.shape)


def reversed_codes_of(lengths: np.ndarray) -> np.ndarray:
    """The canonical codes (RFC 1951, 3.2.2) of each row of code lengths, bit-reversed as
    ``_spec.exphuf.reversed_codes`` gives them, for all rows at once: from the Rust core where
    it is built (the numpy version below costs about 1 ms a record)."""
    native = _native()
    if native is None:
        return _reversed_codes_numpy(lengths).astype(np.uint16)
    got = native.exphuf_reversed_codes(np.ascontiguousarray(lengths, dtype=np.uint8).tobytes())
    return np.frombuffer(got, dtype="<u2").reshape(np.shape(lengths))


def _reversed_codes_numpy(lengths: np.ndarray) -> np.ndarray:
    """``reversed_codes_of`` without the extension."""
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


def encode_block(t: torch.Tensor, dtype: str, impl: str | None = None, tables: str | None = None) -> Block:
    """The exp-huf block of tensor ``t`` (a contiguous tensor whose element size is that of
    ``dtype``, one of ``BF16``, ``F16``, ``F32``; the shape sets the stride), on ``t``'s device.
    ``impl``: who does the device work, ``"triton"`` or ``"torch"`` (``default_impl``);
    ``tables``: where the code tables are built, ``"host"`` (the Rust core, from the counts read
    back) or ``"device"`` (Triton kernels, ``impl="triton"`` only; the same tables)."""
    return encode_blocks([t], dtype, impl, tables)[0]


def encode_blocks(
    tensors: list[torch.Tensor], dtype: str, impl: str | None = None, tables: str | None = None
) -> list[Block]:
    """The exp-huf blocks of several tensors of one dtype, on their (common) device, in one pass:
    the same kernels whatever the count, two small copies to the host (the symbol counts, then
    the streams' bit lengths; with ``tables="device"`` one: the bit lengths and the tables). The
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
    """``"triton"`` where Triton imports and the tensors are on CUDA (or on the CPU under Triton's
    interpreter, ``TRITON_INTERPRET=1``: the tests); ``"torch"`` otherwise (vLLM's CPU build has
    no Triton)."""
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
    """Where the coded tensors' elements lie in the flat array the device pass reads (the coded
    tensors back to back), as host arrays."""

    ns: np.ndarray
    """Elements of each coded tensor."""
    base: np.ndarray
    """Each tensor's first element."""
    seg_start: np.ndarray
    """Each segment's first element: STREAMS segments a tensor, in order."""
    seg_stride: np.ndarray
    """Each segment's stride (its tensor's; 0: no context)."""
    step: np.ndarray
    """The sample that picks each tensor's contexts: every ``step``-th element."""
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
    plans = []
    for _, t in coded:
        n, shape = t.numel(), tuple(t.shape)
        plans.append(_Plan(n=n, stride=shape[-1] if len(shape) >= 2 and shape[-1] < n else 0, mode=0))
    ns = np.array([p.n for p in plans], dtype=np.int64)
    base = np.concatenate([[0], np.cumsum(ns)[:-1]]).astype(np.int64)
    layout = _Layout(
        ns=ns,
        base=base,
        seg_start=np.array([b + k * n // STREAMS for b, n in zip(base, ns) for k in range(STREAMS)], dtype=np.int64),
        seg_stride=np.repeat(np.array([p.stride for p in plans], dtype=np.int64), STREAMS),
        step=np.maximum(ns // 4096, 1),
        total=int(ns.sum()),
    )
    x = torch.cat([t.reshape(-1) for _, t in coded])
    work = (_TritonPass if impl == "triton" else _TorchPass)(x, layout, width, exp_shift, device)
    del x

    counts, mode = work.counts()
    if tables == "device":
        # The code tables built where the counts are; one copy to the host: each stream's bit
        # length (which sets the layout of the output), the code lengths and modes (the heads).
        seg_bits, lengths, modes = _to_host(work.stream_bits_device_tables(counts), work.lengths_t, mode)
        lengths = lengths.numpy().reshape(len(plans), MAX_CONTEXTS, SYMBOLS)
    else:
        # First copy to the host: the counts of each tensor's contexts, for its code lengths.
        hist, modes = _to_host(counts, mode)
        lengths = code_lengths(hist.numpy().reshape(-1, SYMBOLS)).reshape(len(plans), MAX_CONTEXTS, SYMBOLS)
        codes = reversed_codes_of(lengths.reshape(-1, SYMBOLS))
        # Second copy: each stream's bit length, which sets the layout of the output.
        (seg_bits,) = _to_host(work.stream_bits(lengths, codes))
    modes = modes.numpy()
    seg_bytes = (seg_bits.numpy() + 7) // 8

    # Each coded tensor's head, and whether its block is coded at all (not if raw is smaller).
    # (The layout is whole-array arithmetic over the tensors: a batch holds hundreds.)
    coded_heads = _coded_heads(dtype, exp_shift, plans, modes, lengths, seg_bytes)
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
        self.x = _as_unsigned(x, width)

    def counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The counts (int32) of each (tensor, context, symbol) cell, and each tensor's mode."""
        layout, device, exp_shift = self.layout, self.device, self.exp_shift
        ns, base, step, total = layout.ns, layout.base, layout.step, layout.total
        count = len(ns)
        # The intermediates are int64 per element (about 8 live at the peak, 64 bytes an
        # element): each is dropped as soon as it is used, which is what bounds the encoder's
        # memory.
        top = self.x >> self.raw_bits
        idx = torch.arange(total, device=device)
        seg_start_t = _to_device(layout.seg_start, device)
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
            torch.arange(count, device=device), _to_device(per, device), output_size=int(per.sum())
        )
        k = torch.arange(int(per.sum()), device=device)
        sample = _to_device(base, device)[of] + (k - _to_device(first, device)[of]) * _to_device(step, device)[of]
        del of, k
        exps = _counts(rec[sample] * 256 + ((top[sample] & 0xFF) >> exp_shift), count * 256).reshape(-1, 256)
        del sample
        mode = 255 - exps.flip(1).argmax(1)  # the last of tied counts, as the Rust encoder
        tt = torch.arange(SYMBOLS, device=device)
        ctx_of_top = (tt[None] >> 8) * 8 | (torch.clamp(((tt[None] & 0xFF) >> exp_shift) - mode[:, None], -4, 3) & 7)
        # Each element's context: that of the element `stride` before it in its segment, if any.
        stride_of = _to_device(layout.seg_stride, device)[seg]
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
        len_of_cell = _to_device(lengths.reshape(-1), device).to(torch.int64)
        length = len_of_cell[cell]
        code_of_cell = _to_device(codes.reshape(-1).view(np.int16), device).to(torch.int64)
        self.values = code_of_cell[cell] | (self.x & ((1 << raw_bits) - 1)) << length
        del self.cell, self.x
        self.nbits = length + raw_bits
        del length
        # (A stream's bits are a difference of running sums: an index_add_ into a few segments
        # serialises on its atomics.)
        self.ends = torch.cumsum(self.nbits, 0)
        ends0 = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), self.ends])
        seg_end_t = torch.cat([self.seg_start_t[1:], _to_device(np.array([self.layout.total], dtype=np.int64), device)])
        self.before = ends0[self.seg_start_t]
        return ends0[seg_end_t] - self.before

    def pack(self, seg_base: np.ndarray, end: int) -> torch.Tensor:
        """The output's first ``end`` bytes: each stream at ``seg_base`` (its first byte; -1: not
        written), 0 elsewhere."""
        seg, values, nbits = self.seg, self.values, self.nbits
        offset = self.ends - nbits - self.before[seg] + 8 * _to_device(seg_base, self.device)[seg]
        del self.ends
        if (seg_base < 0).any():
            # Tensors stored raw after all: their streams are not written (the packing needs the
            # streams in the order of the output).
            keep = _to_device(seg_base >= 0, self.device)[seg]
            values, offset, nbits = values[keep], offset[keep], nbits[keep]
        del self.seg, self.values, self.nbits
        return _pack(values, offset, nbits, 8 * end, self.raw_bits + 1)


class _TritonPass:
    """The device work in four Triton kernels (``layertap.gpu.exphuf_triton`` says which and
    why)."""

    def __init__(self, x: torch.Tensor, layout: _Layout, width: int, exp_shift: int, device: torch.device):
        from layertap.gpu import exphuf_triton as kernels

        self.k, self.layout, self.width, self.exp_shift, self.device = kernels, layout, width, exp_shift, device
        self.raw_bits = 8 * width - 9
        self.x = x.view(torch.int16 if width == 2 else torch.int32)
        self.blocks = kernels.Blocks(
            layout.seg_start, layout.seg_stride, layout.total, kernels.BLOCK, lambda a: _to_device(a, device)
        )

    def counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        k, layout, count = self.k, self.layout, len(self.layout.ns)
        per_tensor = _to_device(np.concatenate([layout.base, layout.ns, layout.step]).astype(np.int64), self.device)
        mode, self.ctx = k.sample_contexts(
            self.x,
            per_tensor[:count],
            per_tensor[count : 2 * count],
            per_tensor[2 * count :],
            count,
            self.width,
            self.raw_bits,
            self.exp_shift,
        )
        counts = k.count_symbols(
            self.x,
            self.ctx,
            self.blocks,
            count,
            self.width,
            self.raw_bits,
            k.BLOCK,
        )
        return counts, mode

    def stream_bits(self, lengths: np.ndarray, codes: np.ndarray) -> torch.Tensor:
        self.lengths_t = _to_device(np.ascontiguousarray(lengths).reshape(-1), self.device)
        self.codes_t = _to_device(np.ascontiguousarray(codes).reshape(-1).view(np.int16), self.device)
        return self._stream_bits()

    def stream_bits_device_tables(self, counts: torch.Tensor) -> torch.Tensor:
        """``stream_bits`` with the tables built on the device from ``counts``."""
        self.lengths_t, self.codes_t = self.k.tables(counts)
        return self._stream_bits()

    def _stream_bits(self) -> torch.Tensor:
        self.before = self.k.block_bits(
            self.x,
            self.ctx,
            self.blocks,
            self.lengths_t,
            self.width,
            self.raw_bits,
            self.k.BLOCK,
        )
        return self.before[self.blocks.last_t] - self.before[self.blocks.first_t]

    def pack(self, seg_base: np.ndarray, end: int) -> torch.Tensor:
        return self.k.pack(
            self.x,
            self.ctx,
            self.blocks,
            self.lengths_t,
            self.codes_t,
            self.before,
            _to_device(seg_base, self.device),
            end,
            self.width,
            self.raw_bits,
            self.k.BLOCK,
        )


def _coded_heads(dtype, exp_shift, plans, modes, lengths, seg_bytes) -> list[bytes]:
    """The head of each coded tensor's block (everything before its streams): written by the
    Rust core, as its own encoder writes them, in one call for the batch; without the extension,
    by the pure-Python writer's ``block_head`` (about 0.2 ms a tensor)."""
    native = _native()
    if native is None:
        return [
            bytes(
                block_head(
                    plan.stride,
                    contexts_of_top(int(modes[j]), exp_shift),
                    lengths[j],
                    [int(v) for v in seg_bytes[j * STREAMS : (j + 1) * STREAMS]],
                )
            )
            for j, plan in enumerate(plans)
        ]
    return native.exphuf_coded_heads(
        dtype,
        [p.stride for p in plans],
        np.asarray(modes, dtype=np.uint8).tolist(),
        np.ascontiguousarray(lengths, dtype=np.uint8).tobytes(),
        np.asarray(seg_bytes, dtype=np.uint64).tolist(),
    )


def _assemble(tensors, heads, body_len, body_at, packed, contiguous):
    """The blocks out of the packed streams: ``Block``s (bodies are views), or with
    ``contiguous`` one buffer with every head written in its place and each raw block's bytes
    copied in."""
    if not contiguous:
        out = []
        for i, t in enumerate(tensors):
            if i in body_at:
                out.append(Block(heads[i], packed[body_at[i] : body_at[i] + body_len[i]]))
            else:
                out.append(Block(heads[i], t.reshape(-1).view(torch.uint8)))
        return out
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
    buf[_to_device(where, device)] = _to_device(head_bytes.copy(), device)
    return buf, sizes


def _counts(index: torch.Tensor, n: int) -> torch.Tensor:
    """``torch.bincount(index, minlength=n)`` for indices known to lie in ``[0, n)``, without
    reading anything back: CUDA's bincount copies the indices' min and max to the host to size
    its output, and each such copy waits for the stream with the thread spinning (CUDA's default
    for a process with fewer contexts than cores), for as long as the GPU, shared with the
    model, takes to get there."""
    out = torch.zeros(n, dtype=torch.int64, device=index.device)
    return out.scatter_add_(0, index, torch.ones(1, dtype=torch.int64, device=index.device).expand(index.shape))


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` without the host waiting: a copy from pageable memory makes
    the thread wait (spinning) for everything queued on the stream before it, the packing's
    kernels among them; from pinned memory it is queued like a kernel. The pinned memory is
    this thread's staging buffer (``_Staging``), not a block pinned per array."""
    if not (a.flags.writeable and a.flags.c_contiguous):
        a = np.array(a)  # torch takes only writable arrays (the core's tables come read-only)
    t = torch.from_numpy(a)
    if device.type != "cuda":
        return t
    return _staging(device).to_device(t)


class _Staging:
    """One thread's pinned host buffer for its copies to one device, allocated once (grown when
    a copy does not fit) and used as a ring: each copy takes the next bytes, and the ring starts
    over once the copies queued from it are done (an event recorded after each copy).

    Why: ``tensor.pin_memory()`` per table cost the compressing thread more than the copies
    themselves on the H100 (py-spy: 14.5 s pinning, 2.9 s freeing against 7.9 s copying, 1b at 4x,
    benches/RESULTS.md "fourteenth session"): torch's pinned allocator takes a process-wide lock,
    which the engine thread's own pinned copies take too, and polls the events of its blocks."""

    _ALIGN = 64
    _MIN_BYTES = 32 << 20

    def __init__(self, device: torch.device):
        self.device = device
        self.buf = torch.empty(0, dtype=torch.uint8)
        self.at = 0
        self.done = torch.cuda.Event(blocking=True)  # the last copy queued; a blocking wait sleeps
        self.stream: torch.cuda.Stream | None = None  # the stream of the copies since the last wait

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        stream = torch.cuda.current_stream(self.device)
        if self.at + nbytes > self.buf.numel() or stream != self.stream:
            # Bytes of the ring may still be read by a queued copy: wait for the last one (the
            # copies since the last wait are queued in order on one stream), once per turn of the
            # ring or change of stream.
            self.done.synchronize()
            self.stream = stream
            if nbytes > self.buf.numel():
                self.buf = torch.empty(max(2 * nbytes, self._MIN_BYTES), dtype=torch.uint8, pin_memory=True)
            self.at = 0
        staged = self.buf[self.at : self.at + nbytes].view(t.dtype).view(t.shape)
        staged.copy_(t)
        out = staged.to(self.device, non_blocking=True)
        self.done.record(stream)
        self.at += -(-nbytes // self._ALIGN) * self._ALIGN
        return out


_STAGING = threading.local()


def _staging(device: torch.device) -> _Staging:
    """This thread's staging buffer for ``device`` (a thread's copies are ordered on its current
    stream; two threads' are not, so each has its own ring)."""
    rings = _STAGING.__dict__.setdefault("rings", {})
    ring = rings.get(device)
    if ring is None:
        ring = rings[device] = _Staging(device)
    return ring


def _to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copies of small device tensors on the host, waited for with a blocking event (the thread
    sleeps rather than spins, so the wait costs the host no CPU)."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.cpu() for t in tensors]
    out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for o, t in zip(out, tensors):
        o.copy_(t, non_blocking=True)
    wait_sleeping()
    return out


def wait_sleeping(stream: torch.cuda.Stream | None = None) -> None:
    """Waits for the work queued on ``stream`` (default: the current one) with the thread asleep.
    ``stream.synchronize()`` spins a core at 100% for as long as the GPU works when the process
    has fewer CUDA contexts than cores (CUDA's default scheduling): on the H200 that spinning was
    most of the compressing thread's host CPU time. A blocking event's wait sleeps."""
    done = torch.cuda.Event(blocking=True)
    done.record(stream)
    done.synchronize()


def _pack(
    values: torch.Tensor, offset: torch.Tensor, nbits: torch.Tensor, total_bits: int, min_bits: int
) -> torch.Tensor:
    """The bytes of a bit string of ``total_bits`` bits (a multiple of 8) in which value ``i``
    (``nbits[i]`` bits, at least ``min_bits``) starts at bit ``offset[i]``, least significant
    bit first; ``offset`` ascending, the values not overlapping; bits no value covers are 0.

    Each 16-bit word gathers the values that overlap it (the first found by a binary search
    over the values' ends, then the next few): no scatter, whose atomics collide when
    neighbouring values share a word."""
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
