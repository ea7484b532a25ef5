"""Reading a dataset out of Mooncake Store with the readers' code: each writer of the dataset is
one *shard backend* (``StoreShard``, the protocol of ``layertap.reader``), so ``layertap.open``'s
``Dataset`` (lookups, iteration, ``verify``, ``inspect``) works on it as on shards on disk.

A record's object is its frame, byte for byte as in a shard: its header is checked by the
format's code and its payload decoded and checked (CRC32C, length, metadata key) by the core
(``layertap._decoder``: the Rust core's decoder, as ``follow`` uses). An object that is not there
(evicted, lost with its node, never put) raises ``RecordMissingError``; one whose frame differs from what the index
says (another writer's record under the same key) raises ``CorruptRecordError``: neither is ever
read as the record. A read that fails (the master or a node does not answer) raises
``StoreUnavailableError``: a record the store could not be asked for is not reported missing, nor
a dataset whose writer list could not be read absent.
"""

from __future__ import annotations

from layertap._cursor import pread_fully
from layertap._decoder import RecordDecoder, record_decoder
from layertap._spec.format import CODECS, FormatProblem, crc32c, decode_frame_header
from layertap._types import IndexEntry, Problem
from layertap.errors import CorruptRecordError, FormatError, RecordMissingError, quote_key
from layertap.mooncake.address import StoreAddress, parse_address
from layertap.mooncake.client import StoreClient, connect
from layertap.mooncake.layout import (
    Head,
    LayoutProblem,
    StoreEntry,
    chunk_name,
    decode_chunk,
    decode_head,
    decode_slot,
    head_name,
    record_name,
    writer_slot_name,
)


def writer_path(address: StoreAddress, writer_id: str) -> str:
    """What names a writer's records where a reader names a shard (``Record.shard``...)."""
    return f"{address.dataset}#{writer_id}"


def check_frame(obj, key: str, want: StoreEntry | None, where: str, intact: bool = False):
    """The frame header of the record object ``obj`` (checked by the format's code) and its stored
    payload; raises FormatProblem unless ``obj`` is the frame of ``key`` that ``want`` (the index's
    entry, if any) describes, its payload's CRC checked too where ``intact``."""
    h = decode_frame_header(obj, len(obj))
    got = StoreEntry(h.key, h.stored_len, h.raw_len, h.num_tokens, h.codec, h.payload_crc)
    if h.key != key:
        raise FormatProblem(f"the object holds the record {h.key!r}, not {key!r}")
    if h.frame_len != len(obj):
        raise FormatProblem(f"the object is {len(obj)} bytes, its frame {h.frame_len}")
    if want is not None and got != want:
        raise FormatProblem(
            f"the object is another record than the index lists (frame {got}, index {want}): "
            f"another writer put the key first ({where})"
        )
    payload = memoryview(obj)[h.header_len : h.header_len + h.stored_len]
    if intact and crc32c(payload) != want.payload_crc:
        raise FormatProblem("payload checksum mismatch")
    return got, payload


def local_frame(fd: int, e: IndexEntry, where: str) -> tuple[StoreEntry, bytes]:
    """The frame of record ``e`` (an index entry of the shard file ``fd``, at ``where``) as the
    store holds it, and its store entry: what the forwarder and ``generate``'s settling step put.
    Raises FormatProblem when the bytes there are not that record intact (being written, or
    damaged)."""
    entry = StoreEntry(e.key, e.stored_len, e.raw_len, e.num_tokens, CODECS.index(e.codec), e.payload_crc)
    frame = pread_fully(fd, e.frame_offset, entry.frame_len)
    check_frame(frame, e.key, entry, where, intact=True)
    return entry, frame


def _checked_object(client, address, key, want, path, offset, view=False, intact=False):
    """The object of record ``key`` (``get_view``'s where ``view``) and ``check_frame``'s answer;
    raises RecordMissingError, CorruptRecordError or StoreUnavailableError."""
    name = record_name(address.prefix, key)
    obj = client.get_view(name) if view else client.get(name)
    if obj is None:
        raise RecordMissingError(
            f"{path}: record {quote_key(key)} is not in the store (evicted, lost with the node that held it, or never put)",
            path,
            offset,
            key,
        )
    try:
        return obj, *check_frame(obj, key, want, path, intact)
    except FormatProblem as problem:
        raise CorruptRecordError.at(path, offset, key, str(problem)) from None


def read_object(
    client: StoreClient,
    address: StoreAddress,
    key: str,
    want: StoreEntry | None,
    path: str,
    offset: int,
    decode: RecordDecoder | None = None,
):
    """``(metadata, tensors)`` of the record ``key`` read from the store (``want``: what the
    index says of it), decoded by ``decode`` (None: the Rust core's where it is built)."""
    decode = decode or record_decoder()
    # A decoder whose tensors own their memory reads the object where Mooncake received it:
    # 11 MB less to copy (and to fault in) per 11 MB record (benches/RESULTS.md, "fetch").
    _, entry, payload = _checked_object(client, address, key, want, path, offset, view=decode.owns_output)
    return decode.decode(
        payload,
        key=key,
        codec=entry.codec,
        raw_len=entry.raw_len,
        payload_crc=entry.payload_crc,
        path=path,
        offset=offset,
    )


