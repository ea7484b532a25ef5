"""fp8 datasets and speculators' fp8 hidden-states backend (hs-connectors 0.9.0): both ways.

- ``layertap export --to speculators`` of a dataset stored as fp8 writes the fp8 backend's files
  (``hidden_states`` float8_e4m3fn, ``hidden_states_scales`` float32 ``[T, 1, 1]``), which its
  ``FP8Transfer`` reads; ``--dtype float8_e4m3fn`` writes them from a lossless dataset.
- layertap's quantizer gives the e4m3 bytes and scales of hs-connectors' ``quantize_tensor_to_fp8``,
  so those files are the ones speculators' own fp8 connector would have written.
- the ``layertap`` backend hands speculators an fp8 dataset's samples as the fp8 backend hands
  its own: dequantized to bfloat16, equal bitwise.
- the layouts that cannot hold fp8 (SpecForge, Model-Optimizer) get the values dequantized, not
  the e4m3 codes cast without their scales.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from trainers_support import layertap_cli, write_dataset

import layertap
from layertap.export import export
from layertap.fp8 import dequantize

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from hs_connectors import FP8Transfer
    from hs_connectors.fp8_utils import SCALES_KEY, dequantize_fp8_tensor, quantize_tensor_to_fp8

from layertap.speculators.backend import LayertapTransfer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def fp8_dataset(tmp_path_factory, rows, truth) -> str:
    path = tmp_path_factory.mktemp("fp8") / "ds"
    write_dataset(path, rows, truth, lossy="fp8-e4m3")
    return str(path)


def _bf16_states(hs_dataset: str, i: int) -> torch.Tensor:
    with layertap.open(hs_dataset) as ds:
        return ds[str(i)].hidden_states


def test_export_of_an_fp8_dataset_is_the_fp8_backends_layout(tmp_path, fp8_dataset, hs_dataset, rows):
    report = export(fp8_dataset, str(tmp_path / "out"), "speculators")
    assert report.ok and report.written == len(rows)
    theirs = FP8Transfer(Path(tmp_path / "out" / "hidden_states"))
    ours = LayertapTransfer(fp8_dataset)
    for i in range(len(rows)):
        # What speculators' own fp8 connector would have saved from the same bf16 states.
        q, scales = quantize_tensor_to_fp8(_bf16_states(hs_dataset, i))
        from safetensors.torch import load_file

        saved = load_file(str(tmp_path / "out" / "hidden_states" / f"hs_{i}.safetensors"))
        assert set(saved) == {"hidden_states", SCALES_KEY, "token_ids"}
        assert saved["hidden_states"].dtype == torch.float8_e4m3fn
        assert torch.equal(saved["hidden_states"].view(torch.uint8), q.view(torch.uint8)), i
        assert saved[SCALES_KEY].shape == scales.shape and torch.equal(saved[SCALES_KEY], scales), i
        # Both backends hand the trainer the same bf16 values.
        got, want = ours.get_cached(i), theirs.get_cached(i)
        assert got.keys() == want.keys() == {"hidden_states", "token_ids"}
        assert got["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(got["hidden_states"], want["hidden_states"]), i
        assert torch.equal(got["hidden_states"], dequantize_fp8_tensor(q, scales)), i
        assert torch.equal(got["token_ids"], want["token_ids"])
    ours.close()


def test_export_quantizes_a_lossless_dataset_with_dtype_fp8(tmp_path, hs_dataset, rows):
    proc = layertap_cli("export", hs_dataset, tmp_path / "out", "--to", "speculators", "--dtype", "float8_e4m3fn")
    assert proc.returncode == 0, proc.stderr
    assert "hidden_states_scales [T, 1, 1]" in proc.stdout
    theirs = FP8Transfer(Path(tmp_path / "out" / "hidden_states"))
    for i in range(len(rows)):
        q, scales = quantize_tensor_to_fp8(_bf16_states(hs_dataset, i))
        assert torch.equal(theirs.get_cached(i)["hidden_states"], dequantize_fp8_tensor(q, scales)), i


def test_export_of_an_fp8_dataset_to_bf16_and_other_layouts_dequantizes(tmp_path, fp8_dataset, verifier, rows):
    assert export(fp8_dataset, str(tmp_path / "spec"), "speculators", dtype="bfloat16").ok
    assert export(fp8_dataset, str(tmp_path / "mo"), "modelopt", model=verifier, prenorm=True).ok
    from safetensors.torch import load_file

    with layertap.open(fp8_dataset) as ds:
        for i in range(len(rows)):
            want = dequantize(ds[str(i)])  # bfloat16, the writer's source dtype
            got = load_file(str(tmp_path / "spec" / "hidden_states" / f"hs_{i}.safetensors"))["hidden_states"]
            assert got.dtype == torch.bfloat16 and torch.equal(got, want), i
            mo = torch.load(tmp_path / "mo" / f"{i}.pt")
            assert mo["hidden_states"].dtype == torch.bfloat16 and torch.equal(mo["hidden_states"], want[:, -1]), i
            assert torch.equal(mo["aux_hidden_states"], want[:, :-1].reshape(want.shape[0], -1)), i


def test_fp8_dtype_is_refused_where_the_trainer_cannot_read_it(tmp_path, hs_dataset, verifier):
    proc = layertap_cli(
        "export", hs_dataset, tmp_path / "out", "--to", "modelopt", "--model", verifier, "--dtype", "float8_e4m3fn"
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "only --to speculators stores fp8" in proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
