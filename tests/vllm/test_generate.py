"""``layertap generate`` through real vLLM engines: records equal transformers' hidden states
for the rendered tokens, bad rows skipped and listed, loss masks and output tokens, and the
progress output on a terminal and without one (its last figures final and timed to the last
row), vLLM's log in the dataset's directory rather than on stderr (on stderr with --verbose:
test_generate_start_stop.py's SIGTERM test)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import shutil
import struct
import termios

import pytest
import torch
from generate_support import TINY_ENGINE_ARGS, Child, chat_rows, generate_cmd, id_rows, write_jsonl

import layertap
from helpers import flip_bit, payload_offset
from layertap._text import human_bytes
from layertap.cli import main as layertap_cli
from vllm_support import VLLM_WARNINGS, assert_hidden_states_match, pytest_env

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

#: The tiny model's EAGLE-3 default: [2, 4//2, 4-3, 4], distinct.
DEFAULT_LAYERS = [1, 2, 4]


def render(tokenizer, messages: list[dict]) -> list[int]:
    """The chat as transformers renders and tokenizes it."""
    return list(
        tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=False, add_generation_prompt=messages[-1]["role"] != "assistant"
        )
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def chat_run(tiny_model, tmp_path_factory):
    """One run over 200 chats and 4 bad rows, in float32, with the engine in this process."""
    tmp = tmp_path_factory.mktemp("gen-chat")
    rows = chat_rows(200)
    long_chat = {"messages": [{"role": "user", "content": " ".join(["water"] * 140)}]}
    lines = [*rows, long_chat, "{oops", {"prompt": "no messages"}, {"messages": "not a list"}]
    data = write_jsonl(tmp / "chat.jsonl", lines)
    out = tmp / "out"
    with pytest_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
        summary = layertap.generate(
            tiny_model, data, out, max_len=128, progress="none", engine_args={**TINY_ENGINE_ARGS, "dtype": "float32"}
        )
    return rows, out, summary


def assert_summary_fields(summary: dict) -> None:
    """A summary has every field its type (``layertap.generate.summary.Summary``) requires, and
    none it does not name; so do its seconds and bad rows."""
    from layertap.generate.summary import BadRowEntry, Seconds, Summary

    assert Summary.__required_keys__ <= set(summary) <= Summary.__required_keys__ | Summary.__optional_keys__
    assert "complete" in summary and set(summary["seconds"]) == Seconds.__required_keys__
    assert all(set(b) == BadRowEntry.__required_keys__ for b in summary["bad_rows"])


def test_the_summary_has_the_fields_of_its_type(chat_run):
    _, _, summary = chat_run
    assert_summary_fields(summary)
    assert summary["capture"] == "method" and summary["bad_rows"]


def test_records_equal_transformers(chat_run, tiny_model, tokenizer, reference):
    rows, out, summary = chat_run
    assert summary["rows"] == 204 and summary["rows_written"] == 200 and summary["rows_done_before"] == 0
    assert summary["complete"] and summary["rows_missing"] == 0 and summary["duplicate_records"] == 0
    assert summary["layer_ids"] == DEFAULT_LAYERS and summary["column"] == "messages"
    with layertap.open(out) as ds:
        assert sorted(ds.keys(), key=int) == [str(i) for i in range(200)]
        assert ds.verify().ok and all(s.complete for s in ds.shards)
        user = ds.shards[0].meta["user"]
        assert (
            user
            == {
                "source": "layertap.generate",
                "model": tiny_model,
                "model_revision": "",
                "layer_ids": "[1, 2, 4]",
                "layer_numbering": "vllm",
                "dtype": "float32",
                "layertap_version": layertap.__version__,
                "vllm_version": user["vllm_version"],
            }
            and user["vllm_version"]
        )
        seqs = [render(tokenizer, row["messages"]) for row in rows]
        # One batched transformers forward for all rows (a forward per row costs a minute here);
        # one row through the per-record check, which also compares layer by layer.
        want = reference.hidden_states_batch(seqs, DEFAULT_LAYERS)
        for i, ids in enumerate(seqs):
            record = ds[str(i)]
            assert record.token_ids.tolist() == ids and record.layer_ids == DEFAULT_LAYERS
            assert record.metadata["row"] == str(i) and record.metadata["num_tokens"] == str(len(ids))
            assert "loss_mask" not in record.tensors
            torch.testing.assert_close(record.hidden_states, want[i], rtol=1e-5, atol=1e-5)
        assert_hidden_states_match(ds["7"], reference, seqs[7], layers=DEFAULT_LAYERS)
    assert summary["tokens"] == sum(map(len, seqs)) and summary["ratio"] > 1.0


def test_bad_rows_are_skipped_and_listed(chat_run):
    _, _, summary = chat_run
    reasons = {b["row"]: b["reason"] for b in summary["bad_rows"]}
    assert summary["rows_bad"] == 4 and sorted(reasons) == [200, 201, 202, 203]
    assert reasons[200] == "143 tokens, more than --max-len 128"  # with role markers and generation prompt
    assert reasons[201].startswith("not JSON")
    assert reasons[202] == "no 'messages'"
    assert reasons[203].startswith("messages must be a non-empty list")


def test_a_rerun_writes_again_a_record_that_fails_its_checksum(chat_run, tiny_model, tmp_path):
    """Issue 34, item 4: one flipped byte in a record's payload; the same command run again
    counts that record as missing, takes it out of its shard's index and writes its row again,
    so that both readers return the new record and verify passes (noting what the repair left
    unindexed). A copy of chat_run's dataset: one more engine start (in this process, as
    chat_run's), for one row."""
    _, done, _ = chat_run
    out = tmp_path / "out"
    shutil.copytree(done, out)
    shard = sorted(out.glob("*.lts"))[0]
    at, length, key = payload_offset(shard, 7)
    with layertap.open(shard) as ds:
        before = {k: ds[k].tensors for k in ds.keys()[:3] if k != key}
        want = ds[key].hidden_states
    flip_bit(shard, at + length // 2)
    with layertap.open(out) as ds:
        assert [p.key for p in ds.verify().problems] == [key]
    with pytest_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
        summary = layertap.generate(
            tiny_model,
            done.parent / "chat.jsonl",
            out,
            max_len=128,
            progress="none",
            engine_args={**TINY_ENGINE_ARGS, "dtype": "float32"},
        )
    assert summary["rows_written"] == 1 and summary["rows_done_before"] == 199 and summary["complete"], summary
    assert [(d["row"], d["shard"]) for d in summary["damaged_records"]] == [(int(key), str(shard))]
    assert "payload checksum mismatch" in summary["damaged_records"][0]["reason"]
    for backend in ("rust", "python"):
        with layertap.open(out, backend=backend) as ds:
            report = ds.verify()
            assert report.ok and report.records_ok == 200 and not report.duplicates, report.problems
            assert report.lost_in_recovery == 1  # the damaged frame, still in the file, unindexed
            assert sorted(ds.keys(), key=int) == [str(i) for i in range(200)]
            assert ds[key].shard != str(shard) and ds[key].metadata["row"] == key
            torch.testing.assert_close(ds[key].hidden_states, want)  # the row written again, as before
            for k, tensors in before.items():  # the shard's other records are kept as they were
                assert ds[k].shard == str(shard)
                for name, t in tensors.items():
                    torch.testing.assert_close(ds[k].tensors[name], t, rtol=0, atol=0)


def test_loss_mask_and_output_tokens(tiny_model, reference, tmp_path):
    """Token ids with loss masks from Parquet, three generated tokens of which two are recorded
    (with mask 1), explicit layers, bfloat16."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = id_rows(12, 5, 60, seed=3, loss_mask=True)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    with pytest_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
        summary = layertap.generate(
            tiny_model,
            tmp_path / "d.parquet",
            tmp_path / "out",
            layers="4,0",
            max_tokens=3,
            include_output_tokens=True,
            sampling_args={"temperature": 0.0, "ignore_eos": True},
            engine_args={**TINY_ENGINE_ARGS, "dtype": "bfloat16"},
            progress="none",
        )
    assert summary["complete"] and summary["rows_written"] == 12 and summary["loss_mask"]
    with layertap.open(tmp_path / "out") as ds:
        assert ds.verify().ok
        for i, row in enumerate(rows):
            record = ds[str(i)]
            n = len(row["input_ids"])
            assert record.num_tokens == n + 2 and record.token_ids[:n].tolist() == row["input_ids"]
            mask = record.tensors["loss_mask"]
            assert mask.dtype == torch.uint8 and mask.tolist() == row["loss_mask"] + [1, 1]
            assert record.metadata["num_prompt_tokens"] == str(n)
            assert_hidden_states_match(record, reference, record.token_ids.tolist(), layers=[0, 4])


#: A line of vLLM's log (its own format, "(EngineCore pid=7) WARNING ...", or the command's file's).
VLLM_LOG_LINE = re.compile(r"pid=\d+\)? (DEBUG|INFO|WARNING) ")


def assert_no_vllm_log(lines: list[str]) -> None:
    """None of vLLM's log lines, nor the warnings of the processes it runs, on stderr."""
    noise = [line for line in lines if VLLM_LOG_LINE.search(line) or "Warning" in line or "Triton" in line]
    assert not noise, noise


def assert_vllm_log_in(out) -> None:
    """vLLM's log of the run is in ``out/vllm.log``, from each of its processes."""
    log = (out / "vllm.log").read_text()
    for process in ("MainProcess pid=", "EngineCore", "VllmWorker"):
        assert process in log, process
    assert " INFO " in log and " WARNING " in log


def test_progress_lines_and_json_without_a_terminal(tiny_model, tmp_path, capfd, in_process_command):
    """stderr not a terminal: plain progress lines, and with --json the summary is all that stdout
    holds. The last line has every record's bytes and times the rows, not the drain and the
    engine's shutdown; vLLM's log is in the dataset's directory, not on stderr. The command and
    its engine run in this process, where a child and its engine's process took 30 s more: the
    default layout's stderr and stdout are test_progress_bar_on_a_terminal's, and on a pipe
    test_generate_start_stop.py's test_ctrl_c_then_the_documented_command_resumes'."""
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(40, seed=1))
    out = tmp_path / "out"
    capfd.readouterr()
    status = layertap_cli(generate_cmd(tiny_model, data, str(out), "--json", "--progress-interval", "0.2")[3:])
    got = capfd.readouterr()
    lines = got.err.replace("\r", "\n").splitlines()
    assert status == 0, got.err[-3000:]
    summary = json.loads(got.out)
    assert summary["complete"] and summary["rows_written"] == 40
    progress = [line for line in lines if line.startswith("generate: ")]
    assert progress and progress[-1].startswith("generate: 40/40 rows (100%), "), got.err
    assert " tok/s, " in progress[-1] and " written, ratio " in progress[-1] and "elapsed" in progress[-1]
    assert f", {human_bytes(summary['stored_bytes'])} written, " in progress[-1], (progress[-1], summary)
    h, m, sec = map(int, re.search(r"(\d+):(\d\d):(\d\d) elapsed", progress[-1]).groups())
    seconds = summary["seconds"]
    assert 3600 * h + 60 * m + sec <= seconds["generate"] + 1, (progress[-1], seconds)
    assert not any(line.startswith("generate:") and "%|" in line for line in lines)  # no bar drawn
    assert not any("Loading safetensors checkpoint shards" in line for line in lines)  # nor vLLM's
    # vLLM's INFO and warnings go to its log; its errors are shown on stderr too (docs/GENERATE.md),
    # and in this process, where vLLM and torch were imported before the command set their
    # logging, it logs some ("Failed to import Triton kernels") and torch's C++ a NUMA warning.
    assert not [line for line in lines if VLLM_LOG_LINE.search(line)], got.err
    log = (out / "vllm.log").read_text()
    assert "MainProcess pid=" in log and " INFO " in log


