"""The cases docs/FORMAT.md settles where a reader written from it alone had to guess: files
crafted byte by byte (no writer, so none of a writer's checks), read by both backends, which must
do what the format says.

Each test names the FORMAT.md section whose rule it pins.
"""

from __future__ import annotations

import json
import struct

import pytest
import zstandard

import layertap
from helpers import reader_class
from layertap._spec import format as fmt
from layertap.errors import CorruptRecordError

BACKENDS = ["rust", "python"]
I64 = struct.pack("<2q", 5, -6)
META = {"writer_id": "w", "shard_index": 0, "created_unix_ms": 0, "writer": "hand-made", "user": {}}


def _blob(tensors: list, metadata, pad: bytes | None = None) -> bytes:
    """A safetensors blob: ``tensors`` is ``[(name, dtype, shape, data, data_offsets or None)]`` in
    the header's order (None: packed in that order); ``metadata`` is ``__metadata__`` (left out
    when None); ``pad`` replaces the spaces that pad the header to a multiple of 8."""
    doc: dict = {} if metadata is None else {"__metadata__": metadata}
    at = 0
    for name, dtype, shape, data, offsets in tensors:
        if offsets is None:
            offsets = [at, at + len(data)]
            at += len(data)
        doc[name] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8) if pad is None else pad
    return len(text).to_bytes(8, "little") + text + b"".join(t[3] for t in tensors)


def _frame(key: bytes, stored: bytes, raw_len: int, codec: int, reserved: bytes = bytes(12)) -> bytes:
    """A record frame, its checksums right, with ``reserved`` at offsets 32 to 43."""
    fixed = struct.pack("<4sBBHQQII", b"LTRF", 1, codec, len(key), len(stored), raw_len, 0, fmt.crc32c(stored))
    fixed += reserved
    head = fixed + fmt.crc32c(key, fmt.crc32c(fixed)).to_bytes(4, "little") + key
    return head + bytes(-len(head) % 8) + stored + bytes(-len(stored) % 8)


def _shard(path, records: list, *, meta=None, complete=True, listed=None, entry_reserved: int = 0, **frame_kw) -> None:
    """A shard of ``records`` (``(key bytes, stored, raw_len, codec)``), with its footer when
    ``complete``; ``listed(entries)`` picks or changes the index's entries; ``entry_reserved``
    fills the first entry's reserved bytes."""
    out = bytearray(fmt.encode_file_header(bytes(16), META if meta is None else meta))
    entries = []
    for key, stored, raw_len, codec in records:
        entries.append(fmt.RawEntry(len(out), len(stored), raw_len, 0, fmt.crc32c(stored), codec, key.decode()))
        out += _frame(key, stored, raw_len, codec, **frame_kw)
    if complete:
        entries = listed(entries) if listed else entries
        index = bytearray(fmt.encode_index(entries))
        index[8 + 33] = index[8 + 36] = index[8 + 39] = entry_reserved
        at = len(out)
        out += fmt.encode_frame_header(fmt.KIND_INDEX, 0, b"", len(index), len(index), 0, fmt.crc32c(bytes(index)))
        out += index + bytes(-len(index) % 8) + fmt.encode_trailer(at, len(entries))
    path.write_bytes(out)


def _record(key: str = "k", codec: int = 0) -> tuple:
    blob = _blob([("t", "I64", [2], I64, None)], {"key": key})
    return key.encode(), blob, len(blob), codec


def _read(backend: str, path, i: int = 0):
    """Record ``i`` as the backend reads it: ``(metadata, [(name, dtype, shape, bytes)])``."""
    with reader_class(backend)(str(path), probe_lock=False) as shard:
        meta, tensors = shard.read(i)
        return meta, [
            (name, dtype, tuple(shape), bytes(memoryview(buf).cast("B"))) for name, dtype, shape, buf in tensors
        ]


def _verify(backend: str, path):
    with layertap.open(str(path), backend=backend) as ds:
        return ds.verify()


