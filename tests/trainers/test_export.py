"""``layertap export``: the speculators and SpecForge layouts hold exactly the records' tensors
(and, for SpecForge's EAGLE-3, the last layer after the verifier's final norm as transformers
computes it), every record is checked, bad input is refused with one line, and an export killed
with SIGKILL continues when run again."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from trainers_support import LAYERS, layertap_cli, prepared_rows, write_dataset

import layertap
from layertap.errors import InvalidInputError
from layertap.export import export
from layertap.export.files import TMP_SUFFIX, ExportLock
from layertap.export.rows import parse_keys, select

# -------------------------------------------------------------------------------------------
# rows


def test_keys_spec():
    assert parse_keys("3,0-2, 7") == [0, 1, 2, 3, 7]
    assert parse_keys("5-5") == [5]
    for bad in ("", "a", "-1", "3-1", "01", "2-"):
        with pytest.raises(InvalidInputError, match="--keys"):
            parse_keys(bad)


def test_keys_from_file(tmp_path):
    f = tmp_path / "keys.txt"
    f.write_text("4\n\n0-1\n")
    assert parse_keys(f"@{f}") == [0, 1, 4]
    with pytest.raises(InvalidInputError, match="--keys @"):
        parse_keys(f"@{tmp_path / 'absent'}")


def test_selection_of_rows():
    sel = select(["10", "2", "x", "02", "2", "0"])
    assert sel.rows == [0, 2, 10]
    assert sel.positions == {10: 0, 2: 1, 0: 5}
    assert (sel.not_rows, sel.duplicates) == (2, [2])  # "x" and "02" are not row indices
    sel = select(["0", "1", "2", "3"], wanted=[1, 3, 9], limit=1)
    assert (sel.rows, sel.missing) == ([1], [9])


# -------------------------------------------------------------------------------------------
# speculators


def test_speculators_layout_holds_the_records(hs_dataset, tmp_path, rows):
    out = tmp_path / "prepared"
    s = export(hs_dataset, str(out), "speculators", workers=3)
    assert s.ok and (s.selected, s.written, s.failed) == (len(rows), len(rows), 0)
    names = sorted(os.listdir(out / "hidden_states"))
    assert names == sorted(
        [f"hs_{i}.safetensors" for i in range(len(rows))] + ["layertap-export.json", ".layertap-export.lock"]
    )
    manifest = json.loads((out / "hidden_states" / "layertap-export.json").read_text())
    assert manifest["layer_ids"] == LAYERS and manifest["dtype"] == "bfloat16"
    with layertap.open(hs_dataset) as ds:
        for i in range(len(rows)):
            got = load_file(out / "hidden_states" / f"hs_{i}.safetensors")
            rec = ds[str(i)]
            assert set(got) == {"hidden_states", "token_ids"}
            assert torch.equal(got["hidden_states"], rec.hidden_states)
            assert got["hidden_states"].dtype == torch.bfloat16
            assert torch.equal(got["token_ids"], rec.token_ids)
            assert got["token_ids"].tolist() == rows[i]["input_ids"]


def test_speculators_layer_choice_and_dtype(hs_dataset, tmp_path, verifier):
    s = export(hs_dataset, str(tmp_path / "o"), "speculators", layers=[2, 4], dtype="float32", keys=[3], model=verifier)
    assert s.written == 1
    got = load_file(tmp_path / "o" / "hidden_states" / "hs_3.safetensors")
    with layertap.open(hs_dataset) as ds:
        want = ds["3"].hidden_states[:, [1, 3]].float()
    assert torch.equal(got["hidden_states"], want)
    # speculators takes the last layer as the verifier's last hidden state: it must be N.
    with pytest.raises(InvalidInputError, match="last exported layer"):
        export(hs_dataset, str(tmp_path / "o2"), "speculators", layers=[1, 2], model=verifier)


# -------------------------------------------------------------------------------------------
# SpecForge


def _ckpt(root, row):
    g = row // 2000 * 2000
    return torch.load(os.path.join(root, f"rows_{g}-{g + 2000}", f"data_{row}.ckpt"), weights_only=True)


def _norm_by_hand(verifier, x):
    """LlamaRMSNorm written out, with the checkpoint's weight, in float32."""
    w = load_file(os.path.join(verifier, "model.safetensors"))["model.norm.weight"].float()
    with open(os.path.join(verifier, "config.json")) as f:
        eps = json.load(f)["rms_norm_eps"]
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_specforge_eagle3_layout(hs_dataset, tmp_path, rows, truth, verifier):
    out = tmp_path / "sf"
    s = export(hs_dataset, str(out), "specforge", model=verifier, workers=2)
    assert s.ok and s.written == len(rows)
    assert s.settings["layer_ids"] == [1, 2, 3] and s.settings["specforge_layer_ids"] == [0, 1, 2]
    assert s.settings["final_norm"] == "LlamaRMSNorm"
    with layertap.open(hs_dataset) as ds:
        for i, row in enumerate(rows):
            got = _ckpt(out, i)
            assert set(got) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
            S = len(row["input_ids"])
            assert got["input_ids"].dtype == torch.int64 and got["input_ids"].tolist() == row["input_ids"]
            assert got["loss_mask"].dtype == torch.int64 and got["loss_mask"].tolist() == row["loss_mask"]
            assert got["aux_hidden_state"].shape == (1, S, 3 * 128) and got["aux_hidden_state"].dtype == torch.bfloat16
            assert got["hidden_state"].shape == (1, S, 128) and got["hidden_state"].dtype == torch.bfloat16
            stored = ds[str(i)].hidden_states  # bf16 [S, 4, 128], layers 1..4
            assert torch.equal(got["aux_hidden_state"][0], stored[:, :3].reshape(S, -1))
            # The final norm of the stored layer N, rounded once: exactly the norm written out...
            assert torch.equal(got["hidden_state"][0], _norm_by_hand(verifier, stored[:, 3]).bfloat16())
            # ...and transformers' own last hidden state (after its norm), to bfloat16 precision.
            states, after_norm = truth.states(row["input_ids"])
            torch.testing.assert_close(got["hidden_state"][0].float(), after_norm, rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(
                got["aux_hidden_state"][0].float(), states[:, 1:4].reshape(S, -1), rtol=1e-2, atol=1e-2
            )


def test_specforge_dflash_layout(tmp_path, truth):
    rows = prepared_rows(4, seed=3)
    rows[2]["loss_mask"] = [1, 0] * (len(rows[2]["input_ids"]) // 2) + [0] * (len(rows[2]["input_ids"]) % 2)
    ds_path = tmp_path / "ds"
    write_dataset(ds_path, rows, truth, dtype=torch.float32)
    s = export(str(ds_path), str(tmp_path / "df"), "specforge", strategy="dflash", layers=[1, 3])
    assert (s.written, s.skipped) == (3, 1) and s.ok
    assert list(s.skip_reasons.values()) == [1] and "consecutive" in next(iter(s.skip_reasons))
    assert s.settings["specforge_layer_ids"] == [0, 2]
    assert not os.path.exists(tmp_path / "df" / "rows_0-2000" / "data_2.ckpt")
    got = _ckpt(tmp_path / "df", 1)
    states, _ = truth.states(rows[1]["input_ids"])
    S = len(rows[1]["input_ids"])
    assert set(got) == {"input_ids", "loss_mask", "hidden_states"}
    assert got["hidden_states"].dtype == torch.bfloat16 and got["hidden_states"].shape == (1, S, 256)
    assert torch.equal(got["hidden_states"][0], states[:, [1, 3]].reshape(S, -1).bfloat16())


def test_specforge_group_directories(tmp_path):
    # Rows 1999 and 2000 fall in two groups of 2000, as SpecForge names them.
    g = torch.Generator().manual_seed(0)
    with layertap.ShardWriter(str(tmp_path / "ds")) as w:
        for key in ("1999", "2000"):
            w.submit(
                key,
                {"hidden_states": torch.randn(5, 2, 8, generator=g), "token_ids": torch.arange(5, dtype=torch.int64)},
                metadata={"layer_ids": "[1, 3]"},
            )
    s = export(str(tmp_path / "ds"), str(tmp_path / "df"), "specforge", strategy="dflash")
    assert s.written == 2 and s.no_loss_mask == 2
    assert os.path.exists(tmp_path / "df" / "rows_0-2000" / "data_1999.ckpt")
    assert _ckpt(tmp_path / "df", 2000)["loss_mask"].tolist() == [1] * 5


# -------------------------------------------------------------------------------------------
# bad input, bad records


def test_refusals(hs_dataset, tmp_path, verifier, truth, rows, capsys):
    from layertap.cli import main

    def refused(*args):
        capsys.readouterr()
        assert main(["export", *map(str, args)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith("layertap export: "), err
        return err

    out = str(tmp_path / "o")
    assert "needs --model" in refused(hs_dataset, "--to", "specforge", out)
    assert "no such file" in refused(str(tmp_path / "absent"), "--to", "speculators", out)
    assert "no layer [7]" in refused(hs_dataset, "--to", "specforge", out, "--strategy", "dflash", "--layers", "1,7")
    write_dataset(tmp_path / "with0", rows[:1], truth, layers=[0, 2])
    assert "embeddings" in refused(str(tmp_path / "with0"), "--to", "specforge", out, "--strategy", "dflash")
    assert "3 auxiliary layers" in refused(hs_dataset, "--to", "specforge", out, "--model", verifier, "--layers", "1,2")
    assert "needs --compress" in refused(hs_dataset, "--to", "specforge", out, "--compression-level", "3")
    assert "1 to 9" in refused(hs_dataset, "--to", "specforge", out, "--compress", "--compression-level", "10")
    assert "is for --to specforge" in refused(hs_dataset, "--to", "speculators", out, "--compress")
    # Keys that are not row indices (a server whose client set no sample_id).
    write_dataset(tmp_path / "ids", rows[:2], truth, keys=["cmpl-a", "cmpl-b"])
    assert "row index" in refused(str(tmp_path / "ids"), "--to", "speculators", out)
    # EAGLE-3 needs layer N stored.
    write_dataset(tmp_path / "noN", rows[:1], truth, layers=[1, 2, 3])
    assert "needs layer 4" in refused(str(tmp_path / "noN"), "--to", "specforge", out, "--model", verifier)
    # A model family whose final norm is not at get_decoder().norm.
    from transformers import GPT2Config

    GPT2Config(n_embd=128, n_layer=4, n_head=2).save_pretrained(tmp_path / "gpt2")
    assert "not supported" in refused(hs_dataset, "--to", "specforge", out, "--model", str(tmp_path / "gpt2"))
    # A second export into the same place while one runs.
    with ExportLock(os.path.join(out, "hidden_states")):
        assert "another layertap export" in refused(hs_dataset, "--to", "speculators", out)
    # Continuing an export with other settings.
    assert main(["export", hs_dataset, "--to", "speculators", out, "--limit", "1"]) == 0
    assert "other settings" in refused(hs_dataset, "--to", "speculators", out, "--dtype", "float32")


def test_the_export_lock_closes_once(tmp_path):
    """A second close of the lock leaves alone the descriptor the first one freed, which the
    next file opened gets (POSIX gives the lowest free number)."""
    lock = ExportLock(str(tmp_path))
    lock.close()
    fd = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        lock.close()
        os.fstat(fd)  # still open
    finally:
        os.close(fd)


def test_another_dataset_into_an_export_is_refused(hs_dataset, tmp_path, rows, truth, capsys):
    """An export directory belongs to one dataset: its manifest names it, and exporting another
    dataset there with the same settings is refused (it wrote nothing and left the first
    dataset's files in place, as if they were the second's). The same dataset continues."""
    from layertap.cli import main

    other = tmp_path / "other"
    write_dataset(other, rows[:3], truth)
    out = tmp_path / "o"
    assert main(["export", hs_dataset, "--to", "speculators", str(out), "--limit", "2"]) == 0
    manifest = json.loads((out / "hidden_states" / "layertap-export.json").read_text())
    assert manifest["source"] == os.path.abspath(hs_dataset)
    before = sorted(os.listdir(out / "hidden_states"))
    capsys.readouterr()
    assert main(["export", str(other), "--to", "speculators", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("layertap export: "), err
    assert f"holds an export of {os.path.abspath(hs_dataset)}" in err and "another directory" in err
    assert f"remove {out / 'hidden_states'}" in err  # the export's own directory, not speculators' data
    assert sorted(os.listdir(out / "hidden_states")) == before
    # The first dataset, by another path to the same directory, continues its export.
    link = tmp_path / "link"
    link.symlink_to(hs_dataset)
    s = export(str(link), str(out), "speculators")
    assert (s.existing, s.written, s.ok) == (2, len(rows) - 2, True)


def test_a_dflash_export_that_skips_rows_succeeds(tmp_path, truth):
    """Rows SpecForge's DFlash trainer refuses (no two consecutive supervised tokens) get no file,
    as SpecForge's own capture leaves them out: that is a complete export (exit 0, the skips
    counted), not a failure that a rerun could fix."""
    rows = prepared_rows(3, seed=3)
    rows[1]["loss_mask"] = [1, 0] * (len(rows[1]["input_ids"]) // 2) + [0] * (len(rows[1]["input_ids"]) % 2)
    write_dataset(tmp_path / "ds", rows, truth)
    proc = layertap_cli("export", tmp_path / "ds", "--to", "specforge", tmp_path / "df", "--strategy", "dflash")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("OK: ") and "2 written" in proc.stdout and "1 skipped" in proc.stdout
    assert "skipped 1: " in proc.stdout
    # The same with --compress: data_{i}.ckpt.gz, SpecForge's default level (6), the same rows.
    from layertap.cli import main

    assert (
        main(
            [
                "export",
                str(tmp_path / "ds"),
                "--to",
                "specforge",
                str(tmp_path / "gz"),
                "--strategy",
                "dflash",
                "--compress",
            ]
        )
        == 0
    )
    manifest = json.loads((tmp_path / "gz" / "layertap-export.json").read_text())
    assert manifest["compress"] == "gzip" and manifest["compression_level"] == 6
    names = sorted(p.name for p in (tmp_path / "gz" / "rows_0-2000").iterdir())
    assert names == ["data_0.ckpt.gz", "data_2.ckpt.gz"]
    with gzip.open(tmp_path / "gz" / "rows_0-2000" / "data_2.ckpt.gz") as f:
        assert torch.equal(
            torch.load(f, weights_only=True)["hidden_states"], _ckpt(tmp_path / "df", 2)["hidden_states"]
        )


def test_records_of_capture_windows_are_reported(tmp_path):
    """A reduction (one vector) and a window that starts past the sequence's start are no
    training sequences: listed as problems, not written; a window from position 0 (a prefix) is."""
    g = torch.Generator().manual_seed(0)
    windows = {
        "0": {"window_start": "0", "window_end": "5"},
        "1": {"window_start": "3", "window_end": "8"},
        "2": {"window_start": "0", "window_end": "9", "reduction": "mean"},
    }
    with layertap.ShardWriter(str(tmp_path / "ds")) as w:
        for key, meta in windows.items():
            n = 1 if "reduction" in meta else 5
            tensors = {
                "hidden_states": torch.randn(n, 2, 8, generator=g),
                "token_ids": torch.arange(n, dtype=torch.int64),
            }
            w.submit(key, tensors, metadata={"layer_ids": "[1, 3]", **meta})
    s = export(str(tmp_path / "ds"), str(tmp_path / "df"), "specforge", strategy="dflash")
    assert (s.written, s.failed) == (1, 2), s.problems
    assert any(p.startswith("row 1:") and "positions [3, 8) of its sequence only" in p for p in s.problems)
    assert any(p.startswith("row 2:") and "a mean over positions [0, 9)" in p for p in s.problems)


def test_corrupt_and_missing_rows_are_reported(hs_dataset, tmp_path, rows):
    ds_copy = tmp_path / "ds"
    shutil.copytree(hs_dataset, ds_copy)
    with layertap.open(str(ds_copy)) as ds:
        entry = next(e for b in ds.backends for e in b.entries if e.key == "0")
        shard = ds.backends[0].path
    with open(shard, "r+b") as f:  # a byte in the middle of row 0's payload (the first selected)
        f.seek(entry.frame_offset + entry.stored_len // 2 + 64)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    proc = layertap_cli("export", ds_copy, "--to", "speculators", tmp_path / "o", "--keys", "0-5,40", "--json")
    assert proc.returncode == 1, proc.stderr
    s = json.loads(proc.stdout)
    assert (s["written"], s["failed"], s["missing"], s["ok"]) == (5, 1, 1, False)
    assert any(p.startswith("row 0:") for p in s["problems"]) and any("40" in p for p in s["problems"])
    assert not os.path.exists(tmp_path / "o" / "hidden_states" / "hs_0.safetensors")


def test_stale_temporaries_are_removed(hs_dataset, tmp_path):
    root = tmp_path / "o" / "hidden_states"
    root.mkdir(parents=True)
    (root / f"hs_0.safetensors.123-4{TMP_SUFFIX}").write_bytes(b"half a file")
    s = export(hs_dataset, str(tmp_path / "o"), "speculators", keys=[0])
    assert s.stale_temporaries == 1 and s.written == 1
    assert not [n for n in os.listdir(root) if n.endswith(TMP_SUFFIX)]


# -------------------------------------------------------------------------------------------
# an interrupted export continues


#: The export command, killed (SIGKILL, the whole process) by its own write of the KILL_AT-th
#: file: mid-export whatever the machine's speed (the test polled for the files and lost the race
#: when the export finished first), with the other worker thread maybe halfway through a file.
KILLED_EXPORT = """
import os, signal, sys, threading
from layertap.cli import main
from layertap.export import files

real, lock, written = files.write_file, threading.Lock(), []

def write_file(path, data, fsync):
    real(path, data, fsync)
    if path.endswith(".safetensors"):
        with lock:
            written.append(path)
            if len(written) == int(sys.argv[1]):
                os.kill(os.getpid(), signal.SIGKILL)

files.write_file = write_file
sys.exit(main(sys.argv[2:]))
"""


def test_sigkilled_export_continues(tmp_path):
    count, kill_at = 100, 30
    g = torch.Generator().manual_seed(1)
    with layertap.ShardWriter(str(tmp_path / "ds"), codec="zstd") as w:
        for i in range(count):
            w.submit(
                str(i),
                {
                    "hidden_states": torch.randn(64, 4, 128, generator=g).bfloat16(),
                    "token_ids": torch.arange(64, dtype=torch.int64) + i,
                },
                metadata={"layer_ids": "[1, 2, 3, 4]"},
            )
    out = tmp_path / "o"
    root = out / "hidden_states"
    argv = ["export", str(tmp_path / "ds"), "--to", "speculators", str(out), "--workers", "2"]
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_EXPORT, str(kill_at), *argv], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    done = len([n for n in os.listdir(root) if n.endswith(".safetensors")])
    assert kill_at <= done < count
    proc = layertap_cli("export", tmp_path / "ds", "--to", "speculators", out, "--json", check=True)
    s = json.loads(proc.stdout)
    assert s["ok"] and s["existing"] >= done and s["existing"] + s["written"] == count
    assert not [n for n in os.listdir(root) if n.endswith(TMP_SUFFIX)]
    with layertap.open(str(tmp_path / "ds")) as ds:
        for i in range(count):
            got = load_file(root / f"hs_{i}.safetensors")
            assert torch.equal(got["hidden_states"], ds[str(i)].hidden_states), i
