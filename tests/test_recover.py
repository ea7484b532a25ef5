"""Recovery (docs/FORMAT.md, "Recovery") by both implementations, ``layertap.recover`` (the Rust
core) and the pure-Python reference, on real damaged shards: the result is the complete shard the
writer would have closed, problems stay unindexed, locked and complete shards are not touched,
and the two agree byte for byte."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from helpers import (
    HOLD_LOCK,
    Holder,
    cut_footer,
    flip_bit,
    make_tensors,
    payload_offset,
    reader_class,
    shard_files,
    write_records,
)
from layertap._types import RecoverReport
from layertap.errors import FormatError, ShardLockedError


def _recover_function(impl: str):
    if impl == "python":
        from layertap._py.recover import recover

        return recover
    reader_class("rust")  # fails (never skips) when the extension is not built
    from layertap.recover import recover

    return recover


@pytest.fixture(params=["rust", "python"])
def recover(request):
    """``recover`` of each implementation."""
    return _recover_function(request.param)


def _read(path):
    """The shard read back by the reference reader."""
    return reader_class("python")(path, probe_lock=False)


def _shard(tmp_path, n=4, codec="zstd") -> str:
    write_records(tmp_path, n, codec=codec)
    return shard_files(tmp_path)[0]


def test_torn_shard_becomes_the_complete_shard_it_would_have_been(tmp_path, recover):
    path = _shard(tmp_path)
    original = Path(path).read_bytes()
    cut_footer(path, b"LTRF" + bytes(37))
    report = recover(path)
    assert isinstance(report, RecoverReport)
    assert report == RecoverReport(path, False, 4, 41, [])
    assert Path(path).read_bytes() == original  # exactly the index and trailer the writer wrote
    again = recover(Path(path))  # os.PathLike works too
    assert again == RecoverReport(path, True, 4, 0, [])
    assert Path(path).read_bytes() == original
    with _read(path) as r:
        assert r.complete and [e.key for e in r.entries] == ["k0", "k1", "k2", "k3"]


def test_complete_shard_is_left_as_it_is(tmp_path, recover):
    path = _shard(tmp_path)
    before = Path(path).read_bytes()
    st = os.stat(path)
    assert recover(path) == RecoverReport(path, True, 4, 0, [])
    assert Path(path).read_bytes() == before and os.stat(path).st_mtime_ns == st.st_mtime_ns


def test_interrupted_recovery_gives_the_same_result(tmp_path, recover):
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


def test_corrupt_records_and_damaged_regions_stay_unindexed(tmp_path, recover):
    path = _shard(tmp_path, n=5, codec="none")
    with _read(path) as r:
        e = r.entries
    cut_footer(path, b"\1" * 13)
    at, stored_len, _ = payload_offset(path, 1)
    flip_bit(path, at + stored_len - 1)
    with open(path, "r+b") as f:
        f.seek(e[3].frame_offset + 1)
        f.write(b"XX")
    damaged = Path(path).read_bytes()
    report = recover(path)
    assert (report.was_complete, report.records, report.truncated_bytes) == (False, 3, 13)
    assert [(p.shard, p.kind, p.offset, p.key) for p in report.problems] == [
        (path, "corrupt_record", e[1].frame_offset, "k1"),
        (path, "damaged_region", e[3].frame_offset, None),
    ]
    assert all(p.message for p in report.problems)
    after = Path(path).read_bytes()
    assert after[: len(damaged) - 13] == damaged[:-13]  # the damaged bytes stay in the file
    with _read(path) as r:
        assert r.complete and [x.key for x in r.entries] == ["k0", "k2", "k4"]
        for i, k in enumerate([0, 2, 4]):
            r.check(i)
            _, tensors = r.read(i)
            assert bytes(tensors[1][3]) == make_tensors(k)["token_ids"].numpy().tobytes()


def test_locked_shard_is_refused_and_untouched(tmp_path, recover):
    path = _shard(tmp_path)
    cut_footer(path, b"x" * 9)
    before = Path(path).read_bytes()
    with Holder(HOLD_LOCK, path) as child:
        assert child.ready == "locked"
        with pytest.raises(ShardLockedError) as info:
            recover(path)
        assert info.value.path == path and "locked" in str(info.value)
        assert Path(path).read_bytes() == before
        assert child.release() == 0
    assert recover(path).records == 4


def test_a_killed_writer_is_recovered(tmp_path, recover):
    """A writer process SIGKILLed with records written but the shard not closed: while it runs
    the shard is refused; once it is dead, recovery makes every flushed record readable."""
    code = (
        "import sys, torch\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from helpers import make_tensors\n"
        "from layertap import ShardWriter\n"
        "w = ShardWriter(sys.argv[1], codec='bp16-zstd', writer_id='dead')\n"
        "for i in range(6):\n"
        "    w.submit(f'k{i}', make_tensors(i))\n"
        "w.flush()\n"
        "print('written', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    holder = Holder(code, str(tmp_path), str(Path(__file__).parent))
    with holder as child:
        assert child.ready == "written"
        path = shard_files(tmp_path)[0]
        with pytest.raises(ShardLockedError):
            recover(path)
        child.proc.send_signal(signal.SIGKILL)
        assert child.proc.wait(timeout=30) == -signal.SIGKILL
    report = recover(path)
    assert (report.was_complete, report.records, report.problems) == (False, 6, [])
    with reader_class("rust")(path) as r:
        assert r.complete and not r.being_written
        for i in range(6):
            _, tensors = r.read(i)
            got = {
                n: torch.frombuffer(b, dtype=torch.bfloat16 if d == "BF16" else torch.int64).reshape(s)
                for n, d, s, b in tensors
            }
            want = make_tensors(i)
            assert torch.equal(got["hidden_states"], want["hidden_states"]) and torch.equal(
                got["token_ids"], want["token_ids"]
            )


def test_shard_cut_inside_its_header_padding_is_padded_and_completed(tmp_path, recover):
    from test_rust_reader import _shard_cut_in_header_padding

    path, cut, header_len = _shard_cut_in_header_padding(tmp_path)
    head = Path(path).read_bytes()
    assert recover(path) == RecoverReport(path, False, 0, 0, [])
    data = Path(path).read_bytes()
    assert data[:cut] == head and data[cut:header_len] == bytes(header_len - cut)
    with _read(path) as r:
        assert r.complete and r.entries == [] and r.data_end == header_len


def test_not_a_shard_and_missing(tmp_path, recover):
    p = tmp_path / "notes.lts"
    p.write_bytes(b"just some text that is long enough to not be a header")
    with pytest.raises(FormatError) as info:
        recover(p)
    assert info.value.path == str(p)
    assert p.read_bytes().startswith(b"just some text")
    with pytest.raises(FileNotFoundError):
        recover(tmp_path / "missing.lts")


def test_shard_without_records(tmp_path, recover):
    path = _shard(tmp_path, n=1)
    with _read(path) as r:
        first = r.entries[0].frame_offset
    with open(path, "r+b") as f:
        f.truncate(first + 30)
    report = recover(path)
    assert report.records == 0 and report.truncated_bytes == 30
    with _read(path) as r:
        assert r.complete and r.entries == []


def test_file_cut_inside_the_header_padding(tmp_path, recover):
    # docs/FORMAT.md: an open shard without records or torn tail; recovery pads it with zeros.
    from layertap._spec import format as fmt

    meta = {"writer_id": "p", "x": ""}
    while fmt.align8(36 + len(json_bytes(meta))) - (36 + len(json_bytes(meta))) < 2:
        meta["x"] += "a"  # until the header has at least 2 bytes of padding
    header = fmt.encode_file_header(bytes(16), meta)
    cut = 36 + len(json_bytes(meta)) + 1  # the CRC is there, not all the padding
    assert cut < len(header)
    path = tmp_path / "p-000000.lts"
    path.write_bytes(header[:cut])
    with _read(path) as r:
        assert not r.complete and r.entries == [] and r.torn_tail_bytes == 0 and r.scan_problems == []
        assert r.header_len == len(header)
    report = recover(path)
    assert not report.was_complete and report.records == 0 and report.truncated_bytes == 0
    assert path.read_bytes() == header + fmt.encode_footer([], len(header))
    with _read(path) as r:
        assert r.complete and r.entries == []


def json_bytes(meta: dict) -> bytes:
    return json.dumps(meta, ensure_ascii=False, separators=(",", ":")).encode()


def _report_key(report: RecoverReport):
    return (
        report.was_complete,
        report.records,
        report.truncated_bytes,
        [(p.kind, p.offset, p.key) for p in report.problems],
    )


def test_rust_agrees_with_the_python_reference(tmp_path):
    recover, py_recover = _recover_function("rust"), _recover_function("python")
    """Both recoveries give the same bytes and reports on shards cut or damaged anywhere."""
    path = _shard(tmp_path, n=3, codec="none")
    original = Path(path).read_bytes()
    rust_copy, py_copy = tmp_path / "rust.lts", tmp_path / "py.lts"
    variants = [original[:cut] for cut in range(200, len(original) + 1, 13)]
    for at in range(200, len(original), 11):
        data = bytearray(original[: len(original) - 40])  # an open shard with a torn tail ...
        data[at % len(data)] ^= 0x21  # ... and a damaged byte
        variants.append(bytes(data))
    for data in variants:
        rust_copy.write_bytes(data)
        py_copy.write_bytes(data)
        try:
            want = py_recover(py_copy)
        except FormatError:
            with pytest.raises(FormatError):
                recover(rust_copy)
            continue
        got = recover(rust_copy)
        assert _report_key(got) == _report_key(want), len(data)
        assert rust_copy.read_bytes() == py_copy.read_bytes(), len(data)