# ---------------------------------------------------------------------------------------------
# Record payload


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("codec", [0, 3])
def test_tensors_with_equal_data_offsets_keep_the_order_the_header_lists_them_in(tmp_path, backend, codec):
    # Three empty tensors at offset 0 (two of them coded by exp-huf, each a block `00`), listed
    # before and after the non-empty one they start with.
    tensors = [
        ("b", "I64", [0], b"", [0, 0]),
        ("n", "I64", [2], I64, [0, 16]),
        ("a", "F32", [0, 3], b"", [0, 0]),
        ("c", "BF16", [2, 0], b"", [0, 0]),
    ]
    blob = _blob(tensors, {"key": "k"})
    stored = blob if codec == 0 else blob[:-16] + b"\0\0" + I64
    _shard(tmp_path / "s.lts", [(b"k", stored, len(blob), codec)])
    _, got = _read(backend, tmp_path / "s.lts")
    assert [t[0] for t in got] == ["b", "a", "c", "n"]
    assert got[3] == ("n", "I64", (2,), I64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "pad, problem",
    [
        (b"\t\n\r ", None),  # any JSON whitespace
        (b"", None),  # 8 + N not a multiple of 8: the data starts unaligned
        (b" " * 13, None),
        (b"\0\0\0", "safetensors header: "),  # not JSON
    ],
)
def test_the_header_padding_is_json_whitespace_of_any_length(tmp_path, backend, pad, problem):
    blob = _blob([("t", "I64", [2], I64, None)], {"key": "k"}, pad=pad)
    _shard(tmp_path / "s.lts", [(b"k", blob, len(blob), 0)])
    if problem is None:
        assert _read(backend, tmp_path / "s.lts")[1] == [("t", "I64", (2,), I64)]
        with layertap.open(str(tmp_path / "s.lts"), backend=backend) as ds:
            assert ds["k"]["t"].tolist() == [5, -6]
    else:
        with pytest.raises(CorruptRecordError, match=problem):
            _read(backend, tmp_path / "s.lts")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bytes_after_the_last_tensor_make_the_record_corrupt(tmp_path, backend):
    blob = _blob([("t", "I64", [2], I64, None)], {"key": "k"}) + bytes(8)
    _shard(tmp_path / "s.lts", [(b"k", blob, len(blob), 0)])
    with pytest.raises(CorruptRecordError, match="8 bytes after the last tensor"):
        _read(backend, tmp_path / "s.lts")


#: FORMAT.md's list of dtypes and their item sizes.
ITEM_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_dtypes_readers_accept_and_their_item_sizes(tmp_path, backend):
    for dtype, size in ITEM_SIZES.items():
        data = bytes(range(3 * size))
        blob = _blob([("t", dtype, [3], data, None)], {"key": "k"})
        _shard(tmp_path / f"{dtype}.lts", [(b"k", blob, len(blob), 0)])
        assert _read(backend, tmp_path / f"{dtype}.lts")[1] == [("t", dtype, (3,), data)], dtype
    for dtype in ["F8_E5M2", "C64", "bf16"]:
        blob = _blob([("t", dtype, [2], bytes(16), None)], {"key": "k"})
        _shard(tmp_path / f"{dtype}.lts", [(b"k", blob, len(blob), 0)])
        with pytest.raises(CorruptRecordError, match="unknown dtype"):
            _read(backend, tmp_path / f"{dtype}.lts")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "metadata, problem",
    [
        ({"key": "k", "n": 1}, "is not a string"),
        ({"key": "k", "n": None}, "is not a string"),
        ({"key": "k", "n": {}}, "is not a string"),
        ([], "__metadata__ is not an object"),
        (None, "key"),  # no __metadata__: no key
    ],
)
def test_metadata_values_must_be_strings(tmp_path, backend, metadata, problem):
    blob = _blob([("t", "I64", [2], I64, None)], metadata)
    _shard(tmp_path / "s.lts", [(b"k", blob, len(blob), 0)])
    with pytest.raises(CorruptRecordError, match=problem):
        _read(backend, tmp_path / "s.lts")


# ---------------------------------------------------------------------------------------------
# File header, frames, keys, index


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("meta", [{}, {"user": "not an object", "writer_id": 5}])
def test_shard_metadata_without_the_writers_members_is_read(tmp_path, backend, meta):
    _shard(tmp_path / "s.lts", [_record()], meta=meta)
    with layertap.open(str(tmp_path / "s.lts"), backend=backend) as ds:
        assert ds.shards[0].meta == meta and ds.keys() == ["k"]
        assert ds.verify().ok


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("complete", [True, False])
def test_reserved_bytes_of_frames_and_index_entries_are_not_checked(tmp_path, backend, complete):
    _shard(
        tmp_path / "s.lts", [_record("a"), _record("b")], complete=complete, reserved=b"\xff" * 12, entry_reserved=0xAB
    )
    with reader_class(backend)(str(tmp_path / "s.lts"), probe_lock=False) as shard:
        assert (shard.complete, [e.key for e in shard.entries], shard.scan_problems) == (complete, ["a", "b"], [])
    report = _verify(backend, tmp_path / "s.lts")
    assert report.ok and report.records_ok == 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("complete", [True, False])
def test_keys_outside_the_writers_rule_are_read_like_any_other(tmp_path, backend, complete):
    keys = ["", "a\x01b", "a/b\\c", "k" * 1100]
    _shard(tmp_path / "s.lts", [_record(k) for k in keys], complete=complete)
    with layertap.open(str(tmp_path / "s.lts"), backend=backend) as ds:
        assert ds.keys() == keys
        assert [ds[k].metadata["key"] for k in keys] == keys
        report = ds.verify()
        assert report.ok and report.records_ok == 4