def test_progress_bar_on_a_terminal(tiny_model, tmp_path):
    """The engine in its own process, stderr a terminal: a bar, whose last drawing shows every
    record's bytes and the time up to the last row (issue 24: bytes drawn late, the time
    including the drain and the engine's shutdown), with none of vLLM's log drawn into it; with
    --json, the summary is all that stdout holds, with the engine's processes beside it."""
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(30, seed=2))
    out = tmp_path / "out"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # 40 rows, 120 columns
    try:
        child = Child(generate_cmd(tiny_model, data, str(out), "--json"), multiprocessing=True, stderr_fd=slave)
        os.close(slave)
        child.follow(master)
        assert child.finish(timeout=240) == 0, child.stderr
    finally:
        os.close(master)
    bars = [line for line in child.lines if line.startswith("generate:") and "%|" in line]
    assert bars, child.stderr
    assert "30/30" in bars[-1] and "tok/s" in bars[-1] and "written" in bars[-1] and "ratio" in bars[-1], bars
    assert not any(line.startswith("generate: 30/30 rows (100%)") for line in child.lines)  # no plain lines
    summary = json.loads(child.stdout)
    assert summary["complete"] and summary["rows_written"] == 30 and summary["rows_done_before"] == 0
    assert f"{human_bytes(summary['stored_bytes'])} written" in bars[-1], (bars[-1], summary)
    minutes, seconds = map(int, re.search(r"\| 30/30 \[(\d+):(\d+)<", bars[-1]).groups())
    assert 60 * minutes + seconds <= summary["seconds"]["generate"] + 1, (bars[-1], summary["seconds"])
    assert_no_vllm_log(child.lines)
    assert_vllm_log_in(out)
