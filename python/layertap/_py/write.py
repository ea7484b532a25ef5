"""``write_shard``: the pure-Python reference writer of docs/FORMAT.md, one whole shard in one
call: file header, one frame per record, index frame and trailer.

It is what the shared test vectors (tests/vectors/make_vectors.py) are made with and what the
tests compare the Rust writer's frames against. It has none of a production writer's work
(threads, memory budget, batching, durability, rotation, locks): ``layertap.ShardWriter`` is the
writer.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from layertap._py.encode import Encoder
from layertap._spec.blob import build_header
from layertap._spec.dtypes import TWO_BYTE
from layertap._spec.format import (
    CODECS,
    KIND_RECORD,
    RawEntry,
    align8,
    crc32c,
    encode_file_header,
    encode_footer,
    encode_frame_header,
    key_problem,
)
from layertap.errors import InvalidInputError


def encode_record(encoder: Encoder, key: str, tensors: Mapping, metadata: Mapping[str, str] | None) -> tuple:
    """The frame of one record (header, payload and padding, as bytes) and its index entry, whose
    ``frame_offset`` is 0 until the frame is placed. ``tensors`` as ``layertap.ShardWriter.submit``
    takes them."""
    # Imported here: it imports torch where the tensors are torch's.
    from layertap._tensors import check_metadata, normalize

    problem = key_problem(key)
    if problem:
        raise InvalidInputError(problem)
    parts, num_tokens = normalize(tensors)
    meta = {**check_metadata(metadata), "key": key}
    header = build_header([(name, dtype, tuple(shape)) for name, _, dtype, shape in parts], meta)
    raw_len = len(header) + sum(view.nbytes for _, view, _, _ in parts)
    payload = encoder.encode(header, [(view, dtype in TWO_BYTE) for _, view, dtype, _ in parts])
    stored = b"".join(payload)
    crc = crc32c(stored)
    head = encode_frame_header(KIND_RECORD, encoder.codec, key.encode("utf-8"), len(stored), raw_len, num_tokens, crc)
    frame = head + stored + bytes(align8(len(stored)) - len(stored))
    return frame, RawEntry(0, len(stored), raw_len, num_tokens, crc, encoder.codec, key)


def write_shard(
    path: str | os.PathLike,
    records: Iterable[tuple[str, Mapping, Mapping[str, str] | None]],
    *,
    writer_id: str,
    shard_id: bytes,
    created_unix_ms: int,
    software: str,
    shard_index: int = 0,
    codec: str = "none",
    level: int = 1,
    user_meta: Mapping[str, str] | None = None,
    exphuf_by: str = "column",
) -> list[RawEntry]:
    """Writes the complete shard ``path`` (which must not exist) holding ``records``, each
    ``(key, tensors, metadata)``, in order; returns the index entries. The file header's
    metadata is ``writer_id``, ``shard_index``, ``created_unix_ms``, ``software`` (its
    ``writer``) and ``user_meta`` (its ``user``); given the same arguments, the same bytes.
    ``exphuf_by``: the layout of ``exp-huf``'s coded blocks (``Encoder``'s)."""
    meta = {
        "writer_id": writer_id,
        "shard_index": shard_index,
        "created_unix_ms": created_unix_ms,
        "writer": software,
        "user": dict(user_meta or {}),
    }
    out = bytearray(encode_file_header(shard_id, meta))
    encoder = Encoder(CODECS.index(codec), level, exphuf_by)
    entries = []
    for key, tensors, metadata in records:
        frame, entry = encode_record(encoder, key, tensors, metadata)
        entries.append(entry._replace(frame_offset=len(out)))
        out += frame
    out += encode_footer(entries, len(out))
    with open(path, "xb") as f:
        f.write(out)
    return entries


__all__ = ["encode_record", "write_shard"]
