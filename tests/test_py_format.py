"""Struct-level encoding of the pure-Python implementation against docs/FORMAT.md's tables."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import safetensors.torch
import torch
import zstandard

from helpers import make_tensors, payload_offset, reader_class, shard_files, write_records
from layertap._py import encode
from layertap._spec import blob, codecs
from layertap._spec import format as fmt
from layertap._spec.format import FormatProblem, Truncated, crc32c
from layertap.errors import FormatError


def test_crc32c_check_value():
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"56789", crc32c(b"1234")) == 0xE3069283


def test_file_header_fields_at_their_offsets():
    shard_id = bytes(range(16))
    meta = {"writer_id": "w", "shard_index": 0}
    h = fmt.encode_file_header(shard_id, meta)
    meta_bytes = b'{"writer_id":"w","shard_index":0}'
    meta_len = len(meta_bytes)
    assert h[0:8] == b"\x89LTAP\r\n\x1a"
    assert struct.unpack_from("<HHI", h, 8) == (1, 0, meta_len)
    assert h[16:32] == shard_id
    assert h[32 : 32 + meta_len] == meta_bytes
    assert int.from_bytes(h[32 + meta_len : 36 + meta_len], "little") == crc32c(h[: 32 + meta_len])
    assert len(h) == fmt.align8(36 + meta_len) and set(h[36 + meta_len :]) <= {0}
    back = fmt.decode_file_header(h, len(h))
    assert back == (shard_id, meta, len(h))


@pytest.mark.parametrize(
    "offset, value, reason",
    [(0, 0x88, "magic"), (8, 2, "version"), (10, 1, "flags"), (40, 0x41, "checksum")],
)
def test_file_header_rejections(offset, value, reason):
    h = bytearray(fmt.encode_file_header(bytes(16), {"writer_id": "w"}))
    h[offset] = value
    with pytest.raises(FormatProblem, match=reason):
        fmt.decode_file_header(h, len(h))


def test_frame_header_fields_at_their_offsets():
    key = "rëq-1".encode()
    h = fmt.encode_frame_header(fmt.KIND_RECORD, 2, key, 13, 99, 4, 0xDEADBEEF)
    assert h[0:4] == b"LTRF"
    assert h[4] == 1 and h[5] == 2
    assert int.from_bytes(h[6:8], "little") == len(key)
    assert struct.unpack_from("<QQII", h, 8) == (13, 99, 4, 0xDEADBEEF)
    assert h[32:44] == bytes(12)
    assert int.from_bytes(h[44:48], "little") == crc32c(h[:44] + key)
    assert h[48 : 48 + len(key)] == key
    assert len(h) == fmt.align8(48 + len(key)) == 56 and h[48 + len(key) :] == bytes(56 - 48 - len(key))
    frame = h + bytes(16)  # 13 payload bytes + 3 of padding
    got = fmt.decode_frame_header(frame, len(frame))
    assert got == (1, 2, "rëq-1", 13, 99, 4, 0xDEADBEEF)
    assert got.frame_len == len(frame)


def _with_crc(h: bytearray) -> bytearray:
    key_len = int.from_bytes(h[6:8], "little")
    h[44:48] = crc32c(bytes(h[:44]) + bytes(h[48 : 48 + key_len])).to_bytes(4, "little")
    return h


def test_frame_header_rejections():
    good = bytearray(fmt.encode_frame_header(1, 0, b"k", 8, 8, 0, 0) + bytes(8))
    with pytest.raises(Truncated):
        fmt.decode_frame_header(good[:-1], len(good) - 1)
    with pytest.raises(Truncated):
        fmt.decode_frame_header(good[:40], 40)
    bad = bytearray(good)
    bad[48] ^= 0x40  # a bit of the key
    with pytest.raises(FormatProblem, match="checksum"):
        fmt.decode_frame_header(bad, len(bad))
    bad = bytearray(good)
    bad[0] = ord("X")
    with pytest.raises(FormatProblem, match="magic"):
        fmt.decode_frame_header(bad, len(bad))
    bad = bytearray(good)
    bad[4] = 3  # a reserved kind, with a right checksum
    with pytest.raises(FormatProblem, match="kind 3"):
        fmt.decode_frame_header(_with_crc(bad), len(bad))
    bad = bytearray(good)
    bad[5] = 7
    with pytest.raises(FormatProblem, match="codec id 7"):
        fmt.decode_frame_header(_with_crc(bad), len(bad))


def test_index_entry_and_trailer_layout():
    entries = [fmt.RawEntry(64, 10, 20, 3, 0x01020304, 2, "ab"), fmt.RawEntry(200, 1, 1, 0, 5, 0, "k" * 30)]
    payload = fmt.encode_index(entries)
    assert int.from_bytes(payload[0:8], "little") == 2
    e = payload[8:]
    assert struct.unpack_from("<QQQII", e, 0) == (64, 10, 20, 3, 0x01020304)
    assert e[32] == 2 and e[33] == 0 and int.from_bytes(e[34:36], "little") == 2 and e[36:40] == bytes(4)
    assert e[40:42] == b"ab" and e[42:48] == bytes(6)  # padded to align8(40 + 2) = 48
    assert int.from_bytes(e[48:56], "little") == 200
    assert len(payload) == 8 + 48 + fmt.align8(40 + 30)
    assert fmt.decode_index(payload) == entries
    with pytest.raises(FormatProblem):
        fmt.decode_index(payload[:-8])

    t = fmt.encode_trailer(4096, 3)
    assert struct.unpack_from("<QQI", t, 0) == (4096, 3, 0)
    assert int.from_bytes(t[20:24], "little") == crc32c(t[:20])
    assert t[24:32] == b"LTAPTAIL" and len(t) == 32
    assert fmt.decode_trailer(t) == (4096, 3, 0)
    assert fmt.decode_trailer(fmt.encode_trailer(4096, 3, 2)).lost_in_recovery == 2
    assert fmt.decode_trailer(t[:3] + b"\xff" + t[4:]) is None

    footer = fmt.encode_footer(entries, 4096)
    h = fmt.decode_frame_header(footer, len(footer) - 32)
    assert (h.kind, h.codec, h.key, h.num_tokens, h.stored_len) == (2, 0, "", 0, len(payload))
    assert h.raw_len == h.stored_len and h.payload_crc == crc32c(payload)
    assert footer[-32:] == fmt.encode_trailer(4096, 2)


def test_canonical_safetensors_header_matches_rust():
    # The same bytes as rust/core/src/blob.rs test `canonical_json`.
    h = blob.build_header([("token_ids", "I64", (3,))], {"key": "r1", "a": "b"})
    text = h[8:].decode().rstrip(" ")
    assert text == '{"__metadata__":{"a":"b","key":"r1"},"token_ids":{"dtype":"I64","shape":[3],"data_offsets":[0,24]}}'
    assert len(h) % 8 == 0 and int.from_bytes(h[:8], "little") == len(h) - 8


def test_canonical_header_escapes_like_serde_json():
    h = blob.build_header([("x", "U8", (1,))], {"key": "k", "v": 'a"\\\n\x01\x7fé/\u2028'})
    text = h[8:].decode().rstrip(" ")
    assert '"v":"a\\"\\\\\\n\\u0001\x7fé/\u2028"' in text


def test_parse_header_rejects_gaps_and_overruns():
    h = blob.build_header([("t", "I64", (3,))], {"key": "k"})
    good = h + bytes(24)
    meta, tensors, start = blob.parse_header(good)
    assert meta == {"key": "k"} and tensors[0].begin == start == len(h) and tensors[0].end == len(good)
    with pytest.raises(FormatProblem):
        blob.parse_header(good[:-1])
    with pytest.raises(FormatProblem, match="after the last tensor"):
        blob.parse_header(good + b"\0")
    with pytest.raises(FormatProblem):
        blob.parse_header(b"\xff" * 8 + b"{}")


def test_byte_planes_vectors():
    src = bytes(range(8))  # elements 0x0100, 0x0302, 0x0504, 0x0706
    out = np.empty(8, np.uint8)
    codecs.split_planes(src, out)
    assert out.tobytes() == bytes([1, 3, 5, 7, 0, 2, 4, 6])
    back = np.empty(8, np.uint8)
    codecs.join_planes(out.tobytes(), back)
    assert back.tobytes() == src


def test_bp16_transforms_only_two_byte_tensors():
    f16 = np.arange(4, dtype="<f2") + 0.5
    i64 = np.arange(3, dtype="<i8") - 1
    bf16 = np.frombuffer(bytes(range(16, 28)), dtype=np.uint8)  # 6 elements as raw bytes
    specs = [("a", "F16", (4,)), ("b", "I64", (3,)), ("c", "BF16", (6,))]
    header = blob.build_header(specs, {"key": "k"})
    pieces = [(memoryview(f16.view(np.uint8)), True), (memoryview(i64.view(np.uint8)), False), (memoryview(bf16), True)]
    stored = encode.Encoder(fmt.CODEC_BP16_ZSTD, 3).encode(header, pieces)[0]
    transformed = zstandard.ZstdDecompressor().decompress(stored)
    a = f16.view(np.uint8)
    c = bf16
    want = header + a[1::2].tobytes() + a[0::2].tobytes() + i64.tobytes() + c[1::2].tobytes() + c[0::2].tobytes()
    assert transformed == want
    decoded = codecs.decode(fmt.CODEC_BP16_ZSTD, stored, len(want))
    assert bytes(decoded.blob) == header + f16.tobytes() + i64.tobytes() + bf16.tobytes()
    metadata, tensors, _ = blob.parse_header(decoded.blob)
    assert (decoded.metadata, decoded.tensors) == (metadata, tensors)
    with pytest.raises(FormatProblem, match="frame header says"):
        codecs.decode(fmt.CODEC_BP16_ZSTD, stored, len(want) + 1)


def test_zstd_payload_has_content_size_and_one_frame():
    stored = encode.Encoder(fmt.CODEC_ZSTD, 3).encode(b"x" * 16, [(memoryview(b"abcd"), False)])[0]
    assert zstandard.frame_content_size(stored) == 20
    with pytest.raises(FormatProblem):
        codecs.decode(fmt.CODEC_ZSTD, stored + b"\0", 20)


def test_zstd_frame_header_that_libzstd_refuses_is_corrupt():
    """A frame whose header the block walk can follow but libzstd refuses (a window of 2**41
    bytes) is a corrupt payload, as in the Rust reader (codec.rs has the same case); it was an
    uncaught ``ZstdError`` (found by tests/fuzz/fuzz_readers.py). Now the window limit of
    FORMAT.md refuses it first."""
    raw = b"x" * 64
    stored = bytearray(zstandard.ZstdCompressor(write_content_size=False).compress(raw))
    assert not stored[4] & 0x20  # not single-segment: byte 5 is the window descriptor
    stored[5] = 31 << 3  # exponent 31: a window log of 41, over libzstd's limit
    with pytest.raises(FormatProblem, match="zstd frame asks for a window of 2199023255552 bytes, more than 134217728"):
        codecs.decode(fmt.CODEC_ZSTD, bytes(stored), len(raw))


def test_keys_and_writer_ids():
    assert fmt.key_problem("req-1") is None
    assert fmt.key_problem("ünïcode key with spaces") is None
    assert fmt.key_problem("k" * 1024) is None
    for bad in ["", "a/b", "a\\b", "a\nb", "a\x7fb", "k" * 1025, "é" * 513, 5, "\ud800"]:
        assert fmt.key_problem(bad), bad
    assert fmt.writer_id_problem("rank0") is None
    for bad in [".hidden", "a/b", "", "x" * 65, "ü"]:
        assert fmt.writer_id_problem(bad), bad
    assert fmt.shard_file_name("rank0", 7) == "rank0-000007.lts"
    assert fmt.parse_shard_index("rank0-000007.lts", "rank0") == 7
    assert fmt.parse_shard_index("rank0-1234567.lts", "rank0") == 1234567
    assert fmt.parse_shard_index("rank01-000007.lts", "rank0") is None
    assert fmt.parse_shard_index("rank0-000007.lts.tmp", "rank0") is None


def test_written_payload_is_a_safetensors_file(tmp_path):
    write_records(tmp_path, 2, codec="none")
    path = shard_files(tmp_path)[0]
    at, n, key = payload_offset(path, 1)
    with open(path, "rb") as f:
        f.seek(at)
        payload = f.read(n)
    loaded = safetensors.torch.load(payload)
    assert sorted(loaded) == ["hidden_states", "token_ids"]
    want = make_tensors(1)
    assert torch.equal(loaded["hidden_states"], want["hidden_states"])
    assert torch.equal(loaded["token_ids"], want["token_ids"])
    header = json.loads(payload[8 : 8 + int.from_bytes(payload[:8], "little")])
    assert header["__metadata__"] == {"i": "1", "key": key, "layer_ids": "[1, 3]"}
    assert list(header) == ["__metadata__", "hidden_states", "token_ids"]


def _header_with_meta_text(text: bytes) -> bytes:
    """A file header (checksum right) whose shard metadata is ``text`` as it is."""
    out = bytearray(b"\x89LTAP\r\n\x1a" + struct.pack("<HHI", 1, 0, len(text)) + bytes(16) + text)
    out += crc32c(bytes(out)).to_bytes(4, "little")
    return bytes(out + bytes(-len(out) % 8))


@pytest.mark.parametrize("reader", ["python", "rust"])
@pytest.mark.parametrize(
    "text, reason",
    [
        # Deep enough for Python's json module to raise RecursionError, not ValueError.
        (b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nest"),
        (b'{"created_unix_ms":NaN}', "JSON"),
        (b'{"note":"\\udc00"}', "JSON"),
    ],
)
def test_shard_metadata_beyond_the_json_limits_is_not_a_shard(tmp_path, reader, text, reason):
    path = tmp_path / "w-000000.lts"
    path.write_bytes(_header_with_meta_text(text))
    with pytest.raises(FormatError, match=f"not a layertap shard.*{reason}"):
        reader_class(reader)(str(path), probe_lock=False)
