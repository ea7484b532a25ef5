"""Bad input to ``layertap generate`` gets a one-line error (exit status 2) before any engine
starts, and nothing is written."""

from __future__ import annotations

import fcntl
import json
import os
import shutil

import pytest
from generate_support import TINY_ENGINE_ARGS, chat_rows, id_rows, write_jsonl

import layertap
from layertap.cli import main as layertap_cli
from layertap.generate.resume import LOCK_NAME
from vllm_support import VLLM_WARNINGS

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]


@pytest.fixture(autouse=True)
def keep_environment():
    """The command sets vLLM's logging variables when they are unset; keep them out of other tests."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gen-inputs")
    return {
        "chat": write_jsonl(tmp / "chat.jsonl", chat_rows(3)),
        "ids": write_jsonl(tmp / "ids.jsonl", id_rows(3, 2, 5)),
        "nocol": write_jsonl(tmp / "nocol.jsonl", [{"text": "the water"}]),
    }


def run(capsys, model: str, data: str, out, *extra: str, engine_args: dict | None = None) -> tuple[int, str]:
    args = [
        "generate",
        model,
        "--data",
        data,
        "--out",
        str(out),
        "--engine-args",
        json.dumps(engine_args if engine_args is not None else TINY_ENGINE_ARGS),
        *extra,
    ]
    status = layertap_cli(args)
    captured = capsys.readouterr()
    assert captured.out == ""
    return status, captured.err


def assert_refused(capsys, message: str, model: str, data: str, out, *extra: str, **kw) -> None:
    status, err = run(capsys, model, data, out, *extra, **kw)
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("layertap generate: "), err
    assert message in lines[0], err
    assert not list(out.glob("*.lts")) if out.exists() else True  # nothing written


def test_bad_data(capsys, tiny_model, data, tmp_path):
    out = tmp_path / "out"
    assert_refused(capsys, "missing.jsonl: no such file or directory", tiny_model, str(tmp_path / "missing.jsonl"), out)
    assert_refused(
        capsys,
        "no prompt column: expected one of input_ids, messages, prompt; the data has 'text'",
        tiny_model,
        data["nocol"],
        out,
    )
    assert not out.exists()


def test_bad_model_and_layers(capsys, tiny_model, data, tmp_path):
    out = tmp_path / "out"
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    assert_refused(capsys, f"cannot load model '{empty}'", str(empty), data["ids"], out)
    assert_refused(
        capsys,
        "layer ids [5, 9] are out of range for a model of 4 layers",
        tiny_model,
        data["ids"],
        out,
        "--layers",
        "2,5,9",
    )
    assert_refused(capsys, "--layers must be comma-separated integers", tiny_model, data["ids"], out, "--layers", "two")
    # A chat dataset needs a chat template.
    no_template = tmp_path / "no-template"
    shutil.copytree(tiny_model, no_template)
    (no_template / "chat_template.jinja").unlink()
    assert_refused(
        capsys,
        "the data has 'messages' but the model's tokenizer has no chat template",
        str(no_template),
        data["chat"],
        out,
    )


def test_bad_options(capsys, tiny_model, data, tmp_path):
    out, ids = tmp_path / "out", data["ids"]
    cases = [
        ("--engine-args is not JSON", ["--engine-args", "{x"]),
        (
            "--engine-args: 'tensor_paralel_size' is not an argument of vLLM's LLM",
            ["--engine-args", '{"tensor_paralel_size": 2}'],
        ),
        ("--engine-args may not set 'speculative_config'", ["--engine-args", '{"speculative_config": {}}']),
        (
            "--max-len 600 plus --max-tokens 1 exceeds the engine's max_model_len 512",
            ["--max-len", "600", "--engine-args", json.dumps({**TINY_ENGINE_ARGS, "max_model_len": 512})],
        ),
        ("--max-tokens must be a positive integer, not 0", ["--max-tokens", "0"]),
        ("--limit must be a positive integer, not 0", ["--limit", "0"]),
        ("--sampling-args: n must be 1", ["--sampling-args", '{"n": 2}']),
        ("--sampling-args: ", ["--sampling-args", '{"temprature": 0}']),
        ("--connector-args: layertap connector: codec", ["--connector-args", '{"codec": "lz4"}']),
        ("--connector-args may not set 'writer_id'", ["--connector-args", '{"writer_id": "x"}']),
        ("--connector-args may not set 'capture'", ["--connector-args", '{"capture": "in-model"}']),
    ]
    for message, extra in cases:
        assert_refused(capsys, message, tiny_model, ids, out, *extra)


def test_output_directory_not_for_this_run(capsys, tiny_model, data, tmp_path):
    foreign = tmp_path / "foreign"
    with layertap.ShardWriter(str(foreign), writer_id="w") as w:
        w.submit("0", {"token_ids": __import__("numpy").arange(3)})
    status, err = run(capsys, tiny_model, data["ids"], foreign)
    assert status == 2 and "not written by layertap generate" in err and len(err.strip().splitlines()) == 1
    busy = tmp_path / "busy"
    busy.mkdir()
    fd = os.open(busy / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert_refused(
            capsys, "another layertap generate is writing into this directory", tiny_model, data["ids"], busy
        )
    finally:
        os.close(fd)


def test_data_without_a_usable_row(capsys, tiny_model, tmp_path):
    """Every row bad: no engine starts, no record, exit status 2 with one line naming the most
    common reason, and the summary does not call the dataset complete."""
    with open(os.path.join(tiny_model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    lines = [{"input_ids": [5, vocab + i]} for i in range(3)] + ["{oops"]
    data = write_jsonl(tmp_path / "bad.jsonl", lines)
    out = tmp_path / "out"
    args = ["generate", tiny_model, "--data", data, "--out", str(out), "--json", "--progress", "none"]
    status = layertap_cli([*args, "--engine-args", json.dumps(TINY_ENGINE_ARGS)])
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert status == 2, captured.err
    assert captured.err.strip().splitlines() == [
        f"layertap generate: no record written: all 4 rows are bad, 3 of them: input_ids holds {vocab}, outside "
        f"the vocabulary of {vocab} tokens; fix the data (the summary lists every bad row)"
    ]
    assert summary["complete"] is False and summary["rows_bad"] == 4 and summary["rows_written"] == 0
    assert summary["seconds"]["engine_start"] == 0  # the engine was never started
    assert not list(out.glob("*.lts"))


def test_engine_that_does_not_start(capsys, tiny_model, data, tmp_path, monkeypatch):
    """A setting vLLM refuses only while its engine starts (a KV cache too small for one
    request): one line naming vLLM's error and its log, which says to fix the cause, not to
    resume; the traceback is in the log."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine_args = {**TINY_ENGINE_ARGS, "kv_cache_memory_bytes": 4096}
    status, err = run(capsys, tiny_model, data["ids"], tmp_path / "out", engine_args=engine_args)
    last = err.strip().splitlines()[-1]
    assert status == 1, err[-2000:]
    assert last.startswith("layertap generate: vLLM's engine did not start: "), last
    log = tmp_path / "out" / "vllm.log"  # vLLM's log: in the directory, named in the line
    assert last.endswith(f"this run wrote nothing: fix the cause (vLLM log: {log}), then run the command again"), last
    assert "Traceback" not in err and "resume" not in last
    assert "ValueError: No available memory for the cache blocks" in last
    assert " INFO " in log.read_text() and "Traceback" in log.read_text()
