"""Datasets of several parts (docs/FORMAT.md, "Datasets of several parts"): ``layertap.open``
over a list of directories or a manifest, the duplicate-key policy across writers, and
``inspect``/``verify``/``HiddenStatesDataset`` over them; bad manifests are one clear error."""

from __future__ import annotations

import json
import os

import pytest
import torch

import layertap
from helpers import make_tensors, run_cli, write_records
from layertap.errors import FormatError, InvalidInputError
from layertap.parts import MANIFEST_NAME, read_manifest, write_manifest


@pytest.fixture(params=["python", "rust"])
def backend(request):
    return request.param


@pytest.fixture
def parts(tmp_path):
    """Two engines' directories under one root, keys 0..5 split between them, plus a manifest."""
    root = tmp_path / "hs"
    with layertap.ShardWriter(root / "engine-0", writer_id="gen-0") as w:
        for i in (0, 2, 4):
            w.submit(str(i), make_tensors(i))
    with layertap.ShardWriter(root / "engine-1", writer_id="gen-0") as w:
        for i in (1, 3, 5):
            w.submit(str(i), make_tensors(i))
    write_manifest(root, ["engine-0", "engine-1"], source="test")
    return root


def test_manifest_round_trip(parts):
    text = json.loads((parts / MANIFEST_NAME).read_text())
    assert text == {"layertap_dataset": 1, "parts": ["engine-0", "engine-1"], "source": "test"}
    assert read_manifest(parts / MANIFEST_NAME) == [str(parts / "engine-0"), str(parts / "engine-1")]


def test_open_manifest_directory_list_and_file(parts, backend):
    want = ["0", "2", "4", "1", "3", "5"]  # parts in order, then file order
    for given in (parts, parts / MANIFEST_NAME, [parts / "engine-0", parts / "engine-1"]):
        with layertap.open(given, backend=backend) as ds:
            assert ds.keys() == want and len(ds.shards) == 2
            assert ds.parts == [str(parts / "engine-0"), str(parts / "engine-1")]
            assert ds.shard_name(ds.shards[1].path) == os.path.join("engine-1", "gen-0-000000.lts")
            for i in range(6):
                assert torch.equal(ds[str(i)].hidden_states, make_tensors(i)["hidden_states"])
            assert ds.verify().ok and ds.duplicates == []
    with layertap.open([parts / "engine-1", parts / "engine-0"], backend=backend) as ds:
        assert ds.keys() == ["1", "3", "5", "0", "2", "4"] and ds.manifest is None


def test_dot_part_and_absolute_part(parts, tmp_path, backend):
    """``"."`` is the manifest directory's own shards; a part may be anywhere."""
    write_records(parts, 1, writer_id="top", prefix="t")
    elsewhere = tmp_path / "node7"
    write_records(elsewhere, 1, writer_id="far", prefix="f")
    write_manifest(parts, [".", "engine-1", str(elsewhere)])
    stored = json.loads((parts / MANIFEST_NAME).read_text())["parts"]
    assert stored == [".", "engine-1", str(elsewhere)]
    with layertap.open(parts, backend=backend) as ds:
        assert ds.keys() == ["t0", "1", "3", "5", "f0"]


def test_duplicate_keys_across_parts(parts, tmp_path, backend):
    """The first record in dataset order (parts as listed) is the key's; verify reports the
    others, or lists them apart with allow_duplicates."""
    with layertap.ShardWriter(parts / "engine-2", writer_id="gen-0") as w:
        w.submit("3", make_tensors(99))
    write_manifest(parts, ["engine-0", "engine-1", "engine-2"])
    with layertap.open(parts, backend=backend) as ds:
        assert len(ds) == 7 and ds.keys().count("3") == 2
        assert torch.equal(ds["3"].hidden_states, make_tensors(3)["hidden_states"])
        (dup,) = ds.duplicates
        assert dup.kind == "duplicate_key" and dup.key == "3" and "engine-2" in dup.shard
        report = ds.verify()
        assert not report.ok and report.problems == [dup] and report.records_ok == 7
        report = ds.verify(allow_duplicates=True)
        assert report.ok and report.duplicates == [dup]
    write_manifest(parts, ["engine-2", "engine-0", "engine-1"])  # the listed order decides
    with layertap.open(parts, backend=backend) as ds:
        assert torch.equal(ds["3"].hidden_states, make_tensors(99)["hidden_states"])
        assert "engine-1" in ds.duplicates[0].shard


def test_empty_part_is_fine_but_no_shards_at_all_is_not(tmp_path):
    root = tmp_path / "hs"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    write_manifest(root, ["a", "b"])
    with pytest.raises(FormatError, match="no shards .* in any of its 2 parts"):
        layertap.open(root)
    write_records(root / "b", 2)
    with layertap.open(root) as ds:
        assert len(ds) == 2


