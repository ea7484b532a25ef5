"""The ``layertap`` hidden-states backend, read by speculators' own code (speculators 0.9.0,
hs-connectors 0.9.0, pinned in requirements-dev.txt): its command line takes the backend's
flags, its training dataset gets from the backend exactly what its file backend reads from
``layertap export --to speculators``, and its EAGLE-3 model trains a few steps from a layertap
dataset on the CPU.

speculators' Trainer moves the model to accelerator 0 and so cannot run on a machine without
one; the training test runs speculators' ``train`` entry point (config resolution, backend,
draft model, DataLoader; loading in-process, where speculators' spawned workers would get the
pickled transfer of test_transfer_pickles_without_its_open_dataset) and replaces only the
Trainer by a loop of the same steps on the CPU (forward, backward, its optimizers). The real
``speculators train`` ran on the GPU machine (docs/TRAINING.md).
"""

from __future__ import annotations

import argparse
import logging
import math
import pickle
import subprocess
import sys
import warnings

import pytest
import torch

from layertap.speculators import BACKEND_NAME, register

register()  # before speculators' config module is imported: it reads the registry once

with warnings.catch_warnings():  # speculators' imports compile things torch deprecates
    warnings.simplefilter("ignore", DeprecationWarning)
    from hs_connectors import FileTransfer, HiddenStatesBackend
    from speculators.train.data import ArrowDataset
    from speculators.train.recovery import SampleUnavailable

from trainers_support import save_prepared, write_dataset  # noqa: E402

from layertap.export import export  # noqa: E402
from layertap.speculators.backend import LayertapBackend, LayertapTransfer, check_dataset  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, rows, hs_dataset):
    """speculators' prepared data of ``rows``, with the layertap dataset as its hidden_states
    (the default --hidden-states-path) and the speculators export beside it."""
    root = tmp_path_factory.mktemp("prepared")
    data = save_prepared(root / "data", rows)
    export(hs_dataset, str(root / "exported"), "speculators")
    return {"data": data, "exported": str(root / "exported" / "hidden_states")}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_registered_once():
    assert HiddenStatesBackend.registry[BACKEND_NAME] is LayertapBackend
    assert register() is LayertapBackend


def test_train_command_line_takes_the_backend(tmp_path):
    from speculators.train.config import TrainConfig

    cfg = TrainConfig.resolve(
        [
            "--verifier-name-or-path",
            "m",
            "--data-path",
            str(tmp_path),
            "--hidden-states-backend",
            "layertap",
            "--hidden-states-path",
            "/x/hs",
            "--layertap-fetch-timeout",
            "7",
        ]
    )
    flat = cfg.flatten()
    assert (flat["hidden_states_backend"], flat["hidden_states_path"], flat["layertap_fetch_timeout"]) == (
        "layertap",
        "/x/hs",
        7.0,
    )
    flat = TrainConfig.resolve(["--verifier-name-or-path", "m", "--hidden-states-backend", "layertap"]).flatten()
    assert flat["hidden_states_path"] is None and flat["layertap_fetch_timeout"] == 300.0


def test_dataset_reads_what_the_file_backend_reads(prepared, hs_dataset, rows):
    ns = argparse.Namespace(hidden_states_path=None, layertap_fetch_timeout=5.0)
    # --data-path's hidden_states is the default; here the dataset lives elsewhere.
    ns.hidden_states_path = hs_dataset
    ours = LayertapBackend.from_train_args(ns, prepared["data"])
    files = FileTransfer(__import__("pathlib").Path(prepared["exported"]))
    for i in range(len(rows)):
        got = ours.get_cached(i)
        _same(got, files.get_cached(i))
        assert got["token_ids"].tolist() == rows[i]["input_ids"]
    assert ours.get_cached(len(rows)) is None and files.get_cached(len(rows)) is None
    # speculators' training dataset, through each transfer: the same training tensors.
    a = ArrowDataset(64, prepared["data"], transfer=ours, on_missing="raise")
    b = ArrowDataset(64, prepared["data"], transfer=files, on_missing="raise")
    for i in range(len(rows)):
        x, y = a[i], b[i]
        _same(x, y)
        assert x["hidden_states"].shape == (len(rows[i]["input_ids"]), 3 * 128)
        assert x["verifier_last_hidden_states"].shape == (len(rows[i]["input_ids"]), 128)


