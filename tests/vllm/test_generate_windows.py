"""``layertap generate --window START:END --reduction last|mean`` (issue 25 item 1): every row's
request asks the connector for that window of its recorded tokens, or one vector over it; the
records equal transformers' rows or their mean, the summary says what was asked, bad options
stop the run before any engine with one line naming the fix (tests/test_generate_options.py)."""

from __future__ import annotations

import json

import pytest
import torch
from generate_support import TINY_ENGINE_ARGS, generate_cmd, id_rows, write_jsonl

import layertap
from layertap.cli import main as layertap_cli
from layertap.generate import GenerateError
from vllm_support import VLLM_WARNINGS, pytest_env

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

LAYERS = [0, 2, 4]


def test_a_reduction_with_a_loss_mask_is_refused_before_the_engine(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", id_rows(3, 5, 9, loss_mask=True))
    with pytest.raises(GenerateError, match="drop it or the reduction"):
        layertap.generate(tiny_model, data, tmp_path / "out", reduction="mean", progress="none")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").rglob("*.lts"))


def test_the_response_tokens_of_rollouts(tiny_model, reference, tmp_path):
    """RL: ``include_output_tokens`` with the window ``[-5, None)``: the last five recorded
    tokens of each row (its responses' but the last), with the loss mask cut to them."""
    rows = id_rows(6, 8, 40, seed=5, loss_mask=True)
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
        summary = layertap.generate(
            tiny_model,
            data,
            tmp_path / "out",
            layers="0,2,4",
            max_tokens=6,
            include_output_tokens=True,
            window=[-5, None],
            sampling_args={"temperature": 0.0, "ignore_eos": True},
            engine_args={**TINY_ENGINE_ARGS, "dtype": "float32"},
            progress="none",
        )
    assert summary["complete"] and summary["rows_written"] == 6
    assert summary["window"] == [-5, None] and summary["reduction"] is None
    assert summary["tokens"] == 6 * 5
    with layertap.open(tmp_path / "out") as ds:
        assert ds.verify().ok
        for i, row in enumerate(rows):
            record = ds[str(i)]
            n = len(row["input_ids"])
            assert record.num_tokens == 5
            assert (record.metadata["window_start"], record.metadata["window_end"]) == (str(n), str(n + 5))
            assert record.tensors["loss_mask"].tolist() == [1] * 5
            # The record's ids are the outputs; with the prompt, transformers' rows n.. n+5.
            ids = row["input_ids"] + record.token_ids.tolist()
            want = reference.hidden_states(ids, LAYERS)[n:]
            torch.testing.assert_close(record.hidden_states, want, rtol=1e-5, atol=1e-5)


def test_the_command_line_mean_over_a_window(tiny_model, reference, tmp_path, capsys, in_process_command):
    """The flags as the command line parses them (``--window 2:-3``), run in this process: the
    options' values are tests/test_generate_options.py's."""
    rows = id_rows(5, 20, 70, seed=9)
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out"
    cmd = generate_cmd(
        tiny_model,
        data,
        str(out),
        "--layers",
        "0,2,4",
        "--window",
        "2:-3",
        "--reduction",
        "mean",
        "--json",
        "--progress",
        "none",
        engine_args={"dtype": "float32"},
    )
    status = layertap_cli(cmd[3:])  # the arguments after `python -m layertap`
    captured = capsys.readouterr()
    assert status == 0, captured.err[-4000:]
    summary = json.loads(captured.out)
    assert summary["complete"] and summary["window"] == [2, -3] and summary["reduction"] == "mean"
    assert summary["tokens"] == 5  # one row per record
    with layertap.open(out) as ds:
        assert ds.verify().ok
        for i, row in enumerate(rows):
            record = ds[str(i)]
            ids, n = row["input_ids"], len(row["input_ids"])
            assert record.hidden_states.shape == (1, 3, 128)
            assert record.token_ids.tolist() == [ids[n - 4]]
            assert record.metadata["reduction"] == "mean"
            assert (record.metadata["window_start"], record.metadata["window_end"]) == ("2", str(n - 3))
            want = reference.hidden_states(ids, LAYERS)[2 : n - 3].mean(0, keepdim=True)
            torch.testing.assert_close(record.hidden_states, want, rtol=1e-5, atol=1e-5)
