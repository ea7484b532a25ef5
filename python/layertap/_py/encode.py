"""Payload encoding of the reference writer, ``layertap._py.write`` (docs/FORMAT.md, "Codecs").

The byte-plane transform of ``bp16-zstd`` uses numpy; the zstd parameters are the Rust writer's,
so both make the same payloads from the same zstd library.
"""

from __future__ import annotations

import numpy as np
import zstandard

from layertap._py import exphuf
from layertap._spec.codecs import split_planes
from layertap._spec.format import CODEC_BP16_ZSTD, CODEC_EXP_HUF, CODEC_NONE

#: zstd parameters of ``bp16-zstd`` at level 1 (the default), tuned on the byte planes of bf16
#: activations: matches shorter than 7 bytes are left to the entropy coder. The Rust writer uses
#: the same set (``BYTE_PLANE_LEVEL_1`` in rust/core/src/codec.rs, which says why).
BYTE_PLANE_LEVEL_1 = zstandard.ZstdCompressionParameters(
    strategy=zstandard.STRATEGY_FAST,
    window_log=17,
    hash_log=8,
    min_match=7,
    target_length=0,
    write_content_size=True,
    write_checksum=False,
)


class Encoder:
    """Turns a record's pieces (blob header, then each tensor's bytes) into its stored payload.
    Keeps one zstd context; use one per thread. ``exphuf_by``: how ``exp-huf`` lays out its
    coded blocks, by ``"column"`` (mode 2, the writers') or ``"element"`` (mode 1, the GPU
    encoder's; for tests of the readers of that layout)."""

    def __init__(self, codec: int, level: int, exphuf_by: str = "column"):
        self.codec = codec
        self.exphuf_by = exphuf_by
        if codec in (CODEC_NONE, CODEC_EXP_HUF):
            self._zstd = None
        elif codec == CODEC_BP16_ZSTD and level == 1:
            self._zstd = zstandard.ZstdCompressor(compression_params=BYTE_PLANE_LEVEL_1)
        else:
            self._zstd = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)

    def encode(self, header: bytes, tensors: list[tuple[memoryview, bool]]) -> list:
        """The stored payload as a list of buffers (for ``none``: the pieces themselves, no copy).
        ``tensors`` lists each tensor's bytes and whether it is split into byte planes."""
        if self.codec == CODEC_NONE:
            return [header, *(view for view, _ in tensors)]
        raw_len = len(header) + sum(view.nbytes for view, _ in tensors)
        raw = np.empty(raw_len, dtype=np.uint8)
        raw[: len(header)] = np.frombuffer(header, dtype=np.uint8)
        at = len(header)
        for view, split in tensors:
            n = view.nbytes
            if split and self.codec == CODEC_BP16_ZSTD:
                split_planes(view, raw[at : at + n])
            else:
                raw[at : at + n] = np.frombuffer(view, dtype=np.uint8)
            at += n
        if self.codec == CODEC_EXP_HUF:
            return [exphuf.encode(raw, by=self.exphuf_by)]
        return [self._zstd.compress(raw)]
