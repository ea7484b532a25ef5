"""``layertap export --to modelopt``: NVIDIA Model-Optimizer's EAGLE-3 offline dumps.

The files hold exactly the records' tensors (the last layer after the verifier's final norm as
transformers computes it, or before it with ``--prenorm``), and Model-Optimizer 0.47.0's own
code trains on them: ``OfflineSupervisedDataset`` and ``EagleOfflineDataCollator`` read them,
``FakeBaseModel`` turns ``hidden_states`` into the verifier's logits (re-applying its norm for a
``--prenorm`` export), and an EAGLE-3 draft converted with ``mtsp.convert`` runs its offline
training forward and loss on the batch. Model-Optimizer cannot share this virtualenv (see
requirements-modelopt.txt): ``make venv`` installs it into a folder of its own, which only the
child process of ``test_modelopt_trains_on_the_export`` puts on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from trainers_support import MODELOPT_TARGET, layertap_cli, prepared_rows, write_dataset

import layertap
from layertap.export import export

KEYS = {"input_ids", "hidden_states", "aux_hidden_states", "loss_mask", "conversation_id"}


def _norm_by_hand(verifier, x):
    """LlamaRMSNorm written out, with the checkpoint's weight, in float32."""
    w = load_file(os.path.join(verifier, "model.safetensors"))["model.norm.weight"].float()
    with open(os.path.join(verifier, "config.json")) as f:
        eps = json.load(f)["rms_norm_eps"]
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _load(root, row):
    return torch.load(os.path.join(root, f"{row}.pt"), weights_only=True)


