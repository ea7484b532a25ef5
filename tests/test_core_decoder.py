"""The record decoder of the read paths that find a record's bytes outside a shard backend
(``layertap._decoder``): ``follow`` and ``layertap.vllm.fetch`` on a live shard decode through the
Rust core, never importing the Python reference's decoding, and both backends decode alike: the
shared vectors and a live shard of every codec (and of fp8 records)."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
from decoder_support import CASES, RECORDS, REFERENCE_DECODER, as_plain, live_shards, read_in_child, write_case

import layertap
from layertap._decoder import record_decoder
from layertap._rust_reader import RustShardReader
from layertap._spec.format import CODECS, frame_header_len
from layertap._spec.lock import is_locked
from layertap.errors import CorruptRecordError, FormatError, InvalidInputError

VECTORS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vectors")


def test_live_reads_never_import_the_reference_decoder(tmp_path):
    with live_shards(tmp_path) as writer_ids:
        assert all(is_locked(p) for p in glob.glob(str(tmp_path / "*.lts")))
        keys = [(w, f"{w}-r{i}") for w in writer_ids for i in range(RECORDS)]
        got = read_in_child(tmp_path, keys)
    want = sorted(k for _, k in keys)
    assert {path: sorted(k) for path, k in got["read"].items()} == {"follow": want, "open": want, "fetch": want}
    imported = [m for m in got["modules"] if m in REFERENCE_DECODER or m.startswith("layertap._py")]
    assert imported == []


def _outcome(call) -> tuple:
    try:
        metadata, tensors = call()
    except CorruptRecordError as e:
        return ("corrupt", e.path, e.offset, e.key)
    return (metadata, [(n, d, tuple(s), bytes(memoryview(b).cast("B"))) for n, d, s, b in tensors])


def _decode_both(stored: bytes, **frame) -> dict:
    """Each backend's ``decode`` of the payload bytes ``stored``."""
    return {b: _outcome(lambda b=b: record_decoder(b).decode(stored, **frame)) for b in ("rust", "python")}


def _read_both(path: str, payload_offset: int, **frame) -> dict:
    """Each backend's ``read`` of the payload at ``payload_offset`` of the file ``path``."""
    return {b: _outcome(lambda b=b: record_decoder(b).read(path, payload_offset, **frame)) for b in ("rust", "python")}


def test_both_backends_decode_the_shared_vectors_alike():
    decoded = corrupt = 0
    for path in sorted(glob.glob(os.path.join(VECTORS, "*.lts"))):
        try:
            reader = RustShardReader(path)
        except FormatError:
            continue
        with open(path, "rb") as f:
            for e in reader.entries:
                at = e.frame_offset + frame_header_len(len(e.key.encode("utf-8")))
                f.seek(at)
                stored = f.read(e.stored_len)
                frame = dict(key=e.key, codec=CODECS.index(e.codec), raw_len=e.raw_len, payload_crc=e.payload_crc)
                got = _decode_both(stored, path=path, offset=e.frame_offset, **frame)
                assert got["rust"] == got["python"], (path, e.key)
                read = _read_both(path, at, stored_len=e.stored_len, offset=e.frame_offset, **frame)
                assert read["rust"] == read["python"] == got["rust"], (path, e.key)
                corrupt += got["rust"][0] == "corrupt"
                decoded += got["rust"][0] != "corrupt"
        reader.close()
    assert decoded >= 20 and corrupt >= 1, (decoded, corrupt)


def test_a_payload_cut_short_is_corrupt_in_both():
    with open(os.path.join(VECTORS, "exp-huf.lts"), "rb") as f:
        data = f.read()
    reader = RustShardReader(os.path.join(VECTORS, "exp-huf.lts"))
    e = reader.entries[-1]
    start = e.frame_offset + frame_header_len(len(e.key.encode("utf-8")))
    stored = data[start : start + e.stored_len - 7]
    frame = dict(key=e.key, codec=CODECS.index(e.codec), raw_len=e.raw_len, offset=e.frame_offset)
    got = _decode_both(stored, payload_crc=None, path="p", **frame)
    assert got["rust"] == got["python"] == ("corrupt", "p", e.frame_offset, e.key)
    # a payload the file ends before (a frame whose payload is being written)
    read = _read_both(reader.path, start, stored_len=len(data) - start + 1, payload_crc=None, **frame)
    assert read["rust"] == read["python"] == ("corrupt", reader.path, e.frame_offset, e.key)


@pytest.mark.parametrize("codec,lossy", CASES)
def test_both_backends_follow_a_live_shard_alike(tmp_path, codec, lossy):
    w = write_case(tmp_path, codec, lossy)
    try:
        (shard,) = glob.glob(str(tmp_path / "*.lts"))
        assert is_locked(shard)
        got = {
            b: [as_plain(r) for r in layertap.follow(tmp_path, timeout=0, backend=b, tensors="numpy")]
            for b in ("rust", "python")
        }
        with layertap.open(str(tmp_path), backend="rust", tensors="numpy") as ds:
            opened = [as_plain(r) for r in ds]
    finally:
        w.close()
    assert len(got["rust"]) == RECORDS
    assert got["rust"] == got["python"] == opened
    if lossy:
        assert got["rust"][0][2][0][1] == "float8_e4m3fn"
    assert not np.all(np.frombuffer(got["rust"][0][2][0][3], np.uint8) == 0)


def _vector_readers() -> list[RustShardReader]:
    """A Rust reader of each shared vector that opens as a shard."""
    readers = []
    for path in sorted(glob.glob(os.path.join(VECTORS, "*.lts"))):
        try:
            readers.append(RustShardReader(path))
        except FormatError:
            continue
    return readers


