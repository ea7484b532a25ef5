"""The objects of a dataset in Mooncake Store (docs/MOONCAKE.md, "Objects"): their names under
the dataset prefix, and the small JSON objects that list a dataset's writers and records."""

from __future__ import annotations

import json
from typing import NamedTuple

from layertap._spec.format import CODECS, align8, frame_header_len

#: ``"layertap_mooncake"`` of every JSON object: the layout's version.
LAYOUT_VERSION = 1
#: An index chunk lists at most this many records (a chunk is one small object).
MAX_CHUNK_RECORDS = 4096


def record_name(prefix: str, key: str) -> str:
    """The object holding the record ``key``: its frame, byte for byte as in a shard."""
    return f"{prefix}/rec/{key}"


def writer_slot_name(prefix: str, slot: int) -> str:
    """Slot ``slot`` of the dataset's list of writers (slots are taken in order from 0)."""
    return f"{prefix}/writers/{slot}"


def head_name(prefix: str, writer_id: str) -> str:
    """A writer's head: how many index chunks and records it has published, whether it closed."""
    return f"{prefix}/head/{writer_id}"


def chunk_name(prefix: str, writer_id: str, chunk: int) -> str:
    return f"{prefix}/index/{writer_id}/{chunk:06}"


class StoreEntry(NamedTuple):
    """One record as an index chunk lists it: what its frame header says."""

    key: str
    stored_len: int
    raw_len: int
    num_tokens: int
    codec: int
    payload_crc: int

    @property
    def frame_len(self) -> int:
        return frame_header_len(len(self.key.encode("utf-8"))) + align8(self.stored_len)


class LayoutProblem(Exception):
    """A JSON object of the layout is not what docs/MOONCAKE.md says."""


def _load(data: bytes, what: str, member: str) -> dict:
    try:
        doc = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise LayoutProblem(f"{what} is not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get(member) != LAYOUT_VERSION:
        raise LayoutProblem(f"{what} has no {member!r}: {LAYOUT_VERSION} (not a layertap object, or a newer layout)")
    return doc


def encode_slot(writer_id: str) -> bytes:
    return json.dumps({"layertap_mooncake_writer": LAYOUT_VERSION, "writer_id": writer_id}).encode()


def decode_slot(data: bytes) -> str:
    doc = _load(data, "writer slot", "layertap_mooncake_writer")
    if not isinstance(doc.get("writer_id"), str):
        raise LayoutProblem("writer slot has no writer_id")
    return doc["writer_id"]


class Head(NamedTuple):
    writer_id: str
    chunks: int
    records: int
    closed: bool
    failed: int
    meta: dict


def encode_head(head: Head) -> bytes:
    return json.dumps({"layertap_mooncake_head": LAYOUT_VERSION, **head._asdict()}, separators=(",", ":")).encode()


def decode_head(data: bytes) -> Head:
    doc = _load(data, "writer head", "layertap_mooncake_head")
    try:
        head = Head(
            doc["writer_id"], doc["chunks"], doc["records"], doc["closed"], doc.get("failed", 0), doc.get("meta", {})
        )
    except KeyError as e:
        raise LayoutProblem(f"writer head has no {e.args[0]!r}") from None
    ints = (head.chunks, head.records, head.failed)
    if not all(isinstance(n, int) and n >= 0 for n in ints) or not isinstance(head.closed, bool):
        raise LayoutProblem(f"writer head has bad counts: {doc!r}")
    return head


def encode_chunk(writer_id: str, chunk: int, entries: list[StoreEntry]) -> bytes:
    return json.dumps(
        {
            "layertap_mooncake_index": LAYOUT_VERSION,
            "writer_id": writer_id,
            "chunk": chunk,
            "records": [
                [e.key, e.stored_len, e.raw_len, e.num_tokens, CODECS[e.codec], e.payload_crc] for e in entries
            ],
        },
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode()


def decode_chunk(data: bytes, writer_id: str, chunk: int) -> list[StoreEntry]:
    doc = _load(data, f"index chunk {chunk} of writer {writer_id}", "layertap_mooncake_index")
    if doc.get("writer_id") != writer_id or doc.get("chunk") != chunk:
        raise LayoutProblem(
            f"index chunk {chunk} of writer {writer_id} names writer {doc.get('writer_id')!r} chunk {doc.get('chunk')!r}"
        )
    out = []
    for item in doc.get("records", ()):
        try:
            key, stored, raw, tokens, codec, crc = item
            out.append(StoreEntry(key, stored, raw, tokens, CODECS.index(codec), crc))
        except (TypeError, ValueError):
            raise LayoutProblem(f"index chunk {chunk} of writer {writer_id} has a bad entry {item!r}") from None
    return out


__all__ = [
    "LAYOUT_VERSION",
    "Head",
    "LayoutProblem",
    "StoreEntry",
    "chunk_name",
    "decode_chunk",
    "decode_head",
    "decode_slot",
    "encode_chunk",
    "encode_head",
    "encode_slot",
    "head_name",
    "record_name",
    "writer_slot_name",
]
