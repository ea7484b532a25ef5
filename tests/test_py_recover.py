"""The pure-Python recovery (docs/FORMAT.md, "Recovery") on real damaged shards."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import pytest

from helpers import cut_footer, flip_bit, shard_files, write_records
from layertap._py.reader import PyShardReader
from layertap._py.recover import recover
from layertap.errors import FormatError, ShardLockedError


def _shard(tmp_path, n=4, codec="zstd") -> str:
    write_records(tmp_path, n, codec=codec)
    return shard_files(tmp_path)[0]


def test_complete_shard_is_left_as_it_is(tmp_path):
    path = _shard(tmp_path)
    before = Path(path).read_bytes()
    st = os.stat(path)
    report = recover(path)
    assert report.was_complete and report.records == 4 and report.truncated_bytes == 0 and not report.problems
    assert Path(path).read_bytes() == before and os.stat(path).st_mtime_ns == st.st_mtime_ns


def test_torn_shard_becomes_the_complete_shard_it_would_have_been(tmp_path):
    path = _shard(tmp_path)
    original = Path(path).read_bytes()
    cut_footer(path, b"LTRF" + bytes(37))
    report = recover(path)
    assert not report.was_complete and report.records == 4 and report.truncated_bytes == 41
    assert report.problems == []
    # Index and trailer are exactly what the writer would have written.
    assert Path(path).read_bytes() == original
    assert recover(path).was_complete


def test_interrupted_recovery_gives_the_same_result(tmp_path):
    path = _shard(tmp_path)
    cut_footer(path, b"torn bytes")
    reference = tmp_path / "reference.lts"
    shutil.copyfile(path, reference)
    recover(reference)
    done = Path(reference).read_bytes()
    data_end = cut_footer(reference)
    footer = done[data_end:]
    # Every way a recovery can be cut short: footer partly written, trailer missing or torn.
    for cut in (1, 47, 48, len(footer) - 32, len(footer) - 5):
        Path(path).write_bytes(done[: data_end + cut])
        report = recover(path)
        assert not report.was_complete and report.records == 4 and report.truncated_bytes == cut
        assert Path(path).read_bytes() == done, cut


def test_corrupt_records_and_damaged_regions_stay_unindexed(tmp_path):
    path = _shard(tmp_path, n=5, codec="none")
    with PyShardReader(path, probe_lock=False) as r:
        e = r.raw_entries()
    cut_footer(path, b"\1" * 13)
    flip_bit(path, e[1].payload_offset + 20)
    with open(path, "r+b") as f:
        f.seek(e[3].frame_offset + 1)
        f.write(b"XX")
    size = os.path.getsize(path)
    report = recover(path)
    assert report.records == 3 and report.truncated_bytes == 13
    assert [(p.kind, p.offset, p.key) for p in report.problems] == [
        ("corrupt_record", e[1].frame_offset, "k1"),
        ("damaged_region", e[3].frame_offset, None),
    ]
    with PyShardReader(path) as r:
        assert r.complete and [x.key for x in r.raw_entries()] == ["k0", "k2", "k4"]
        assert r.data_end == size - 13  # the damaged bytes stay in the file
        for i in range(3):
            r.check(i)


def test_locked_shard_is_not_touched(tmp_path):
    path = _shard(tmp_path)
    cut_footer(path, b"x" * 9)
    before = Path(path).read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a live writer holds it
        with pytest.raises(ShardLockedError) as info:
            recover(path)
        assert info.value.path == path and "locked" in str(info.value)
    finally:
        os.close(fd)
    assert Path(path).read_bytes() == before
    assert recover(path).records == 4


def test_not_a_shard_and_missing(tmp_path):
    p = tmp_path / "notes.lts"
    p.write_bytes(b"just some text that is long enough to not be a header")
    with pytest.raises(FormatError):
        recover(p)
    assert p.read_bytes().startswith(b"just some text")
    with pytest.raises(FileNotFoundError):
        recover(tmp_path / "missing.lts")


def test_shard_without_records(tmp_path):
    path = _shard(tmp_path, n=1)
    with PyShardReader(path, probe_lock=False) as r:
        first = r.raw_entries()[0].frame_offset
    with open(path, "r+b") as f:
        f.truncate(first + 30)
    report = recover(path)
    assert report.records == 0 and report.truncated_bytes == 30
    with PyShardReader(path) as r:
        assert r.complete and r.entries == []


@pytest.mark.parametrize("impl", ["python", "rust"])
def test_file_cut_inside_the_header_padding(tmp_path, impl):
    # docs/FORMAT.md: an open shard without records or torn tail; recovery pads it with zeros.
    import layertap
    from layertap._spec import format as fmt

    recover_fn = recover if impl == "python" else layertap.recover

    meta = {"writer_id": "p", "x": ""}
    while fmt.align8(36 + len(json_bytes(meta))) - (36 + len(json_bytes(meta))) < 2:
        meta["x"] += "a"  # until the header has at least 2 bytes of padding
    header = fmt.encode_file_header(bytes(16), meta)
    cut = 36 + len(json_bytes(meta)) + 1  # the CRC is there, not all the padding
    assert cut < len(header)
    path = tmp_path / "p-000000.lts"
    path.write_bytes(header[:cut])
    with PyShardReader(path) as r:
        assert not r.complete and r.entries == [] and r.torn_tail_bytes == 0 and r.scan_problems == []
        assert r.header_len == len(header)
    report = recover_fn(path)
    assert not report.was_complete and report.records == 0 and report.truncated_bytes == 0
    assert path.read_bytes() == header + fmt.encode_footer([], len(header))
    with PyShardReader(path) as r:
        assert r.complete and r.entries == []


def json_bytes(meta: dict) -> bytes:
    import json

    return json.dumps(meta, ensure_ascii=False, separators=(",", ":")).encode()