class StoreShard:
    """One writer's records in the store, as a shard backend (``layertap.reader``). An entry's
    ``frame_offset`` is the record's position in its writer's index."""

    lost_in_recovery = 0
    torn_tail_bytes = 0

    def __init__(
        self,
        client: StoreClient,
        address: StoreAddress,
        head: Head,
        entries: list[StoreEntry],
        problems: list[Problem],
        decode: RecordDecoder | None = None,
    ):
        self.client = client
        self._decode = decode or record_decoder()
        self.address = address
        self.head = head
        self.path = writer_path(address, head.writer_id)
        self.complete = head.closed
        self.being_written = not head.closed
        self.meta = {"writer_id": head.writer_id, **head.meta}
        self._store_entries = entries
        self.entries = [
            IndexEntry(e.key, i, e.stored_len, e.raw_len, e.num_tokens, CODECS[e.codec], e.payload_crc)
            for i, e in enumerate(entries)
        ]
        self.file_bytes = sum(e.frame_len for e in entries)
        self.scan_problems = problems

    def read(self, i: int, verify: bool = True):
        e = self._store_entries[i]
        return read_object(self.client, self.address, e.key, e, self.path, i, self._decode)

    def check(self, i: int) -> None:
        self.read(i)

    def frame(self, i: int) -> bytes:
        """Record ``i``'s frame as stored, checked against the index and its payload's CRC."""
        e = self._store_entries[i]
        return _checked_object(self.client, self.address, e.key, e, self.path, i, intact=True)[0]

    def close(self) -> None:
        pass


def writer_ids(client: StoreClient, address: StoreAddress) -> list[str]:
    """The dataset's writers in the order they took their slots."""
    out: list[str] = []
    slot = 0
    while True:
        data = client.get(writer_slot_name(address.prefix, slot))
        if data is None:
            return out
        try:
            w = decode_slot(data)
        except LayoutProblem as p:
            raise FormatError(f"{address}: writer slot {slot}: {p}", address.dataset) from None
        if w not in out:
            out.append(w)
        slot += 1


def open_writer_shard(
    client: StoreClient,
    address: StoreAddress,
    writer_id: str,
    until_gap: bool = False,
    decode: RecordDecoder | None = None,
) -> StoreShard | Problem:
    """The writer's records as its index lists them; a Problem when its head is missing. An
    index chunk that is not there is a problem, and the records of the chunks after it are
    listed; with ``until_gap`` (``follow``, which counts a writer's records by position and
    looks again later) the records end before it, so that they are the same at every look."""
    path = writer_path(address, writer_id)

    def problem(text: str, kind: str = "bad_index") -> Problem:
        return Problem(path, None, None, kind, text)

    data = client.get(head_name(address.prefix, writer_id))
    if data is None:
        return problem("the writer's head object is not in the store")
    try:
        head = decode_head(data)
    except LayoutProblem as p:
        return problem(str(p))
    entries: list[StoreEntry] = []
    problems: list[Problem] = []
    for c in range(head.chunks):
        chunk = client.get(chunk_name(address.prefix, writer_id, c))
        try:
            if chunk is None:
                raise LayoutProblem(f"index chunk {c} is not in the store: its records cannot be listed")
            entries += decode_chunk(chunk, writer_id, c)
        except LayoutProblem as p:
            problems.append(problem(str(p)))
            if until_gap:
                break
    if head.failed:
        problems.append(
            problem(
                f"the writer could not put {head.failed} records into the store (its log names them)", "missing_record"
            )
        )
    return StoreShard(client, address, head, entries, problems, decode)


def open_address(
    text: str, until_gap: bool = False, backend: str = "auto"
) -> tuple[StoreAddress, list[StoreShard], list[Problem]]:
    """The address of the dataset ``text`` names (``mooncake://...``), its writers as shard
    backends, and the writers that cannot be read (``until_gap``: see ``open_writer_shard``;
    ``backend``: the record decoder's, as for ``layertap.open``); connects this process's client
    first. Raises FormatError when no writer has published under the prefix,
    StoreUnavailableError when the store cannot be read."""
    address = parse_address(text)
    client = connect(address)
    decode = record_decoder(backend)
    shards: list[StoreShard] = []
    problems: list[Problem] = []
    for w in writer_ids(client, address):
        s = open_writer_shard(client, address, w, until_gap, decode)
        (problems if isinstance(s, Problem) else shards).append(s)
    if not shards and not problems:
        raise FormatError(
            f"{address}: no dataset there: no writer has published under prefix {address.prefix!r}", address.dataset
        )
    return address, shards, problems


__all__ = [
    "StoreShard",
    "check_frame",
    "local_frame",
    "open_address",
    "open_writer_shard",
    "read_object",
    "writer_ids",
    "writer_path",
]