def _read_one(reader: RustShardReader, i: int) -> tuple:
    return _outcome(lambda: reader.read(i))


def test_a_batch_read_into_rows_gives_what_each_record_reads():
    """``RustShardReader.read_batch_into`` (the core's batch read, which ``layertap.torch``
    decodes batches through): every record of the shared vectors, from all the shards in one
    batch, on one thread and on three: the tensor placed in its row (zeros after it in a longer
    row) and the others hold what ``read`` gives, a corrupt record comes back as its
    ``CorruptRecordError``."""
    readers = _vector_readers()
    want = [(r, i, _read_one(r, i)) for r in readers for i in range(len(r))]

    def row_len(outcome: tuple) -> int:
        if outcome[0] == "corrupt":
            return 16
        return next((len(b) for n, _, _, b in outcome[1] if n == "hidden_states"), 16)

    for threads in (1, 3):
        pad = 0 if threads == 1 else 8  # rows longer than the tensor: zeros after it
        rows = [np.full(row_len(w) + pad, 0xEE, np.uint8) for _, _, w in want]
        got = RustShardReader.read_batch_into(
            [(r, i, row) for (r, i, _), row in zip(want, rows)], "hidden_states", threads=threads
        )
        placed = corrupt = 0
        for (r, i, expected), row, result in zip(want, rows, got):
            if isinstance(result, CorruptRecordError):
                assert expected == ("corrupt", result.path, result.offset, result.key), (r.path, i)
                corrupt += 1
                continue
            metadata, tensors = result
            data = row[: len(row) - pad]
            filled = [(n, d, tuple(s), data.tobytes() if b is None else b.tobytes()) for n, d, s, b in tensors]
            assert not row[len(data) :].any() or all(b is not None for *_, b in tensors)
            assert (metadata, filled) == expected, (r.path, i)
            placed += any(b is None for *_, b in tensors)
        assert placed >= 20 and corrupt >= 1, (placed, corrupt)
    for r in readers:
        r.close()


def test_a_batch_read_refuses_rows_that_overlap():
    reader = RustShardReader(os.path.join(VECTORS, "bp16-zstd.lts"))
    memory = np.zeros(4096, np.uint8)
    with pytest.raises(ValueError, match="overlap"):
        RustShardReader.read_batch_into([(reader, 0, memory[:100]), (reader, 1, memory[50:300])], "hidden_states")
    with pytest.raises(TypeError, match="writable"):
        RustShardReader.read_batch_into([(reader, 0, b"read-only bytes")], "hidden_states")


def test_stored_payloads_are_copied_as_the_file_holds_them():
    """``RustShardReader.read_stored_into`` (what the Dataset's ``decode_on`` stages a batch's
    payloads through, for the GPU decoder): every record of the shared vectors in one batch, on
    one thread and on three, gets the bytes the file holds at its payload; a record whose bytes
    do not match its checksum comes back as its ``CorruptRecordError`` (the bytes still copied)."""
    readers = _vector_readers()
    want = []
    for r in readers:
        with open(r.path, "rb") as f:
            for i, e in enumerate(r.entries):
                f.seek(e.frame_offset + frame_header_len(len(e.key.encode())))
                want.append((r, i, f.read(e.stored_len)))
    for threads in (1, 3):
        out = [np.full(len(stored), 0xEE, np.uint8) for _, _, stored in want]
        got = RustShardReader.read_stored_into([(r, i, o) for (r, i, _), o in zip(want, out)], threads=threads)
        copied = corrupt = 0
        for (r, i, stored), o, result in zip(want, out, got):
            assert o.tobytes() == stored, (r.path, i)
            if result is None:
                copied += 1
            else:
                assert isinstance(result, CorruptRecordError), result
                assert "payload checksum mismatch" in str(result) and result.key == r.entries[i].key
                corrupt += 1
        assert copied >= 20 and corrupt >= 1, (copied, corrupt)
    for r in readers:
        r.close()


def test_stored_payloads_need_buffers_of_their_length_apart():
    reader = RustShardReader(os.path.join(VECTORS, "bp16-zstd.lts"))
    n = reader.entries[0].stored_len
    (short,) = RustShardReader.read_stored_into([(reader, 0, np.zeros(n - 1, np.uint8))])
    assert isinstance(short, InvalidInputError) and "stored_len" in str(short), short
    memory = np.zeros(2 * n, np.uint8)
    with pytest.raises(ValueError, match="overlap"):
        RustShardReader.read_stored_into([(reader, 0, memory[:n]), (reader, 0, memory[n - 8 : 2 * n - 8])])
    with pytest.raises(TypeError, match="writable"):
        RustShardReader.read_stored_into([(reader, 0, bytes(n))])
    reader.close()


def test_batch_memory_comes_back_once_nothing_uses_it():
    """``batch_memory``: memory a dropped batch used is handed out again, as that batch left it
    (so a reader of batches must write every byte it hands on); one in use never is."""
    size = (3 << 20) + 12345  # a size no other test's batch has
    first = RustShardReader.batch_memory(size)
    first[:4] = [1, 2, 3, 4]
    address = first.ctypes.data
    held = RustShardReader.batch_memory(size)
    assert held.ctypes.data != address
    del first
    again = RustShardReader.batch_memory(size - 345)
    assert again.ctypes.data == address and len(again) == size - 345
    assert again[:4].tolist() == [1, 2, 3, 4]
    with pytest.raises(MemoryError, match="cannot allocate"):
        RustShardReader.batch_memory(1 << 62)
