"""What ``recover`` leaves out of a shard stays visible (issue 11, item 5): the trailer counts it
(docs/FORMAT.md, "Index frame and trailer"), and ``ShardInfo``, ``verify``'s notes and
``layertap inspect``/``verify`` show it."""

from __future__ import annotations

import json
import shutil

import pytest

import layertap
from helpers import VECTORS, run_cli


@pytest.fixture(params=["rust", "python"])
def backend(request) -> str:
    return request.param


def _recovered(tmp_path, backend: str):
    # open-damaged.lts: a corrupt record and a damaged region before its last valid record.
    ds = tmp_path / "ds"
    ds.mkdir()
    shard = ds / "b-000000.lts"
    shutil.copyfile(VECTORS / "open-damaged.lts", shard)
    proc = run_cli("recover", "--backend", backend, "--json", shard)
    assert proc.returncode == 1  # recover itself reports the loss
    [result] = json.loads(proc.stdout)["shards"]
    assert [p["kind"] for p in result["problems"]] == ["corrupt_record", "damaged_region"]
    return ds, shard


def test_the_trailer_keeps_the_count(tmp_path, backend):
    ds, shard = _recovered(tmp_path, backend)
    assert shard.read_bytes() == (VECTORS / "recovered-lost.lts").read_bytes()
    with layertap.open(ds, backend=backend) as d:
        assert [s.lost_in_recovery for s in d.shards] == [2]
        report = d.verify()
        assert report.ok and report.records_ok == 2 and report.lost_in_recovery == 2
        [note] = report.notes
        assert (note.shard, note.kind) == (str(shard), "lost_in_recovery")
        assert "left 2 damaged parts" in note.message and "bytes of it are not indexed" in note.message


def test_verify_and_inspect_show_it(tmp_path, backend):
    ds, shard = _recovered(tmp_path, backend)
    verify = run_cli("verify", "--backend", backend, ds)
    assert verify.returncode == 0, verify.stderr
    assert f"note: lost_in_recovery: {shard}: an earlier `layertap recover` left 2" in verify.stderr
    assert "2 damaged parts lost in an earlier recovery" in verify.stdout
    doc = json.loads(run_cli("verify", "--json", "--backend", backend, ds).stdout)
    assert doc["ok"] and doc["lost_in_recovery"] == 2 and [n["kind"] for n in doc["notes"]] == ["lost_in_recovery"]

    inspect = run_cli("inspect", "--backend", backend, ds).stdout
    header = next(line for line in inspect.splitlines() if line.startswith("shard "))
    assert header.split()[-1] == "lost"
    row = next(line for line in inspect.splitlines() if line.startswith("b-000000.lts"))
    assert row.split()[-1] == "2"
    assert "lost in recovery: 2 damaged parts" in inspect
    doc = json.loads(run_cli("inspect", "--json", "--backend", backend, ds).stdout)
    assert doc["lost_in_recovery"] == 2 and [s["lost_in_recovery"] for s in doc["shards"]] == [2]


def test_nothing_is_said_where_nothing_was_lost(tmp_path, backend):
    shutil.copyfile(VECTORS / "open-torn.lts", tmp_path / "w-000000.lts")
    assert run_cli("recover", "--backend", backend, tmp_path / "w-000000.lts").returncode == 0
    verify = run_cli("verify", "--backend", backend, tmp_path)
    assert verify.returncode == 0 and "note:" not in verify.stderr and "lost" not in verify.stdout
    assert "lost" not in run_cli("inspect", "--backend", backend, tmp_path).stdout
