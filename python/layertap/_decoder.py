"""The decoder of one record from its stored payload, for the readers that find a record's bytes
outside a shard backend: ``layertap.follow`` (a shard still being written) and the Mooncake
backend (a store object). ``record_decoder(backend)`` is the Rust core's (the GIL released while
it reads, checks and decodes), or, for ``backend="python"`` or without the extension, the Python
reference's (``layertap._py.decode``), imported only then.

``decode(stored, *, key, codec, raw_len, payload_crc, path, offset)`` decodes a store object's
bytes; ``read(path, payload_offset, *, key, codec, raw_len, stored_len, payload_crc, offset,
fd=None)`` reads them from a shard file first (codec ``none`` records mapped, not copied).
``codec`` is the wire id, ``payload_crc`` None is not checked, ``offset`` is the frame's. Both
return what a shard backend's ``read`` does, and raise CorruptRecordError naming ``path``,
``offset`` and ``key`` when the payload is not that record intact."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from layertap._backends import resolve_backend


class RecordDecoder(NamedTuple):
    decode: Callable[..., tuple]
    read: Callable[..., tuple]
    owns_output: bool
    """Whether ``decode`` always returns tensors in memory of their own, never views of
    ``stored``: then ``stored`` may be memory that is lent for the call (the Mooncake client's
    transfer buffer)."""


def _rust() -> RecordDecoder:
    import numpy as np

    from layertap._native import decode_record, read_record

    def arrays(record: tuple) -> tuple:
        # Each tensor's buffer as the Rust shard backend gives it: a writable uint8 numpy array
        # over the record's own memory.
        metadata, tensors = record
        return metadata, [(name, dtype, shape, np.asarray(buf)) for name, dtype, shape, buf in tensors]

    return RecordDecoder(
        decode=lambda stored, **frame: arrays(decode_record(stored, **frame)),
        read=lambda path, payload_offset, **frame: arrays(read_record(path, payload_offset, **frame)),
        owns_output=True,  # decode_record copies a codec none payload too
    )


def _python() -> RecordDecoder:
    from layertap._py.decode import decode_stored, read_stored

    # Its codec none tensors are views of the stored payload.
    return RecordDecoder(decode=decode_stored, read=read_stored, owns_output=False)


def record_decoder(backend: str = "auto") -> RecordDecoder:
    """The record decoder ``backend`` (``"auto"``, ``"rust"`` or ``"python"``) names."""
    return resolve_backend("backend", backend, rust=_rust, python=_python)


__all__ = ["RecordDecoder", "record_decoder"]