def test_rows_whose_tokens_differ_are_dropped(tmp_path, rows, truth):
    # A dataset made from other data: speculators drops the sample (its own check).
    shifted = [dict(r, input_ids=[t + 1 for t in r["input_ids"]]) for r in rows[:2]]
    write_dataset(tmp_path / "hs", shifted, truth)
    data = save_prepared(tmp_path / "data", rows[:2])
    ds = ArrowDataset(64, data, transfer=LayertapTransfer(str(tmp_path / "hs")), on_missing="raise")
    with pytest.warns(UserWarning, match="don't"):
        assert isinstance(ds[0], SampleUnavailable)


def test_transfer_pickles_without_its_open_dataset(hs_dataset):
    t = LayertapTransfer(hs_dataset)
    first = t.get_cached(0)
    assert t._dataset is not None
    blob = pickle.dumps(t)
    assert len(blob) < 1000
    u = pickle.loads(blob)
    assert u._dataset is None
    _same(u.get_cached(0), first)
    t.close()
    u.close()


def test_dataset_path_checks(tmp_path, prepared, caplog):
    with pytest.raises(FileNotFoundError, match="--hidden-states-path"):
        check_dataset(str(tmp_path / "absent"), explicit=True)
    with caplog.at_level(logging.WARNING, logger="layertap.speculators"):
        assert check_dataset(str(tmp_path / "absent"), explicit=False) is None
    assert "--on-missing" in caplog.text
    with pytest.raises(ValueError, match="'file' backend"):
        check_dataset(prepared["exported"], explicit=True)
    ns = argparse.Namespace(hidden_states_path=None, layertap_fetch_timeout=1.0)
    assert LayertapBackend.from_train_args(ns, str(tmp_path)).get_cached(0) is None


def test_launch_config():
    # As speculators' scripts/launch_vllm.py builds its parser: every backend's launch args.
    parser = argparse.ArgumentParser()
    for cls in HiddenStatesBackend.registry.values():
        cls.add_launch_args(parser)
    args = parser.parse_args(
        ["--hidden-states-path", "hs", "--layertap-codec", "zstd", "--layertap-options", '{"writer_threads": 2}']
    )
    cfg = LayertapBackend.build_kv_transfer_config(args)
    assert cfg["kv_connector"] == "LayertapSpeculatorsConnector"
    assert cfg["kv_connector_module_path"] == "layertap.speculators.connector"
    assert cfg["kv_role"] == "kv_producer"
    extra = cfg["kv_connector_extra_config"]
    assert extra["codec"] == "zstd" and extra["writer_threads"] == 2 and extra["output_dir"].endswith("/hs")
    args.layertap_options = "[1]"
    with pytest.raises(ValueError, match="JSON object"):
        LayertapBackend.build_kv_transfer_config(args)


