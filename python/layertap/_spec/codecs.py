"""Payload codecs (docs/FORMAT.md, "Codecs"): ``none``, ``zstd``, ``bp16-zstd`` and ``exp-huf``
(its decoder in ``layertap._spec.exphuf``): the byte-plane transform and the Python reference's
decoding, which production reads never import (they decode in the Rust core through
``layertap._decoder``; the zstd levels writers accept are in ``levels``). Encoding is the
writers' (``layertap._py.encode`` for the Python one).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import zstandard

from layertap._spec import exphuf
from layertap._spec.blob import TensorInfo, parse_header
from layertap._spec.dtypes import TWO_BYTE
from layertap._spec.format import CODEC_BP16_ZSTD, CODEC_EXP_HUF, CODEC_NONE, CODEC_ZSTD, FormatProblem

#: zstd cannot expand data by more than this (about 32 000 to 1 at best); a larger raw_len is
#: corrupt. The Rust reader uses the same bound.
ZSTD_MAX_RATIO = 32 << 10


def split_planes(src, out: np.ndarray) -> None:
    """Writes the high bytes of the 2-byte little-endian elements of ``src`` (odd positions), then
    the low bytes (even positions), into ``out`` (uint8, same length)."""
    u = np.frombuffer(src, dtype="<u2")
    m = u.size
    # Shifts and truncating casts run about 5x faster than strided byte copies.
    np.right_shift(u, 8, out=out[:m], casting="unsafe")
    out[m:] = u  # keeps the low byte


def join_planes(src, out: np.ndarray) -> None:
    """Inverse of ``split_planes``: ``out[2i + 1] = src[i]``, ``out[2i] = src[m + i]``."""
    a = np.frombuffer(src, dtype=np.uint8)
    m = a.size // 2
    out16 = out.view("<u2")
    np.left_shift(a[:m], 8, out=out16, dtype=np.uint16)
    np.bitwise_or(out16, a[m:], out=out16)


class Decoded(NamedTuple):
    """A decoded payload: the raw blob and its parsed, checked safetensors header."""

    blob: object
    """The blob, ``raw_len`` bytes (a writable buffer when the codec made a new one)."""
    metadata: dict[str, str]
    tensors: list[TensorInfo]
    """In the order of their data; offsets are absolute (header included)."""


def decode(codec: int, stored, raw_len: int) -> Decoded:
    """Decodes a stored payload into the raw blob of ``raw_len`` bytes and parses the blob's
    header (once: ``bp16-zstd`` needs it to join the byte planes, and readers use it). Raises
    FormatProblem saying why the payload cannot be decoded or is not a valid blob."""
    if codec == CODEC_NONE:
        out = stored
    elif codec == CODEC_EXP_HUF:
        out = exphuf.decode(stored, raw_len)
    elif codec in (CODEC_ZSTD, CODEC_BP16_ZSTD):
        out = _zstd_frame(stored, raw_len)
    else:
        raise FormatProblem(f"unknown codec id {codec}")
    if len(out) != raw_len:
        raise FormatProblem(f"decoded {len(out)} bytes, frame says {raw_len}")
    # Only tensor data is split into planes, so the header parses the same before and after.
    metadata, tensors, _ = parse_header(out)
    if codec == CODEC_BP16_ZSTD:
        joined = np.frombuffer(out, dtype=np.uint8).copy()
        for t in tensors:
            if t.end - t.begin and t.dtype in TWO_BYTE:
                join_planes(out[t.begin : t.end], joined[t.begin : t.end])
        out = memoryview(joined).cast("B")
    return Decoded(out, metadata, tensors)


def _zstd_frame(stored, raw_len: int) -> bytes:
    """Decodes ``stored``, which must be exactly one zstd frame, into at most ``raw_len`` bytes.
    A frame may omit its content size (streaming compressors, ``zstd`` reading a pipe): the output
    is then bounded by ``raw_len``, and a frame that decodes to more is corrupt. The output buffer
    is ``raw_len`` bytes either way, bounded by ``ZSTD_MAX_RATIO`` times the stored length."""
    if raw_len > len(stored) * ZSTD_MAX_RATIO:
        raise FormatProblem(f"raw length {raw_len} is more than {len(stored)} stored bytes can decode to")
    frame_len = zstd_frame_len(stored)
    if frame_len != len(stored):
        raise FormatProblem(f"{len(stored) - frame_len} bytes after the zstd frame")
    window = zstd_window_size(stored)
    if window > ZSTD_MAX_WINDOW:
        raise FormatProblem(f"zstd frame asks for a window of {window} bytes, more than {ZSTD_MAX_WINDOW}")
    try:
        size = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as e:
        # A header that the walk above can follow but libzstd refuses (a window too large, say;
        # the Rust reader's libzstd refuses it while finding the frame's length).
        raise FormatProblem(f"zstd frame: libzstd refuses its header ({e})") from None
    if size >= 0 and size != raw_len:
        raise FormatProblem(f"zstd frame holds {size} bytes, frame header says {raw_len}")
    try:
        # max_output_size bounds a frame without a content size (0 would mean "no bound").
        return zstandard.ZstdDecompressor().decompress(stored, max_output_size=max(raw_len, 1))
    except zstandard.ZstdError as e:
        if size < 0 and "did not decompress full frame" in str(e):
            raise FormatProblem(f"zstd frame without a content size decodes to more than {raw_len} bytes") from None
        raise FormatProblem(f"zstd: {e}") from None
    except MemoryError:
        raise FormatProblem(f"cannot allocate {raw_len} bytes to decode the payload into") from None


#: First bytes of a zstd frame (RFC 8878, 3.1.1).
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
#: The largest window a stored zstd frame may ask for (docs/FORMAT.md): libzstd's default
#: decoding limit, which python-zstandard enforces and the Rust reader checks.
ZSTD_MAX_WINDOW = 1 << 27


def zstd_window_size(frame) -> int:
    """The window size the header of ``frame`` (a whole zstd frame, ``zstd_frame_len`` checked)
    asks for (RFC 8878, 3.1.1.1.2): its window descriptor's, or for a single-segment frame its
    content size. Not ``zstandard.get_frame_parameters``: libzstd refuses a header whose window
    log is over 31 without saying the size, and both readers name the size the header asks for
    (the shared vectors' ``wide-window`` case, tests/test_py_format.py)."""
    fhd = frame[4]
    if not fhd & 0x20:
        wd = frame[5]
        base = 1 << (10 + (wd >> 3))
        return base + (base >> 3) * (wd & 7)
    at = 5 + (0, 1, 2, 4)[fhd & 3]
    size = (1, 2, 4, 8)[fhd >> 6]
    return int.from_bytes(frame[at : at + size], "little") + (256 if size == 2 else 0)


def zstd_frame_len(data) -> int:
    """The length of the zstd frame at the start of ``data``, from its header and block headers
    (RFC 8878, 3.1.1; what libzstd's ``ZSTD_findFrameCompressedSize`` computes). Raises
    FormatProblem if ``data`` does not start with a whole zstd frame."""
    n = len(data)
    if n < 5 or bytes(data[:4]) != ZSTD_MAGIC:
        raise FormatProblem("payload is not a zstd frame")
    fhd = data[4]
    if fhd & 0x08:
        raise FormatProblem("zstd frame: reserved bit set in the frame header")
    single_segment = bool(fhd & 0x20)
    fcs_size = (1 if single_segment else 0, 2, 4, 8)[fhd >> 6]
    pos = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[fhd & 3] + fcs_size
    while True:
        if pos + 3 > n:
            raise FormatProblem("zstd frame: cut off by the end of the payload")
        block = int.from_bytes(data[pos : pos + 3], "little")
        last, kind, size = block & 1, (block >> 1) & 3, block >> 3
        if kind == 3:
            raise FormatProblem("zstd frame: reserved block type")
        pos += 3 + (1 if kind == 1 else size)
        if pos > n:
            raise FormatProblem("zstd frame: cut off by the end of the payload")
        if last:
            break
    if fhd & 0x04:  # content checksum
        pos += 4
        if pos > n:
            raise FormatProblem("zstd frame: cut off by the end of the payload")
    return pos
