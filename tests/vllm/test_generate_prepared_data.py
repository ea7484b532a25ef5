"""docs/TRAINING.md's speculators path, step by step with the real tools: speculators' own
``prepare-data`` writes the prepared rows (a ``datasets`` directory saved in torch format),
``layertap generate --data ./output --out ./output/hidden_states`` writes one record per row with
real vLLM, and speculators' training dataset reads every row back through the layertap backend."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings

import pytest
from generate_support import TINY_ENGINE_ARGS, id_rows, write_jsonl

import layertap
from layertap.cli import main as layertap_cli
from vllm_support import VLLM_WARNINGS

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

#: The tiny model has 4 layers; speculators' default [2, N//2, N-3] + N would repeat layer 2.
LAYERS = "1,2,3,4"


@pytest.fixture(autouse=True)
def in_process_engine(monkeypatch):
    """The engine in this process (3 s of start-up instead of 12); the variables the command sets
    for vLLM's logging stay out of other tests."""
    saved = dict(os.environ)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for var in ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM"):
        monkeypatch.delenv(var, raising=False)
    yield
    os.environ.clear()
    os.environ.update(saved)


def prepare_data(model: str, rows_file: str, output) -> str:
    """speculators' ``prepare-data`` over rows that hold ``input_ids`` and ``loss_mask`` (they pass
    through without a render endpoint), as docs/TRAINING.md step 1 runs it."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "speculators",
            "prepare-data",
            "--model",
            model,
            "--data",
            rows_file,
            "--output",
            str(output),
            "--num-preprocessing-workers",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(output)


@pytest.mark.timeout(600)  # speculators' prepare-data, then two runs of generate, each importing vLLM
def test_generate_on_speculators_prepared_data(tiny_model, tmp_path, capsys):
    rows = id_rows(7, 3, 24, seed=5, loss_mask=True)
    output = prepare_data(tiny_model, write_jsonl(tmp_path / "rows.jsonl", rows), tmp_path / "output")
    state = json.loads((tmp_path / "output" / "state.json").read_text())
    assert state["_format_type"] == "torch"  # what made every row bad before (issue 24)
    hs = tmp_path / "output" / "hidden_states"

    args = ["generate", tiny_model, "--data", output, "--out", str(hs), "--layers", LAYERS]
    status = layertap_cli([*args, "--engine-args", json.dumps(TINY_ENGINE_ARGS), "--json", "--progress", "none"])
    summary = json.loads(capsys.readouterr().out)
    assert status == 0, summary["bad_rows"][:3]
    assert summary["data_format"] == "datasets" and summary["loss_mask"] is True
    assert (summary["rows"], summary["rows_written"], summary["rows_bad"]) == (7, 7, 0)
    assert summary["complete"] is True

    # The same command again: nothing left to do, so no engine and no writer of its own; the
    # summary still says the dataset's dtype, and its time counts the checks (they import vLLM).
    # In a child, as a user runs it: this process has imported vLLM already.
    rerun = [sys.executable, "-m", "layertap", *args, "--engine-args", json.dumps(TINY_ENGINE_ARGS), "--json"]
    proc = subprocess.run(rerun, capture_output=True, text=True, timeout=300)
    again = json.loads(proc.stdout)
    assert proc.returncode == 0 and again["complete"] and again["rows_done_before"] == 7 and again["rows_written"] == 0
    assert again["run"] is None and again["writer_id"] is None and again["dtype"] == summary["dtype"] is not None
    assert again["seconds"]["total"] >= again["seconds"]["load"] > 1.0  # vLLM's import alone takes more
    from layertap.generate.summary import summary_text

    assert "no engine started (nothing to write)" in summary_text(again)

    # speculators shuffles in prepare-data: row i of its output is what the record of "i" holds.
    import datasets

    prepared = datasets.load_from_disk(output).with_format(None)
    with layertap.open(str(hs)) as ds:
        for i, row in enumerate(prepared):
            rec = ds[str(i)]
            assert rec["token_ids"].tolist() == row["input_ids"]
            assert rec["loss_mask"].tolist() == row["loss_mask"]

    # Step 3's reader: speculators' own training dataset, through the layertap backend.
    from layertap.speculators import register

    register()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from speculators.train.data import ArrowDataset

    from layertap.speculators.backend import LayertapBackend

    ns = argparse.Namespace(hidden_states_path=None, layertap_fetch_timeout=5.0)
    transfer = LayertapBackend.from_train_args(ns, output)  # the default path, DATA/hidden_states
    try:
        train = ArrowDataset(64, output, transfer=transfer, on_missing="raise")
        for i, row in enumerate(prepared):
            sample = train[i]
            assert sample["loss_mask"].tolist() == row["loss_mask"]
            assert sample["verifier_last_hidden_states"].shape == (len(row["input_ids"]), 128)
    finally:
        transfer.close()
