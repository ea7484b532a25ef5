"""The Rust-backed shard reader (``layertap._rust_reader.RustShardReader``): what it returns, zero
copy for codec ``none``, corruption, files that are not shards, the writer's lock, and agreement
with the pure-Python reference reader on the test vectors and on damaged shards."""

from __future__ import annotations

import hashlib
import json
import os
import threading

import numpy as np
import pytest
import torch

import layertap
from helpers import (
    HOLD_LOCK,
    VECTORS,
    Holder,
    cut_footer,
    flip_bit,
    make_tensors,
    payload_offset,
    reader_class,
    shard_files,
    write_records,
)
from layertap._tensors import to_torch
from layertap._types import IndexEntry
from layertap.errors import CorruptRecordError, FormatError

RustShardReader = None  # set by the autouse fixture, failing (never skipping) when not built


@pytest.fixture(autouse=True)
def _rust_reader():
    global RustShardReader
    RustShardReader = reader_class("rust")


def _tensors(reader, i, verify=True) -> tuple[dict, dict]:
    metadata, tensors = reader.read(i, verify)
    return metadata, {name: to_torch(buf, dtype, shape) for name, dtype, shape, buf in tensors}


def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _mapping_of(address: int) -> str | None:
    """The file mapped at ``address`` in this process (``/proc/self/maps``), if any."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) == 6 else None
    return None


@pytest.mark.parametrize("codec", ["none", "zstd", "bp16-zstd"])
def test_records_read_back_as_written(tmp_path, codec):
    write_records(tmp_path, 4, codec=codec)
    path = shard_files(tmp_path)[0]
    with RustShardReader(path) as r:
        assert r.complete and not r.being_written and r.torn_tail_bytes == 0 and r.scan_problems == []
        assert r.file_bytes == os.path.getsize(path)
        assert r.meta["writer_id"] == "w" and r.meta["user"] == {}
        assert [e.key for e in r.entries] == ["k0", "k1", "k2", "k3"]
        assert all(isinstance(e, IndexEntry) and e.codec == codec for e in r.entries)
        for i in range(4):
            metadata, tensors = _tensors(r, i)
            assert metadata == {"key": f"k{i}", "layer_ids": "[1, 3]", "i": str(i)}
            want = make_tensors(i)
            assert list(tensors) == list(want)
            for name in want:
                assert tensors[name].dtype == want[name].dtype
                assert torch.equal(tensors[name], want[name])
            r.check(i)
            r.check(i - 4)  # negative positions count from the end
        with pytest.raises(IndexError):
            r.read(4)


def test_vectors_match_expected_json():
    expected = json.loads((VECTORS / "expected.json").read_text())
    assert len(expected["files"]) >= 6
    for name, want in expected["files"].items():
        path = str(VECTORS / name)
        with RustShardReader(path) as r:
            assert r.file_bytes == want["file_bytes"], name
            assert r.complete == want["complete"], name
            assert r.header_len == want["header_len"], name
            assert r.shard_id.hex() == want["shard_id"], name
            assert r.meta == want["meta"], name
            assert r.torn_tail_bytes == want["torn_tail_bytes"], name
            assert r.data_end == want["data_end"], name
            assert [{"kind": p.kind, "offset": p.offset, "key": p.key} for p in r.scan_problems] == want[
                "open_problems"
            ]
            assert all(p.shard == path and p.message for p in r.scan_problems)
            assert len(r.entries) == len(want["records"]), name
            for i, (e, w) in enumerate(zip(r.entries, want["records"])):
                assert e == IndexEntry(
                    w["key"],
                    w["frame_offset"],
                    w["stored_len"],
                    w["raw_len"],
                    w["num_tokens"],
                    w["codec"],
                    w["payload_crc"],
                ), (name, i)
                if not w["ok"]:
                    for call in (lambda i=i: r.read(i), lambda i=i: r.check(i)):
                        with pytest.raises(CorruptRecordError) as err:
                            call()
                        assert (err.value.path, err.value.offset, err.value.key) == (path, e.frame_offset, e.key)
                    continue
                r.check(i)
                metadata, tensors = r.read(i)
                assert metadata == w["metadata"], (name, i)
                assert [(t, d, list(s)) for t, d, s, _ in tensors] == [
                    (t["name"], t["dtype"], t["shape"]) for t in w["tensors"]
                ]
                for (tname, dtype, shape, buf), wt in zip(tensors, w["tensors"]):
                    values = to_torch(buf, dtype, shape).to(torch.float64 if dtype[0] in "FB" else torch.int64)
                    assert values.flatten().tolist() == wt["values"], (name, i, tname)


def test_codec_none_is_zero_copy_and_private(tmp_path):
    # 64 tokens x 4 layers x 256 hidden in bf16: 128 KiB, above the private-mapping threshold.
    hidden = torch.randn(64, 4, 256).to(torch.bfloat16)
    from layertap import ShardWriter

    with ShardWriter(os.fspath(tmp_path), codec="none", writer_id="z") as w:
        w.submit("big", {"hidden_states": hidden, "token_ids": torch.arange(64)})
    path = shard_files(tmp_path)[0]
    before = _sha(path)
    r = RustShardReader(path)
    _metadata, tensors = r.read(0)
    name, dtype, shape, buf = tensors[0]
    assert name == "hidden_states" and buf.base.mapped
    assert isinstance(buf, np.ndarray) and buf.flags.writeable and buf.dtype == np.uint8
    t = to_torch(buf, dtype, shape)
    # No copy: the tensor's memory is a mapping of the shard file itself.
    assert buf.ctypes.data == t.data_ptr() == buf.base.address
    assert _mapping_of(t.data_ptr()) == os.path.realpath(path)
    assert torch.equal(t, hidden)
    # Writing to it changes neither the file nor what the next read returns.
    t.mul_(2)
    assert torch.equal(t, hidden * 2)
    assert _sha(path) == before
    _, again = _tensors(r, 0)
    assert torch.equal(again["hidden_states"], hidden)
    # The tensor outlives the reader.
    r.close()
    assert r.closed
    assert torch.equal(t, hidden * 2)
    with pytest.raises(ValueError, match="closed"):
        r.read(0)
    r.close()  # idempotent


@pytest.mark.parametrize("codec", ["none", "zstd", "bp16-zstd"])
def test_small_and_compressed_records_are_writable_buffers(tmp_path, codec):
    write_records(tmp_path, 1, codec=codec)
    path = shard_files(tmp_path)[0]
    with RustShardReader(path) as r:
        _, tensors = r.read(0)
        for _, dtype, shape, buf in tensors:
            assert buf.flags.writeable and not buf.base.mapped
            t = to_torch(buf, dtype, shape)
            assert t.data_ptr() == buf.ctypes.data  # to_torch did not copy either
            t.zero_()
        assert torch.equal(_tensors(r, 0)[1]["token_ids"], make_tensors(0)["token_ids"])


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_corrupt_record_raises_with_path_offset_key(tmp_path, codec):
    write_records(tmp_path, 3, codec=codec)
    path = shard_files(tmp_path)[0]
    at, stored_len, key = payload_offset(path, 1)
    flip_bit(path, at + stored_len - 2, 0x08)  # in the last tensor's data
    with RustShardReader(path) as r:
        assert r.complete and r.scan_problems == []  # the index is used; payloads are not read
        frame_offset = r.entries[1].frame_offset
        for call in (lambda: r.read(1), lambda: r.check(1)):
            with pytest.raises(CorruptRecordError) as err:
                call()
            assert (err.value.path, err.value.offset, err.value.key) == (path, frame_offset, key)
            assert "checksum" in str(err.value) and path in str(err.value)
        _tensors(r, 0)
        _tensors(r, 2)
        if codec == "none":
            r.read(1, verify=False)  # unverified reads do not look at the checksum


def test_open_shard_with_torn_tail(tmp_path):
    write_records(tmp_path, 3)
    path = shard_files(tmp_path)[0]
    end = cut_footer(path, b"LTRF" + bytes(50))
    with RustShardReader(path) as r:
        assert not r.complete and r.torn_tail_bytes == 54
        assert [(p.kind, p.offset, p.key) for p in r.scan_problems] == [("torn_tail", end, None)]
        assert [e.key for e in r.entries] == ["k0", "k1", "k2"]
        for i in range(3):
            assert torch.equal(_tensors(r, i)[1]["hidden_states"], make_tensors(i)["hidden_states"])


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"", "torn empty shard"),  # the start of a header: a writer died creating it
        (b"PK\x03\x04 a zip file, not a shard", "magic"),
        (b"\x89LTAP\r\n\x1a\x01\x00", "torn empty shard"),
    ],
)
def test_not_a_shard_raises_format_error(tmp_path, content, reason):
    path = tmp_path / "x.lts"
    path.write_bytes(content)
    with pytest.raises(FormatError) as err:
        RustShardReader(path)
    assert err.value.path == str(path) and reason in str(err.value) and "not a layertap shard" in str(err.value)
    with pytest.raises(FormatError, match="regular file"):
        RustShardReader(tmp_path)
    with pytest.raises(FileNotFoundError) as missing:
        RustShardReader(tmp_path / "missing.lts")
    assert missing.value.filename == str(tmp_path / "missing.lts")


def _shard_cut_in_header_padding(tmp_path) -> tuple[str, int, int]:
    """A shard cut after its header checksum but before the header's zero padding ends, as a
    writer killed right after writing its header can leave it: ``(path, cut, header_len)``."""
    from layertap import ShardWriter

    for k in range(8):  # user metadata of k bytes, until the header needs padding
        directory = tmp_path / f"ds{k}"
        with ShardWriter(os.fspath(directory), writer_id="w", metadata={"pad": "x" * k}) as w:
            w.submit("a", {"x": (b"12345678", "U8", (8,))})
        path = shard_files(directory)[0]
        with open(path, "rb") as f:
            meta_len = int.from_bytes(f.read(16)[12:16], "little")
        cut = 36 + meta_len
        if cut % 8:
            os.truncate(path, cut)
            return path, cut, (cut + 7) // 8 * 8
    raise AssertionError("no metadata length gave a header with padding")


def test_shard_cut_inside_its_header_padding(tmp_path):
    path, cut, header_len = _shard_cut_in_header_padding(tmp_path)
    with RustShardReader(path) as r:
        assert not r.complete and r.entries == [] and r.file_bytes == cut
        assert (r.header_len, r.data_end, r.torn_tail_bytes, r.scan_problems) == (header_len, header_len, 0, [])


def test_being_written_follows_a_writers_lock(tmp_path):
    write_records(tmp_path, 1)
    path = shard_files(tmp_path)[0]
    with Holder(HOLD_LOCK, path) as child:
        assert child.ready == "locked"
        assert RustShardReader(path).being_written
        assert not RustShardReader(path, probe_lock=False).being_written
        assert child.release() == 0
    assert not RustShardReader(path).being_written


def test_concurrent_reads_from_threads(tmp_path):
    write_records(tmp_path, 8, codec="bp16-zstd")
    path = shard_files(tmp_path)[0]
    r = RustShardReader(path)
    failures = []

    def work(k):
        try:
            for _ in range(20):
                for i in range(8):
                    got = _tensors(r, (i + k) % 8)[1]["hidden_states"]
                    if not torch.equal(got, make_tensors((i + k) % 8)["hidden_states"]):
                        failures.append(i)
        except Exception as e:  # pragma: no cover - reported below
            failures.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    r.close()
    assert failures == []


def test_dataset_reads_through_the_rust_backend(tmp_path):
    import layertap

    write_records(tmp_path, 5, codec="bp16-zstd", shard_size=1)  # one record per shard
    with layertap.open(tmp_path, backend="rust") as ds:
        assert {type(b).__name__ for b in ds.backends} == {"RustShardReader"}
        assert ds.keys() == [f"k{i}" for i in range(5)]
        for i, rec in enumerate(ds):
            assert torch.equal(rec.hidden_states, make_tensors(i)["hidden_states"])
            assert rec.layer_ids == [1, 3]
        assert ds.verify().ok


def _summary(r):
    return (
        r.complete,
        r.file_bytes,
        r.data_end,
        r.torn_tail_bytes,
        r.meta,
        list(r.entries),
        [(p.kind, p.offset, p.key) for p in r.scan_problems],
    )


def _outcomes(r):
    out = []
    for i in range(len(r.entries)):
        try:
            metadata, tensors = r.read(i)
            out.append((metadata, [(n, d, tuple(s), bytes(memoryview(b))) for n, d, s, b in tensors]))
        except CorruptRecordError as e:
            out.append(("corrupt", e.offset, e.key))
        try:
            r.check(i)
            out.append("check ok")
        except CorruptRecordError as e:
            out.append(("check failed", e.offset, e.key))
    return out


@pytest.mark.parametrize("complete", [True, False])
def test_agrees_with_the_python_reader_on_every_flipped_byte(tmp_path, complete):
    """Both readers find the same records, problems and failures, whatever byte is damaged."""
    py_reader = reader_class("python")
    write_records(tmp_path, 3, codec="zstd")
    path = shard_files(tmp_path)[0]
    if not complete:
        cut_footer(path)
    with open(path, "rb") as f:
        original = f.read()
    damaged = tmp_path / "damaged.lts"
    for at in range(len(original)):
        data = bytearray(original)
        data[at] ^= 1 << (at % 8)
        damaged.write_bytes(data)
        try:
            py = py_reader(damaged, probe_lock=False)
        except FormatError:
            with pytest.raises(FormatError):
                RustShardReader(damaged, probe_lock=False)
            continue
        with py, RustShardReader(damaged, probe_lock=False) as rust:
            assert _summary(rust) == _summary(py), at
            assert _outcomes(rust) == _outcomes(py), at


@pytest.mark.parametrize("codec", ["zstd", "bp16-zstd", "exp-huf"])
def test_records_read_into_memory_other_records_left_hold_their_own(tmp_path, codec):
    """``read`` decodes a compressed record of 64 KiB or more into memory that a dropped record
    left (its bytes still there): every record, read forwards then backwards, each dropped
    before the next, holds exactly what was written (its key, its tensors of its own sizes)."""
    gen = torch.Generator().manual_seed(7)
    written = {}
    with layertap.ShardWriter(tmp_path, codec=codec) as w:
        for i, tokens in enumerate([96, 400, 64, 256, 128]):  # 96 KiB to 400 KiB of bf16
            hidden = (torch.randn(tokens, 2, 256, generator=gen) * (i + 1)).to(torch.bfloat16)
            ids = torch.arange(tokens, dtype=torch.int64) * (i + 3)
            written[f"r{i}"] = {"hidden_states": hidden, "token_ids": ids}
            w.submit(f"r{i}", written[f"r{i}"])
    with layertap.open(tmp_path, backend="rust") as ds:
        keys = list(written)
        for key in keys + keys[::-1]:
            rec = ds[key]
            assert rec.key == key
            for name, want in written[key].items():
                assert torch.equal(rec[name], want), (key, name)
            del rec
