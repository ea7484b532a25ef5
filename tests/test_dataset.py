"""``layertap.open`` / ``Dataset`` / ``Record`` over real shards, with both shard backends.

The ``rust`` cases fail (they do not skip) while the Rust reader is not built.
"""

from __future__ import annotations

import os
import shutil
import textwrap

import pytest
import torch

import layertap
from helpers import (
    HOLD_LOCK,
    VECTORS,
    Holder,
    cut_footer,
    flip_bit,
    hand_made_shard,
    make_tensors,
    payload_offset,
    reader_class,
    shard_files,
    write_records,
)
from layertap._py.recover import recover
from layertap.errors import FormatError, InvalidInputError, RecordNotFoundError, ShardLockedError

BACKENDS = ["python", "rust"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def _open(path, backend: str):
    reader_class(backend)  # fails the test (not a skip) when the Rust reader is missing
    return layertap.open(path, backend=backend)


def _two_writers(path) -> None:
    """Writer "b" (3 shards) and writer "a" (2 shards), so that name order is not write order."""
    write_records(path, 7, writer_id="b", prefix="b", codec="bp16-zstd", shard_size=1000)
    write_records(path, 4, writer_id="a", prefix="a", codec="none", shard_size=1000)


def test_order_lookup_and_records(tmp_path, backend):
    _two_writers(tmp_path)
    names = [os.path.basename(p) for p in shard_files(tmp_path)]
    assert names[0].startswith("a-") and len(names) >= 4
    with _open(tmp_path, backend) as ds:
        keys = [f"a{i}" for i in range(4)] + [f"b{i}" for i in range(7)]
        assert len(ds) == 11 and ds.keys() == keys
        assert [r.key for r in ds] == keys
        assert ds[0].key == "a0" and ds[-1].key == "b6" and ds[-11].key == "a0"
        rec = ds["b3"]
        want = make_tensors(3)
        assert torch.equal(rec.hidden_states, want["hidden_states"])
        assert torch.equal(rec.token_ids, want["token_ids"]) and torch.equal(rec["token_ids"], want["token_ids"])
        assert rec.layer_ids == [1, 3] and rec.metadata == {"key": "b3", "layer_ids": "[1, 3]", "i": "3"}
        assert rec.num_tokens == 3 and rec.shard.startswith(str(tmp_path)) and rec.offset >= 32
        assert "b3" in repr(rec) and "bfloat16[3, 2, 8]" in repr(rec)
        assert "a1" in ds and "zz" not in ds and 3 not in ds
        assert ds.get("zz") is None and ds.get("zz", 5) == 5 and ds.get("a2").key == "a2"
        with pytest.raises(RecordNotFoundError, match="zz"):
            ds["zz"]
        with pytest.raises(KeyError):
            ds["zz"]
        with pytest.raises(IndexError):
            ds[11]
        with pytest.raises(IndexError):
            ds[-12]
        with pytest.raises(TypeError):
            ds[1.5]
        report = ds.verify()
        assert report.ok and report.records_ok == 11 and report.records_bad == 0


def test_shard_infos_from_the_indexes(tmp_path, backend):
    done = write_records(tmp_path, 5, writer_id="w", codec="zstd", metadata={"run": "7"})
    with _open(tmp_path, backend) as ds:
        (info,) = ds.shards
        assert info.path == shard_files(tmp_path)[0]
        assert info.complete and not info.being_written and info.records == 5 and info.tokens == 15
        assert info.raw_bytes == sum(c.raw_len for c in done)
        assert info.stored_bytes == sum(c.stored_len for c in done)
        assert info.file_bytes == os.path.getsize(info.path) and info.torn_tail_bytes == 0
        assert info.codecs == {"zstd": 5} and info.meta["user"] == {"run": "7"}


def test_one_shard_file(tmp_path, backend):
    write_records(tmp_path, 3)
    path = shard_files(tmp_path)[0]
    with _open(path, backend) as ds:
        assert ds.keys() == ["k0", "k1", "k2"] and len(ds.shards) == 1


def test_records_without_hidden_states(tmp_path, backend):
    with layertap.ShardWriter(tmp_path) as w:
        w.submit("x", {"scores": torch.arange(5, dtype=torch.float32)})
    with _open(tmp_path, backend) as ds:
        rec = ds["x"]
        assert rec.hidden_states is None and rec.token_ids is None and rec.layer_ids is None
        assert rec.num_tokens == 0 and rec["scores"].tolist() == [0, 1, 2, 3, 4]


def test_foreign_records_empty_tensors_and_any_order(tmp_path, backend):
    # Another writer may store empty tensors and list tensors in the header in any order.
    hand_made_shard(
        tmp_path / "x.lts",
        [
            ("r", [("empty", "F32", (0, 3), b""), ("ids", "I32", (2,), b"\x01\0\0\0\x02\0\0\0")], {"m": "v"}),
        ],
    )
    with _open(tmp_path, backend) as ds:
        rec = ds["r"]
        assert tuple(rec["empty"].shape) == (0, 3) and rec["ids"].tolist() == [1, 2]
        assert rec.metadata == {"m": "v", "key": "r"}
        assert ds.verify().ok


def test_duplicate_keys_across_writers(tmp_path, backend):
    write_records(tmp_path, 2, writer_id="a", prefix="k")
    with layertap.ShardWriter(tmp_path, writer_id="b") as w:
        w.submit("k1", make_tensors(99))
    with _open(tmp_path, backend) as ds:
        assert ds.keys() == ["k0", "k1", "k1"]
        assert torch.equal(ds["k1"].hidden_states, make_tensors(1)["hidden_states"])  # the first
        report = ds.verify()
        assert not report.ok and report.records_ok == 3
        (p,) = report.problems
        assert p.kind == "duplicate_key" and p.key == "k1" and p.shard.endswith("b-000000.lts")
        assert "a-000000.lts" in p.message


def test_corrupt_record_reported_by_verify(tmp_path, backend):
    write_records(tmp_path, 3, codec="none")
    path = shard_files(tmp_path)[0]
    at, n, _key = payload_offset(path, 1)
    flip_bit(path, at + n - 3)
    with _open(tmp_path, backend) as ds:
        assert ds[0].key == "k0"
        with pytest.raises(layertap.CorruptRecordError) as info:
            ds["k1"]
        assert info.value.key == "k1" and info.value.path == path
        report = ds.verify()
        assert not report.ok and report.records_ok == 2 and report.records_bad == 1
        (p,) = report.problems
        assert (p.kind, p.key, p.shard) == ("corrupt_record", "k1", path)
        assert not p.message.startswith(path)


def test_iteration_goes_on_past_corrupt_records_when_asked(tmp_path, backend):
    write_records(tmp_path, 5, codec="zstd", shard_size=1000)  # several shards
    paths = shard_files(tmp_path)
    damaged = []
    for path, record in ((paths[0], 1), (paths[-1], 0)):
        at, n, key = payload_offset(path, record)
        flip_bit(path, at + n // 2)
        damaged.append(key)
    with _open(tmp_path, backend) as ds:
        with pytest.raises(layertap.CorruptRecordError) as info:
            list(ds)  # errors="raise", the default
        assert info.value.key == damaged[0]
        with pytest.raises(layertap.CorruptRecordError):
            list(ds.iter(errors="raise"))
        it = ds.iter(errors="skip")
        assert isinstance(it, layertap.RecordIterator) and it.skipped == 0
        keys = [rec.key for rec in it]
        assert keys == [k for k in ds.keys() if k not in damaged]
        assert it.skipped == 2 and [p.key for p in it.problems] == damaged
        assert {p.kind for p in it.problems} == {"corrupt_record"}
        assert "checksum" in it.problems[0].message and not it.problems[0].message.startswith(paths[0])
        assert list(it) == []  # exhausted
        with pytest.raises(InvalidInputError, match="errors must be one of 'raise', 'skip'"):
            ds.iter(errors="ignore")


def test_records_as_numpy_arrays(tmp_path, backend):
    import ml_dtypes
    import numpy as np

    write_records(tmp_path, 2)
    with _open(tmp_path, backend) as torch_ds:
        want = [{n: t.clone() for n, t in rec.tensors.items()} for rec in torch_ds]
    reader_class(backend)
    with layertap.open(tmp_path, backend=backend, tensors="numpy") as ds:
        for rec, tensors in zip(ds, want):
            assert isinstance(rec.hidden_states, np.ndarray) and rec.hidden_states.dtype == ml_dtypes.bfloat16
            assert rec.hidden_states.shape == tuple(tensors["hidden_states"].shape)
            assert torch.equal(
                torch.from_numpy(rec.hidden_states.view(np.uint16)), tensors["hidden_states"].view(torch.uint16)
            )
            assert rec.token_ids.dtype == np.int64 and rec.token_ids.tolist() == tensors["token_ids"].tolist()
            assert "hidden_states: bfloat16[3, 2, 8]" in repr(rec)
    with pytest.raises(InvalidInputError, match="tensors must be one of 'auto', 'torch', 'numpy'"):
        layertap.open(tmp_path, tensors="jax")


def test_open_shard_torn_tail(tmp_path, backend):
    write_records(tmp_path, 3)
    path = shard_files(tmp_path)[0]
    end = cut_footer(path, b"LTRF" + bytes(20))
    with _open(tmp_path, backend) as ds:
        (info,) = ds.shards
        assert not info.complete and not info.being_written and info.torn_tail_bytes == 24
        assert ds.keys() == ["k0", "k1", "k2"] and ds[2].key == "k2"
        report = ds.verify()
        assert report.records_ok == 3 and [(p.kind, p.offset) for p in report.problems] == [("torn_tail", end)]


def test_not_a_shard_in_a_directory_is_reported(tmp_path, backend):
    write_records(tmp_path, 2)
    (tmp_path / "zz.lts").write_bytes(b"definitely not a shard, but named like one")
    (tmp_path / "notes.txt").write_text("not part of the dataset")
    (tmp_path / "sub.lts").mkdir()
    with _open(tmp_path, backend) as ds:
        assert len(ds) == 2 and len(ds.shards) == 1
        report = ds.verify()
        assert [(p.kind, os.path.basename(p.shard)) for p in report.problems] == [("not_a_shard", "zz.lts")]


def test_vectors_through_the_dataset(backend):
    with _open(VECTORS / "corrupt-payload.lts", backend) as ds:
        report = ds.verify()
        assert [(p.kind, p.key) for p in report.problems] == [("corrupt_record", "req-1")]
    with _open(VECTORS / "bp16-zstd.lts", backend) as ds:
        assert ds["rëq-2 ✓"]["extra_i16"].tolist() == [-300, 0, 7, 32767]


def test_open_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        layertap.open(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FormatError, match="no shards") as info:
        layertap.open(tmp_path / "empty")
    assert str(tmp_path / "empty") in str(info.value)
    (tmp_path / "text.lts").write_text("hello")
    with pytest.raises(FormatError, match="text.lts"):
        layertap.open(tmp_path / "text.lts", backend="python")
    with pytest.raises(InvalidInputError, match="backend"):
        layertap.open(tmp_path, backend="java")


def test_auto_backend_is_rust_when_built(tmp_path):
    write_records(tmp_path, 1)
    rust = reader_class("rust")
    with layertap.open(tmp_path) as ds:
        assert all(isinstance(b, rust) for b in ds.backends)


_HOLD_WRITER = textwrap.dedent(
    """
    import sys, torch, layertap
    w = layertap.ShardWriter(sys.argv[1], writer_id="live", codec="zstd")
    for i in range(3):
        w.submit(f"live{i}", {"x": torch.full((4,), float(i))})
    w.flush()
    print("ready", flush=True)
    sys.stdin.readline()
    w.submit("last", {"x": torch.zeros(2)})
    w.close()
    """
)


def test_shard_being_written_by_another_process(tmp_path, backend):
    write_records(tmp_path, 2, writer_id="done")
    with Holder(_HOLD_WRITER, str(tmp_path)) as child:
        assert child.ready == "ready"
        live = os.path.join(str(tmp_path), "live-000000.lts")
        with _open(tmp_path, backend) as ds:
            infos = {os.path.basename(i.path): i for i in ds.shards}
            assert infos["live-000000.lts"].being_written and not infos["live-000000.lts"].complete
            assert not infos["done-000000.lts"].being_written
            assert ds.keys() == ["k0", "k1", "live0", "live1", "live2"]
            assert ds["live2"]["x"].tolist() == [2.0] * 4
            assert ds.verify().ok
        with pytest.raises(ShardLockedError):
            recover(live)
        assert child.release() == 0
    with _open(tmp_path, backend) as ds:
        assert all(i.complete and not i.being_written for i in ds.shards)
        assert ds.keys()[-1] == "last"


def test_torn_tail_of_a_live_shard_is_not_a_problem(tmp_path, backend):
    shard = tmp_path / "w-000000.lts"
    shutil.copyfile(VECTORS / "open-torn.lts", shard)
    with Holder(HOLD_LOCK, str(shard)) as child:
        assert child.ready == "locked"
        with _open(tmp_path, backend) as ds:
            assert ds.shards[0].being_written and ds.shards[0].torn_tail_bytes == 100
            report = ds.verify()
            assert report.ok and report.records_ok == 3
        assert child.release() == 0
    with _open(tmp_path, backend) as ds:
        assert [p.kind for p in ds.verify().problems] == ["torn_tail"]


def test_shard_whose_header_is_not_written_yet(tmp_path):
    write_records(tmp_path, 1, writer_id="a")
    fresh = tmp_path / "b-000000.lts"
    fresh.write_bytes(b"\x89LTAP")  # created, locked, header not written yet
    with Holder(HOLD_LOCK, str(fresh)) as child:
        assert child.ready == "locked"
        with layertap.open(tmp_path, backend="python") as ds:
            assert len(ds) == 1 and ds.shards[1].being_written and ds.verify().ok