def test_a_corrupt_records_message_quotes_its_key_as_json_in_both_readers(tmp_path):
    """Both readers word a corrupt record alike, its key a JSON string (a control character as
    \\u0001), and verify's problem leaves out what the problem names anyway (path, offset, key)."""
    path = tmp_path / "s.lts"
    _shard(path, [_record("a\x01b")])
    data = bytearray(path.read_bytes())
    data[data.index(I64)] ^= 1  # the tensor's bytes: the payload's checksum no longer matches
    path.write_bytes(bytes(data))
    messages = {}
    for backend in BACKENDS:
        with layertap.open(str(path), backend=backend) as ds:
            with pytest.raises(CorruptRecordError) as raised:
                ds["a\x01b"]
            messages[backend] = str(raised.value)
            [problem] = ds.verify().problems
            assert problem.key == "a\x01b" and problem.message.startswith("payload checksum mismatch"), problem
    assert messages["rust"] == messages["python"]
    assert '(key "a\\u0001b"): payload checksum mismatch' in messages["rust"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_index_entry_that_points_to_another_frame_makes_its_record_corrupt(tmp_path, backend):
    # The index lists one record: a's fields, at b's frame (a valid index otherwise).
    _shard(
        tmp_path / "s.lts",
        [_record("a"), _record("b")],
        listed=lambda es: [es[0]._replace(frame_offset=es[1].frame_offset)],
    )
    with pytest.raises(CorruptRecordError, match="payload checksum mismatch"):
        _read(backend, tmp_path / "s.lts")
    report = _verify(backend, tmp_path / "s.lts")
    at = len(fmt.encode_file_header(bytes(16), META)) + len(_frame(*_record("a")))
    assert [(p.kind.value, p.offset, p.key) for p in report.problems] == [("corrupt_record", at, "a")]


# ---------------------------------------------------------------------------------------------
# Codecs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block", ["raw", "by element", "by column", "absent"])
def test_an_empty_floating_tensor_has_a_block_in_exp_huf(tmp_path, backend, block):
    blob = _blob([("e", "F32", [0, 4], b"", None), ("t", "I64", [2], I64, None)], {"key": "k"})
    no_code = struct.pack("<HH", 0, 0)  # a code-length table without symbols
    blocks = {
        "raw": b"\0",
        # 1 context, 4 streams, stride 3, context map, table, 4 stream lengths of 0
        "by element": bytes([1, 1, 4, 0, 0]) + struct.pack("<I", 3) + bytes(256) + no_code + bytes(32),
        # 1 context, 5 columns, 3 streams, context map, table, 3 stream lengths of 0
        "by column": bytes([2, 1, 0, 0, 0]) + struct.pack("<II", 5, 3) + bytes(256) + no_code + bytes(24),
        "absent": b"",
    }
    stored = blob[:-16] + blocks[block] + I64
    _shard(tmp_path / "s.lts", [(b"k", stored, len(blob), fmt.CODEC_EXP_HUF)])
    if block == "absent":
        with pytest.raises(CorruptRecordError, match="block mode 5 is unknown"):  # I64's first byte
            _read(backend, tmp_path / "s.lts")
    else:
        assert _read(backend, tmp_path / "s.lts")[1] == [("e", "F32", (0, 4), b""), ("t", "I64", (2,), I64)]


def _zstd_frame(content: bytes, dictionary_id: bytes = b"", checksum: bytes = b"") -> bytes:
    """A single-segment zstd frame of one raw block (RFC 8878), with a Dictionary_ID field of
    ``dictionary_id`` (0, 1 or 4 bytes) and a content checksum ``checksum`` (0 or 4 bytes)."""
    fhd = 0x20 | (0x04 if checksum else 0) | {0: 0, 1: 1, 4: 3}[len(dictionary_id)]
    block = ((len(content) << 3) | 1).to_bytes(3, "little")  # last block, raw
    return b"\x28\xb5\x2f\xfd" + bytes([fhd]) + dictionary_id + bytes([len(content)]) + block + content + checksum


@pytest.mark.parametrize("backend", BACKENDS)
def test_zstd_frames_with_a_content_checksum_or_a_dictionary_id(tmp_path, backend):
    _, blob, raw_len, _ = _record()
    checksum = zstandard.ZstdCompressor(write_checksum=True).compress(blob)[-4:]
    bad = bytes([checksum[0] ^ 1]) + checksum[1:]
    cases = {
        "checksum": (_zstd_frame(blob, checksum=checksum), None),
        "dictionary 0": (_zstd_frame(blob, dictionary_id=b"\0"), None),
        "dictionary 0 in 4 bytes": (_zstd_frame(blob, dictionary_id=bytes(4)), None),
        "bad checksum": (_zstd_frame(blob, checksum=bad), "checksum"),
        "dictionary 7": (_zstd_frame(blob, dictionary_id=b"\7"), "Dictionary mismatch"),
        "a real dictionary's id": (
            zstandard.ZstdCompressor(
                dict_data=zstandard.train_dictionary(1024, [bytes([i]) * 64 + blob for i in range(200)])
            ).compress(blob),
            "Dictionary mismatch",
        ),
    }
    for name, (frame, problem) in cases.items():
        for codec in (fmt.CODEC_ZSTD, fmt.CODEC_BP16_ZSTD):
            path = tmp_path / f"{name}-{codec}.lts"
            _shard(path, [(b"k", frame, raw_len, codec)])
            if problem is None:
                assert _read(backend, path)[1] == [("t", "I64", (2,), I64)], name
            else:
                with pytest.raises(CorruptRecordError, match=problem):
                    _read(backend, path)
