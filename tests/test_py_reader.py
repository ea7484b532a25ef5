"""The pure-Python shard reader on damaged and growing shards (docs/FORMAT.md, "Reading")."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from helpers import cut_footer, flip_bit, hand_made_shard, make_tensors, shard_files, write_records
from layertap._py.reader import PyShardReader
from layertap._spec import format as fmt
from layertap.errors import CorruptRecordError, FormatError


def _shard(tmp_path, n=4, codec="none", **kw) -> str:
    write_records(tmp_path, n, codec=codec, **kw)
    return shard_files(tmp_path)[0]


def _kinds(r):
    return [(p.kind, p.offset, p.key) for p in r.scan_problems]


def _entries(path):
    with PyShardReader(path, probe_lock=False) as r:
        return r.raw_entries()


def test_complete_shard_uses_the_index(tmp_path):
    path = _shard(tmp_path, codec="bp16-zstd")
    with PyShardReader(path) as r:
        assert r.complete and not r.being_written and r.torn_tail_bytes == 0 and r.scan_problems == []
        assert [e.key for e in r.entries] == ["k0", "k1", "k2", "k3"]
        assert r.entries[0].codec == "bp16-zstd" and r.file_bytes == os.path.getsize(path)
        metadata, tensors = r.read(2)
        assert metadata == {"key": "k2", "layer_ids": "[1, 3]", "i": "2"}
        assert [(n, d, s) for n, d, s, _ in tensors] == [
            ("hidden_states", "BF16", (3, 2, 8)),
            ("token_ids", "I64", (3,)),
        ]
        assert bytes(tensors[1][3]) == make_tensors(2)["token_ids"].numpy().tobytes()
        for i in range(4):
            r.check(i)


def test_open_shard_with_torn_tail_is_scanned(tmp_path):
    path = _shard(tmp_path)
    end = cut_footer(path, b"LTRF" + bytes(60))  # an unfinished frame header
    with PyShardReader(path) as r:
        assert not r.complete and len(r.entries) == 4 and r.data_end == end
        assert r.torn_tail_bytes == 64
        assert _kinds(r) == [("torn_tail", end, None)]
        r.check(3)


def test_frame_being_written_stops_the_scan(tmp_path):
    path = _shard(tmp_path, n=5)
    entries = _entries(path)
    cut = entries[4].frame_offset + 100  # header intact, payload unfinished
    end = cut_footer(path)
    with open(path, "r+b") as f:
        f.truncate(cut)
    with PyShardReader(path) as r:
        assert [e.key for e in r.entries] == ["k0", "k1", "k2", "k3"]
        assert r.torn_tail_bytes == cut - entries[4].frame_offset and end > cut
        assert _kinds(r) == [("torn_tail", entries[4].frame_offset, None)]


def test_corrupt_record_and_damaged_region_are_skipped_and_reported(tmp_path):
    path = _shard(tmp_path, n=5)
    e = _entries(path)
    cut_footer(path)
    flip_bit(path, e[1].payload_offset + 10)
    with open(path, "r+b") as f:
        f.seek(e[2].frame_offset)
        f.write(b"\0" * 8)
    with PyShardReader(path) as r:
        assert [x.key for x in r.entries] == ["k0", "k3", "k4"]
        assert _kinds(r) == [("corrupt_record", e[1].frame_offset, "k1"), ("damaged_region", e[2].frame_offset, None)]
        assert f"[{e[2].frame_offset}, {e[3].frame_offset})" in r.scan_problems[1].message
        assert r.torn_tail_bytes == 0


def test_damage_after_the_last_valid_record_is_torn_tail(tmp_path):
    path = _shard(tmp_path, n=3)
    e = _entries(path)
    cut_footer(path)
    flip_bit(path, e[2].payload_offset + 3)
    with PyShardReader(path) as r:
        assert [x.key for x in r.entries] == ["k0", "k1"]
        assert _kinds(r) == [("torn_tail", e[2].frame_offset, None)]
        assert r.torn_tail_bytes == e[2].frame_len


def test_damaged_index_falls_back_to_scanning(tmp_path):
    path = _shard(tmp_path)
    size = os.path.getsize(path)
    end = _entries(path)[-1].frame_offset + _entries(path)[-1].frame_len
    flip_bit(path, end + 60)  # inside the index payload; the trailer is still valid
    with PyShardReader(path) as r:
        assert not r.complete and [e.key for e in r.entries] == ["k0", "k1", "k2", "k3"]
        assert _kinds(r) == [("bad_index", end, None)]
        assert "unusable" in r.scan_problems[0].message
        assert r.torn_tail_bytes == 0 and r.data_end == end and r.file_bytes == size


def test_index_frame_without_trailer_is_a_bad_index(tmp_path):
    path = _shard(tmp_path)
    end = _entries(path)[-1].frame_offset + _entries(path)[-1].frame_len
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 5)  # the writer died writing the trailer
    with PyShardReader(path) as r:
        assert not r.complete and len(r.entries) == 4 and r.torn_tail_bytes == 0
        assert _kinds(r) == [("bad_index", end, None)]


def test_index_disagreeing_with_frames_is_found_by_check(tmp_path):
    path = _shard(tmp_path, n=2)
    e = _entries(path)
    # Rewrite the footer with entry 1's num_tokens changed: the index is valid but wrong.
    wrong = [e[0], e[1]._replace(num_tokens=99)]
    end = cut_footer(path)
    with open(path, "ab") as f:
        f.write(fmt.encode_footer(wrong, end))
    with PyShardReader(path) as r:
        assert r.complete
        r.check(0)
        with pytest.raises(CorruptRecordError, match="does not agree with the index") as info:
            r.check(1)
        assert (info.value.path, info.value.offset, info.value.key) == (path, e[1].frame_offset, "k1")


def test_read_reports_corruption_with_path_offset_key(tmp_path):
    path = _shard(tmp_path, codec="zstd")
    e = _entries(path)[1]
    flip_bit(path, e.payload_offset + 5)
    with PyShardReader(path) as r:
        assert r.complete  # the index is fine; the payload is found bad only when read
        with pytest.raises(CorruptRecordError, match="checksum") as info:
            r.read(1)
        assert (info.value.path, info.value.offset, info.value.key) == (path, e.frame_offset, "k1")
        with pytest.raises(CorruptRecordError):  # without the CRC check, zstd or parsing fails
            r.read(1, verify=False)
        r.read(0)


def test_metadata_key_must_match_the_frame_key(tmp_path):
    x = [("x", "U8", (4,), b"abcd")]
    hand_made_shard(tmp_path / "ok.lts", [("a", x, {})])
    hand_made_shard(tmp_path / "bad.lts", [("a", x, {})], meta_key={"a": "b"})
    with PyShardReader(tmp_path / "ok.lts") as r:
        assert r.read(0)[0] == {"key": "a"}
        r.check(0)
    with PyShardReader(tmp_path / "bad.lts") as r:
        with pytest.raises(CorruptRecordError, match="differs from the frame key"):
            r.read(0)


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"", "torn empty shard"),  # the start of a header: recover removes it
        (b"hello world, not a shard at all" * 3, "wrong magic"),
        (b"\x89LTAP\r\n\x1a\x02\x00", "too short"),
    ],
)
def test_not_a_shard(tmp_path, content, reason):
    p = tmp_path / "x.lts"
    p.write_bytes(content)
    with pytest.raises(FormatError, match=reason) as info:
        PyShardReader(p)
    assert info.value.path == str(p) and str(p) in str(info.value)


def test_version_and_header_checksum(tmp_path):
    path = _shard(tmp_path, n=1)
    data = bytearray(Path(path).read_bytes())
    bad = tmp_path / "v.lts"
    bad.write_bytes(data[:8] + b"\x02" + data[9:])
    with pytest.raises(FormatError, match="version 2"):
        PyShardReader(bad)
    data[40] ^= 1
    bad.write_bytes(data)
    with pytest.raises(FormatError, match="checksum"):
        PyShardReader(bad)
    with pytest.raises(FormatError, match="regular file"):
        PyShardReader(tmp_path)


def test_growing_shard_and_being_written(tmp_path):
    from layertap import ShardWriter

    with ShardWriter(tmp_path, codec="none", writer_id="g") as w:
        w.submit("a", make_tensors(0))
        w.flush()
        path = shard_files(tmp_path)[0]
        with PyShardReader(path) as r:
            assert r.being_written and not r.complete and [e.key for e in r.entries] == ["a"]
            w.submit("b", make_tensors(1))
            w.flush()
            assert len(r.entries) == 1  # what was there when it was opened
            r.check(0)
        with PyShardReader(path) as r:
            assert [e.key for e in r.entries] == ["a", "b"]
    with PyShardReader(path) as r:
        assert r.complete and not r.being_written


def test_lock_probe_does_not_take_the_lock(tmp_path):
    path = _shard(tmp_path, n=1)
    with PyShardReader(path) as r:
        assert not r.being_written
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: the probe released it
        finally:
            os.close(fd)
