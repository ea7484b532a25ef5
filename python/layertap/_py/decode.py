"""The Python reference's decoding of one record from its stored payload (docs/FORMAT.md,
"Reading", step 4): what ``PyShardReader`` reads through, and what ``layertap.follow`` and the
Mooncake backend use when asked for ``backend="python"`` (or the extension is not built). The
production path decodes through the Rust core (``layertap._native.decode_record``, chosen by
``layertap._decoder``) and never imports this module."""

from __future__ import annotations

import os
from typing import NamedTuple

from layertap._spec.codecs import decode
from layertap._spec.format import FormatProblem, crc32c
from layertap.errors import CorruptRecordError


class DecodedRecord(NamedTuple):
    metadata: dict[str, str]
    tensors: list[tuple[str, str, tuple[int, ...], memoryview]]
    """``(name, dtype, shape, bytes)`` of each tensor, in the order of their data."""


def decode_stored(
    stored, *, key: str, codec: int, raw_len: int, payload_crc: int | None, path: str, offset: int
) -> DecodedRecord:
    """Checks the stored payload of the record ``key`` against its checksum (unless
    ``payload_crc`` is None: not asked), decodes it and parses its safetensors header. What is
    wrong is raised as the Rust core's ``layertap._native.decode_record`` raises it:
    CorruptRecordError naming ``path``, ``offset`` and ``key``, in the readers' words."""
    try:
        if payload_crc is not None and (crc := crc32c(stored)) != payload_crc:
            raise FormatProblem(f"payload checksum mismatch (frame says {payload_crc:#010x}, payload has {crc:#010x})")
        raw, metadata, tensors = decode(codec, stored, raw_len)
        if metadata.get("key") != key:
            raise FormatProblem(f"__metadata__ key {metadata.get('key')!r} differs from the frame key")
    except FormatProblem as problem:
        raise CorruptRecordError.at(path, offset, key, str(problem)) from None
    view = raw if isinstance(raw, memoryview) else memoryview(raw).cast("B")
    return DecodedRecord(metadata, [(t.name, t.dtype, t.shape, view[t.begin : t.end]) for t in tensors])


def read_stored(
    path: str,
    payload_offset: int,
    *,
    key: str,
    codec: int,
    raw_len: int,
    stored_len: int,
    payload_crc: int | None,
    offset: int,
    fd: int | None = None,
) -> DecodedRecord:
    """``decode_stored`` of the ``stored_len`` payload bytes at ``payload_offset`` of the file
    ``path`` (read through ``fd`` when given), as ``layertap._native.read_record`` reads them."""
    own = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if fd is None else fd
    try:
        stored = bytearray(stored_len)
        got = os.preadv(own, [stored], payload_offset) if stored_len else 0
    finally:
        if own != fd:
            os.close(own)
    if got != stored_len:
        raise CorruptRecordError.at(path, offset, key, "payload is cut off by the end of the file")
    return decode_stored(
        stored, key=key, codec=codec, raw_len=raw_len, payload_crc=payload_crc, path=path, offset=offset
    )


__all__ = ["DecodedRecord", "decode_stored", "read_stored"]
