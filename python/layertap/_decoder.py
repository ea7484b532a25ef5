"""The decoder of one record from its stored payload, for the readers that find a record's bytes
outside a shard backend: ``layertap.follow`` (a shard still being written) and the Mooncake
backend (a store object). ``record_decoder(backend)`` is the Rust core's
(``layertap._native.decode_record``: the GIL released while it checks and decodes), or, asked
for ``backend="python"`` or without the extension, the Python reference's
(``layertap._py.decode.decode_stored``), imported only then.

Both take ``(stored, *, key, codec, raw_len, payload_crc, path, offset)`` (``codec``: the wire
id; ``payload_crc`` None: not checked), return ``(metadata, [(name, dtype, shape, buffer)])`` as
a shard backend's ``read`` does, and raise CorruptRecordError naming ``path``, ``offset`` and
``key`` when the payload is not that record intact."""

from __future__ import annotations

from collections.abc import Callable

from layertap._backends import resolve_backend

RecordDecoder = Callable[..., tuple]


def _rust() -> RecordDecoder:
    import numpy as np

    from layertap._native import decode_record

    def decode(stored, **frame) -> tuple:
        # Each tensor's buffer as the Rust shard backend gives it: a writable uint8 numpy array
        # over the record's own memory.
        metadata, tensors = decode_record(stored, **frame)
        return metadata, [(name, dtype, shape, np.asarray(buf)) for name, dtype, shape, buf in tensors]

    return decode


def _python() -> RecordDecoder:
    from layertap._py.decode import decode_stored

    return decode_stored


def record_decoder(backend: str = "auto") -> RecordDecoder:
    """The record decoder ``backend`` (``"auto"``, ``"rust"`` or ``"python"``) names."""
    return resolve_backend("backend", backend, rust=_rust, python=_python)


__all__ = ["RecordDecoder", "record_decoder"]