def test_modelopt_layout_holds_the_records(hs_dataset, tmp_path, rows, truth, verifier):
    out = tmp_path / "mo"
    s = export(hs_dataset, str(out), "modelopt", model=verifier, workers=2)
    assert s.ok and (s.selected, s.written, s.no_loss_mask) == (len(rows), len(rows), 0)
    assert s.settings == {
        "format": "modelopt",
        "layer_ids": [1, 2, 3],
        "modelopt_layer_ids": [0, 1, 2],
        "last_layer": 4,
        "dtype": "bfloat16",
        "final_norm": "LlamaRMSNorm",
    }
    # Model-Optimizer's default for N = 4 is [0, 1] ({1, N//2-1, N-4}): the config must name these.
    assert "not its default [0, 1]: set eagle_architecture_config.eagle_aux_hidden_state_layer_ids" in s.describe
    # One {row}.pt per row, flat (Model-Optimizer takes every *.pt under offline_data_path).
    assert sorted(os.listdir(out)) == sorted(
        [f"{i}.pt" for i in range(len(rows))] + ["layertap-export.json", ".layertap-export.lock"]
    )
    with layertap.open(hs_dataset) as ds:
        for i, row in enumerate(rows):
            got = _load(out, i)
            T = len(row["input_ids"])
            assert set(got) == KEYS
            assert got["conversation_id"] == str(i)
            assert got["input_ids"].dtype == torch.int64 and got["input_ids"].tolist() == row["input_ids"]
            assert got["loss_mask"].dtype == torch.int64 and got["loss_mask"].tolist() == row["loss_mask"]
            assert got["aux_hidden_states"].dtype == torch.bfloat16 and got["aux_hidden_states"].shape == (T, 384)
            assert got["hidden_states"].dtype == torch.bfloat16 and got["hidden_states"].shape == (T, 128)
            for t in (got["input_ids"], got["loss_mask"], got["aux_hidden_states"], got["hidden_states"]):
                assert t.untyped_storage().nbytes() == t.nbytes  # no view of a larger tensor saved
            stored = ds[str(i)].hidden_states  # bf16 [T, 4, 128], layers 1..4
            assert torch.equal(got["aux_hidden_states"], stored[:, :3].reshape(T, -1))
            # Layer N after the final norm, rounded once: the norm written out, and transformers'
            # own last hidden state (what Model-Optimizer's HF dump holds) to bf16 precision.
            assert torch.equal(got["hidden_states"], _norm_by_hand(verifier, stored[:, 3]).bfloat16())
            states, after_norm = truth.states(row["input_ids"])
            torch.testing.assert_close(got["hidden_states"].float(), after_norm, rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(
                got["aux_hidden_states"].float(), states[:, 1:4].reshape(T, -1), rtol=1e-2, atol=1e-2
            )


def test_modelopt_prenorm_layers_and_dtype(hs_dataset, tmp_path, verifier):
    out = tmp_path / "mo"
    s = export(hs_dataset, str(out), "modelopt", model=verifier, prenorm=True, layers=[3, 2], dtype="float32")
    # The aux layers ascending, as Model-Optimizer's draft and the serving engines collect them.
    assert s.ok and s.settings["layer_ids"] == [2, 3] and s.settings["modelopt_layer_ids"] == [1, 2]
    assert s.settings["final_norm"] == "left to Model-Optimizer (hidden_states_prenorm)"
    with layertap.open(hs_dataset) as ds:
        got, stored = _load(out, 5), ds["5"].hidden_states
    T = stored.shape[0]
    assert set(got) == KEYS | {"hidden_states_prenorm"} and got["hidden_states_prenorm"] is True
    assert got["hidden_states"].dtype == torch.float32
    assert torch.equal(got["hidden_states"], stored[:, 3].float())  # as stored, before the norm
    assert torch.equal(got["aux_hidden_states"], stored[:, [1, 2]].reshape(T, -1).float())


def test_modelopt_default_layers_and_a_missing_loss_mask(tmp_path, truth, verifier):
    rows = prepared_rows(2, seed=5)
    write_dataset(tmp_path / "ds", rows, truth, layers=[1, 2, 4], loss_mask=False)
    s = export(str(tmp_path / "ds"), str(tmp_path / "mo"), "modelopt", model=verifier)
    assert s.ok and s.no_loss_mask == 2
    assert s.settings["modelopt_layer_ids"] == [0, 1] and "= Model-Optimizer [0, 1], its default)" in s.describe
    got = _load(tmp_path / "mo", 1)
    assert got["loss_mask"].dtype == torch.int64 and got["loss_mask"].tolist() == [1] * len(rows[1]["input_ids"])
    assert got["aux_hidden_states"].shape == (len(rows[1]["input_ids"]), 256)


def test_modelopt_refusals(hs_dataset, tmp_path, verifier, truth, rows, capsys):
    from layertap.cli import main

    def refused(*args):
        capsys.readouterr()
        assert main(["export", *map(str, args)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith("layertap export: "), err
        return err

    out = tmp_path / "o"
    assert "--to modelopt needs --model" in refused(hs_dataset, "--to", "modelopt", out)
    assert "--prenorm is for --to modelopt" in refused(hs_dataset, "--to", "speculators", out, "--prenorm")
    write_dataset(tmp_path / "noN", rows[:1], truth, layers=[1, 2, 3])
    assert "needs layer 4" in refused(tmp_path / "noN", "--to", "modelopt", out, "--model", verifier)
    write_dataset(tmp_path / "onlyN", rows[:1], truth, layers=[4])
    assert "auxiliary layers" in refused(tmp_path / "onlyN", "--to", "modelopt", out, "--model", verifier)
    write_dataset(tmp_path / "with0", rows[:1], truth, layers=[0, 2, 4])
    err = refused(tmp_path / "with0", "--to", "modelopt", out, "--model", verifier, "--prenorm")
    assert "embeddings" in err
    assert "no layer [7]" in refused(hs_dataset, "--to", "modelopt", out, "--model", verifier, "--layers", "1,7")
    # An export continues only with its settings: a pre-norm export is not finished post-norm.
    first = ["export", hs_dataset, "--to", "modelopt", str(out), "--model", verifier, "--prenorm", "--limit", "2"]
    assert main(first) == 0
    assert "other settings: final_norm" in refused(hs_dataset, "--to", "modelopt", out, "--model", verifier)
    proc = layertap_cli("export", hs_dataset, "--to", "modelopt", out, "--model", verifier, "--prenorm", "--json")
    s = json.loads(proc.stdout)
    assert proc.returncode == 0 and (s["existing"], s["written"]) == (2, len(rows) - 2)


# Model-Optimizer's offline training reads the files the way examples/speculative_decoding/
# eagle_utils.py does (every *.pt under offline_data_path), its FakeBaseModel reconstructs the
# verifier's logits, and an EAGLE-3 draft runs its training forward on a collated batch.
TRAIN = r"""
import sys, copy, pathlib, torch
import modelopt.torch.speculative as mtsp
from modelopt.torch.speculative.config import eagle3_default_config
from modelopt.torch.speculative.eagle.utils import OfflineSupervisedDataset, EagleOfflineDataCollator
from modelopt.torch.speculative.plugins.modeling_final_norm import _maybe_apply_base_final_norm
from modelopt.torch.speculative.utils import load_vlm_or_llm

verifier, result = sys.argv[1], sys.argv[2]
out = {}
for data in sys.argv[3:]:
    files = sorted(str(p) for p in pathlib.Path(data).rglob("*.pt"))
    dataset = OfflineSupervisedDataset(files, answer_only_loss=True)
    items = {int(pathlib.Path(f).stem): dataset[i] for i, f in enumerate(files)}
    base = load_vlm_or_llm(verifier, use_fake_base=True, use_offline_training=True, dtype="auto", device_map="cpu")
    with torch.no_grad():
        logits = {
            row: base.lm_head(_maybe_apply_base_final_norm(
                item["base_model_hidden_states"], {"base_hidden_prenorm": item["base_hidden_prenorm"]}, base.norm))
            for row, item in items.items()
        }
    arch = copy.deepcopy(eagle3_default_config)
    arch.update({"intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
                 "torch_dtype": "float32", "eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    torch.manual_seed(0)
    mtsp.convert(base, [("eagle", {"eagle_offline": True, "eagle_use_torch_compile": False,
                                   "eagle_architecture_config": arch})])
    base.train()
    batch = EagleOfflineDataCollator(train_len=48)([items[r] for r in sorted(items)])
    loss = base(**batch).loss
    loss.backward()
    out[data] = {"items": items, "logits": logits, "loss": loss.detach(),
                 "fc_grad": base.eagle_module.fc.weight.grad.abs().sum()}
torch.save(out, result)
"""


def test_modelopt_trains_on_the_export(tmp_path, hs_dataset, verifier, truth, rows):
    if not (MODELOPT_TARGET / "modelopt").is_dir():
        pytest.fail(
            f"Model-Optimizer is not in {MODELOPT_TARGET}: run `make venv` (requirements-modelopt.txt)",
            pytrace=False,
        )
    # The verifier is float32 (FakeBaseModel takes its dtype): the exports too.
    post, pre = str(tmp_path / "post"), str(tmp_path / "pre")
    export(hs_dataset, post, "modelopt", model=verifier, dtype="float32")
    export(hs_dataset, pre, "modelopt", model=verifier, dtype="float32", prenorm=True)
    proc = subprocess.run(
        [sys.executable, "-c", TRAIN, verifier, str(tmp_path / "result.pt"), post, pre],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(MODELOPT_TARGET)},
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    for data, prenorm in ((post, False), (pre, True)):
        got = result[data]
        assert sorted(got["items"]) == list(range(len(rows)))
        for i, row in enumerate(rows):
            item, T = got["items"][i], len(row["input_ids"])
            assert set(item) == {
                "input_ids",
                "base_model_hidden_states",
                "aux_hidden_states",
                "attention_mask",
                "loss_mask",
                "labels",
                "base_hidden_prenorm",
            }
            assert item["input_ids"].tolist() == row["input_ids"]
            assert item["labels"].tolist() == [*row["input_ids"][1:], -100]
            assert item["loss_mask"].tolist() == row["loss_mask"]  # answer_only_loss: the file's
            assert item["attention_mask"].tolist() == [1] * T
            assert item["base_hidden_prenorm"] is prenorm
            assert item["base_model_hidden_states"].shape == (T, 128)
            assert item["aux_hidden_states"].shape == (T, 384)
            states, after_norm = truth.states(row["input_ids"])
            torch.testing.assert_close(item["aux_hidden_states"], states[:, 1:4].reshape(T, -1), rtol=1e-2, atol=1e-2)
            # The logits Model-Optimizer distils from are the verifier's own, either way.
            with torch.no_grad():
                want = truth.model.lm_head(after_norm)
            torch.testing.assert_close(got["logits"][i], want, rtol=5e-2, atol=5e-2)
            torch.testing.assert_close(got["logits"][i], result[post]["logits"][i], rtol=1e-5, atol=1e-5)
        assert torch.isfinite(got["loss"]) and got["loss"] > 0 and got["fc_grad"] > 0
    # Same draft (seeded), same targets: the same loss from a post-norm and a pre-norm export.
    torch.testing.assert_close(result[pre]["loss"], result[post]["loss"], rtol=1e-5, atol=1e-5)