def test_launcher(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(
        "import sys\nfrom hs_connectors import HiddenStatesBackend\n"
        "print(sorted(HiddenStatesBackend.registry), sys.argv[1:])\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "layertap.speculators", str(script), "a"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "'layertap'" in out.stdout and "['a']" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "layertap.speculators", "train", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "--layertap-fetch-timeout" in out.stdout and "layertap" in out.stdout.split("--hidden-states-backend")[1]


@pytest.mark.parametrize("case", ["absent", "file-backend layout"])
def test_train_refuses_a_bad_hidden_states_path_at_start_up(case, tmp_path, verifier, prepared):
    """speculators' train through the launcher, with a --hidden-states-path that cannot serve:
    one line and exit status 2 before speculators' train does anything (no config dump, no
    save directory, no draft model), not a traceback after the draft model is built."""
    path = str(tmp_path / "absent") if case == "absent" else prepared["exported"]
    save = tmp_path / "ckpt"
    argv = ["train", "--verifier-name-or-path", verifier, "--data-path", prepared["data"]]
    argv += ["--hidden-states-backend", "layertap", "--hidden-states-path", path, "--speculator-type", "eagle3"]
    argv += ["--target-layer-ids", "1", "2", "3", "--save-path", str(save)]
    out = subprocess.run(
        [sys.executable, "-m", "layertap.speculators", *argv], capture_output=True, text=True, timeout=300
    )
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "speculator_type=" not in out.stderr + out.stdout
    assert not save.exists()
    if case == "absent":
        want = (
            f"layertap backend: --hidden-states-path {path}: no such layertap dataset; write it with layertap generate"
        )
    else:
        want = f"layertap backend: --hidden-states-path {path} is not a layertap dataset"
    assert lines[-1].startswith(want), lines[-5:]
    if case != "absent":
        assert "hs_*.safetensors files, the 'file' backend's layout: pass --hidden-states-backend file" in lines[-1]


def test_launcher_refusals(tmp_path, capsys):
    from layertap.speculators.__main__ import main

    assert main([str(tmp_path / "none.py")]) == 2
    assert "no such script" in capsys.readouterr().err
    assert main([]) == 2 and "usage" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")
def test_eagle3_trains_from_a_layertap_dataset_on_cpu(tmp_path, verifier, rows, hs_dataset, monkeypatch):
    import shutil

    import speculators.train.cli as train_cli
    from speculators.train.config import TrainConfig
    from speculators.train.optimizers import build_optimizers

    data = save_prepared(tmp_path / "data", rows)
    shutil.copytree(hs_dataset, tmp_path / "data" / "hidden_states")  # the default --hidden-states-path
    steps: list[dict] = []

    class CpuTrainer:
        """speculators' Trainer step (forward under autocast, backward, clip, its optimizers)
        on the CPU, a few times over the first batch."""

        def __init__(self, model, config, train_loader, val_loader):
            self.model, self.config, self.loader = model, config, train_loader

        def run_training(self):
            optimizers = build_optimizers(self.model, self.config)
            self.model.train()
            batch = next(iter(self.loader))
            for _ in range(4):
                with torch.autocast("cpu", dtype=self.config.hidden_states_dtype):
                    _, loss, _ = self.model(**batch, **(self.config.train_call_kwargs or {}))
                for o in optimizers:
                    o.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                for o in optimizers:
                    o.step()
                steps.append(
                    {
                        "loss": loss.item(),
                        "dropped": batch["error_records"],
                        "tokens": int((batch["document_ids"] >= 0).sum()),
                    }
                )

    monkeypatch.setattr(train_cli, "Trainer", CpuTrainer)
    argv = [
        "--verifier-name-or-path",
        verifier,
        "--data-path",
        data,
        "--hidden-states-backend",
        "layertap",
        "--speculator-type",
        "eagle3",
        "--target-layer-ids",
        "1",
        "2",
        "3",
        "--total-seq-len",
        "128",
        "--num-workers",
        "0",
        "--save-path",
        str(tmp_path / "ckpt"),
        "--draft-attn-impl",
        "sdpa",
        "--loss-implementation",
        "eager",
        "--on-missing",
        "raise",
        "--train-data-ratio",
        "0.75",
        "--lr",
        "1e-3",
        "--mask-token-id",
        "2",
    ]
    train_cli.main(TrainConfig.resolve(argv))
    assert len(steps) == 4, steps
    losses = [s["loss"] for s in steps]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    assert steps[0]["dropped"] == 0 and steps[0]["tokens"] > 0, steps[0]
    assert (tmp_path / "ckpt" / "run.yaml").exists()  # speculators' own record of the run
