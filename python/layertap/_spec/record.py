"""A record's stored payload checked and decoded (docs/FORMAT.md, "Reading", step 4): the one
decoding both the pure-Python shard reader and ``layertap.follow`` use."""

from __future__ import annotations

from typing import NamedTuple

from layertap._spec.codecs import decode
from layertap._spec.format import FormatProblem, crc32c


class DecodedRecord(NamedTuple):
    metadata: dict[str, str]
    tensors: list[tuple[str, str, tuple[int, ...], memoryview]]
    """``(name, dtype, shape, bytes)`` of each tensor, in the order of their data."""


def decode_record(stored, *, key: str, codec: int, raw_len: int, payload_crc: int | None) -> DecodedRecord:
    """Checks the stored payload of the record ``key`` against its checksum (unless
    ``payload_crc`` is None: not asked), decodes it and parses its safetensors header. Raises
    FormatProblem saying what is wrong."""
    if payload_crc is not None:
        crc = crc32c(stored)
        if crc != payload_crc:
            raise FormatProblem(f"payload checksum mismatch (frame says {payload_crc:#010x}, payload has {crc:#010x})")
    raw, metadata, tensors = decode(codec, stored, raw_len)
    if metadata.get("key") != key:
        raise FormatProblem(f"__metadata__ key {metadata.get('key')!r} differs from the frame key")
    view = raw if isinstance(raw, memoryview) else memoryview(raw).cast("B")
    return DecodedRecord(metadata, [(t.name, t.dtype, t.shape, view[t.begin : t.end]) for t in tensors])