@pytest.mark.parametrize(
    "body, match",
    [
        ("not json", "not a dataset manifest .not JSON"),
        ('{"parts": ["a"]}', 'no "layertap_dataset" member'),
        ('{"layertap_dataset": 2, "parts": ["a"]}', "manifest version 2; this layertap reads version 1"),
        ('{"layertap_dataset": 1, "parts": []}', '"parts" must be a non-empty list'),
        ('{"layertap_dataset": 1, "parts": ["a", 3]}', '"parts" must be a non-empty list'),
    ],
)
def test_bad_manifest(tmp_path, body, match):
    (tmp_path / "a").mkdir()
    (tmp_path / MANIFEST_NAME).write_text(body)
    with pytest.raises(FormatError, match=match) as info:
        layertap.open(tmp_path)
    assert MANIFEST_NAME in str(info.value)


def test_missing_part_nested_manifest_and_repeated_part(parts, tmp_path):
    write_manifest(parts, ["engine-0", "engine-9"])
    with pytest.raises(FileNotFoundError) as info:
        layertap.open(parts)
    assert info.value.filename == str(parts / "engine-9") and MANIFEST_NAME in info.value.strerror
    write_manifest(parts / "engine-1", ["."])
    write_manifest(parts, ["engine-0", "engine-1"])
    with pytest.raises(FormatError, match="holds a manifest of its own"):
        layertap.open(parts)
    os.unlink(parts / "engine-1" / MANIFEST_NAME)
    with pytest.raises(InvalidInputError, match="the same part is given twice"):
        layertap.open([parts / "engine-0", str(parts / "engine-0") + "/"])
    with pytest.raises(InvalidInputError, match="each part once"):
        write_manifest(parts, ["engine-0", "./engine-0"])
    with pytest.raises(InvalidInputError, match="empty list"):
        layertap.open([])


def test_cli_inspect_and_verify_over_parts(parts):
    proc = run_cli("inspect", parts)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"{parts}: 2 shards (2 complete), 6 records")
    assert lines[1] == f"2 parts (manifest {parts / MANIFEST_NAME})"
    assert any(line.startswith("engine-1/gen-0-000000.lts") for line in lines)
    summary = json.loads(run_cli("inspect", "--json", parts).stdout)
    assert summary["parts"] == [str(parts / "engine-0"), str(parts / "engine-1")]
    assert summary["duplicate_keys"] == 0 and summary["records"] == 6
    proc = run_cli("verify", parts / "engine-0", parts / "engine-1")
    assert proc.returncode == 0 and proc.stdout.startswith("OK: ") and "in 2 shards of 2 parts" in proc.stdout
    with layertap.ShardWriter(parts / "engine-1", writer_id="gen-1") as w:
        w.submit("0", make_tensors(0))
    proc = run_cli("verify", parts)
    assert proc.returncode == 1 and "duplicate_key: " in proc.stderr and proc.stdout.startswith("FAILED")
    proc = run_cli("verify", "--allow-duplicates", parts)
    assert proc.returncode == 0, proc.stderr
    assert "1 duplicate key allowed (the first record of each counts)" in proc.stdout
    assert "1 duplicate key: the first record" in run_cli("inspect", parts).stdout
    (parts / MANIFEST_NAME).write_text('{"layertap_dataset": 1, "parts": ["engine-0", "gone"]}')
    proc = run_cli("verify", parts)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"layertap verify: {parts / 'gone'}: no such file or directory (a part listed in {parts / MANIFEST_NAME})"
    )


def test_torch_dataset_over_parts(parts):
    from layertap.torch import HiddenStatesDataset

    ds = HiddenStatesDataset(parts)
    assert ds.keys == [str(i) for i in range(6)]  # row order across the parts
    assert torch.equal(ds[5]["hidden_states"], make_tensors(5)["hidden_states"])
    ds = HiddenStatesDataset([parts / "engine-1", parts / "engine-0"])
    assert len(ds) == 6


def test_export_over_parts(tmp_path):
    """``layertap export`` of a dataset of parts: one file per row, whichever part holds it."""
    from safetensors.torch import load_file

    from layertap.export import export

    root = tmp_path / "hs"
    for part, rows in (("engine-0", (0, 2)), ("engine-1", (1, 3))):
        with layertap.ShardWriter(root / part, writer_id="gen-0") as w:
            for i in rows:
                w.submit(str(i), make_tensors(i), metadata={"layer_ids": "[1, 3]"})
    write_manifest(root, ["engine-0", "engine-1"])
    s = export(str(root), str(tmp_path / "out"), "speculators", workers=1, fsync=False)
    assert s.ok and (s.selected, s.written, s.duplicates) == (4, 4, 0)
    for i in range(4):
        got = load_file(tmp_path / "out" / "hidden_states" / f"hs_{i}.safetensors")
        assert torch.equal(got["hidden_states"], make_tensors(i)["hidden_states"])
