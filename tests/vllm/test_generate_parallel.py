"""``layertap generate`` on many engines, through real vLLM engines on the CPU: two engine
processes (``--data-parallel-size 2``) and two engines on a local Ray cluster started by the test
(``--ray``) each write one dataset of parts whose records equal a single engine's; a later run
resumes across the parts (a row is done whichever engine wrote it), and ``inspect``/``verify``
read the parts as one dataset."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from generate_support import TINY_ENGINE_ARGS, Child, generate_cmd, id_rows, write_jsonl
from ray_cluster import ray_env

import layertap
from helpers import run_cli
from layertap.cli import main as layertap_cli
from layertap.parts import MANIFEST_NAME
from vllm_support import VLLM_WARNINGS, pytest_env

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

ROWS = 16
FLOAT32 = {"dtype": "float32"}
PROGRESS = re.compile(r"^generate: ([\d,]+)/([\d,]+) rows")


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory):
    """The data, and one engine's dataset of it (engine in this process). Its connector saves
    only requests that ask (``save="requested"``, docs/CONNECTOR.md): generate names every row's
    record, so every row is saved all the same."""
    tmp = tmp_path_factory.mktemp("gen-parallel")
    data = write_jsonl(tmp / "ids.jsonl", id_rows(ROWS, 5, 40, seed=11, loss_mask=True))
    with pytest_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
        summary = layertap.generate(
            tiny_model,
            data,
            tmp / "one",
            progress="none",
            engine_args={**TINY_ENGINE_ARGS, **FLOAT32},
            connector_args={"save": "requested"},
        )
    assert summary["complete"] and summary["rows_written"] == ROWS
    return data, tmp / "one"


def assert_same_records(got: Path, want: Path) -> None:
    """``got`` (a dataset of parts) verifies, holds each row once, and its records equal
    ``want``'s: the same tokens, loss masks and layers, hidden states equal up to float32
    rounding (the engines batch the rows differently)."""
    with layertap.open(got) as ds, layertap.open(want) as ref:
        assert ds.verify().ok and ds.duplicates == []
        assert sorted(ds.keys(), key=int) == sorted(ref.keys(), key=int) == [str(i) for i in range(ROWS)]
        for key in ref.keys():
            a, b = ds[key], ref[key]
            assert a.token_ids.tolist() == b.token_ids.tolist() and a.layer_ids == b.layer_ids
            assert torch.equal(a["loss_mask"], b["loss_mask"]) and a.metadata["row"] == key
            torch.testing.assert_close(a.hidden_states, b.hidden_states, rtol=1e-5, atol=1e-5)


def progress_rows(lines: list[str]) -> list[tuple[int, int]]:
    return [(int(m[1].replace(",", "")), int(m[2].replace(",", ""))) for m in map(PROGRESS.match, lines) if m]


def wait_for_children(pid: int, n: int, timeout: float) -> list[int]:
    """The first ``n`` child processes of ``pid``, once it has started them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
        if len(children) >= n:
            return children[:n]
        time.sleep(0.05)
    raise AssertionError(f"process {pid} did not start {n} engine processes in {timeout} s")


def wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and "zombie" not in _state(pid):
        assert time.monotonic() < deadline, f"engine process {pid} outlived the run that started it"
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((line for line in f if line.startswith("State:")), "").lower()
    except FileNotFoundError:
        return "zombie"


@pytest.mark.timeout(900)  # four runs, six engines in all, on a shared 2-core machine
def test_two_engine_processes_then_resume_with_one(tiny_model, reference, tmp_path, capfd, in_process_command):
    data, one = reference
    out = tmp_path / "two"
    cmd = generate_cmd(
        tiny_model,
        data,
        str(out),
        "--data-parallel-size",
        "2",
        "--limit",
        "10",
        "--json",
        "--progress",
        "lines",
        "--progress-interval",
        "0.5",
        engine_args=FLOAT32,
    )
    # The command in this process (the engines in theirs): its own import of vLLM is the test's.
    status = layertap_cli(cmd[3:])  # the arguments after `python -m layertap`
    captured = capfd.readouterr()  # the engine processes' stderr is this process's
    assert status == 0, captured.err[-3000:]
    s = json.loads(captured.out)
    lines = captured.err.replace("\r", "\n").splitlines()
    assert s["complete"] and s["rows"] == 10 and s["rows_written"] == 10 and s["data_parallel_size"] == 2
    from layertap.generate.summary import EngineEntry, Summary

    assert Summary.__required_keys__ <= set(s) <= Summary.__required_keys__ | Summary.__optional_keys__
    assert all(set(e) <= EngineEntry.__optional_keys__ for e in s["engines"]) and len(s["engines"]) == 2
    assert s["parts"] == [str(out / "engine-0"), str(out / "engine-1")] and s["engine_errors"] == []
    # Distinct writer ids across the parts (a dataset in Mooncake Store lists records by writer).
    assert [(e["rows_assigned"], e["rows_written"], e["writer_id"]) for e in s["engines"]] == [
        (5, 5, "gen-0"),
        (5, 5, "gen-1"),
    ]
    assert s["tokens"] > 0 and s["stored_bytes"] > 0 and s["duplicate_records"] == 0
    # One progress for both engines, counted against all 10 rows.
    seen = progress_rows(lines)
    assert seen and seen[-1] == (10, 10) and {total for _, total in seen} == {10}, captured.err[-3000:]
    assert json.loads((out / MANIFEST_NAME).read_text())["parts"] == ["engine-0", "engine-1"]
    for part in ("engine-0", "engine-1"):  # each engine's vLLM log in its part, none on stderr
        assert " INFO " in (out / part / "vllm.log").read_text()
    assert not any(" WARNING " in line for line in lines), captured.err[-3000:]
    with layertap.open(out / "engine-0") as ds:  # rows dealt out in turn
        assert sorted(ds.keys(), key=int) == ["0", "2", "4", "6", "8"]
    # A run killed (SIGKILL, the command alone) as soon as its engine processes exist: they end
    # too, within seconds, rather than keep writing into parts that the next run resumes.
    child = Child(generate_cmd(tiny_model, data, str(out), "--data-parallel-size", "2"), multiprocessing=False)
    engines = wait_for_children(child.proc.pid, 2, timeout=300)
    os.kill(child.proc.pid, signal.SIGKILL)
    child.finish(timeout=60)
    for pid in engines:
        wait_gone(pid, timeout=60)
    # One engine (in this process) resumes the whole dataset: the rows of both parts are done.
    with pytest_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
        s = layertap.generate(tiny_model, data, out, progress="none", engine_args={**TINY_ENGINE_ARGS, **FLOAT32})
    assert s["rows_done_before"] == 10 and s["rows_written"] == ROWS - 10 and s["complete"]
    assert s["engines"][0]["writer_id"] == "gen-2" and s["duplicate_records"] == 0
    assert_same_records(out, one)
    proc = run_cli("verify", out)
    assert proc.returncode == 0 and "in 3 shards of 2 parts" in proc.stdout, proc.stdout + proc.stderr
    proc = run_cli("inspect", out)
    assert proc.returncode == 0 and "engine-1/gen-1-000000.lts" in proc.stdout


@pytest.mark.timeout(900)
def test_two_engines_on_a_local_ray_cluster(tiny_model, reference, tmp_path):
    data, one = reference
    env = ray_env()
    # Ray's socket paths must stay short (108 bytes): a folder directly in /tmp.
    ray_tmp = tempfile.mkdtemp(prefix="lt-ray-", dir="/tmp")
    cluster = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("ray_cluster.py")), "2", ray_tmp],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, **env},
        start_new_session=True,
        text=True,
    )
    try:
        line = cluster.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("address "), f"the Ray cluster did not start: {line!r}"
        address = line.split()[1]
        out = tmp_path / "ray"
        cmd = generate_cmd(
            tiny_model, data, str(out), "--ray", address, "--data-parallel-size", "2", "--json", engine_args=FLOAT32
        )
        proc = subprocess.run(
            cmd,
            env={**os.environ, **env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        s = json.loads(proc.stdout)
        assert s["complete"] and s["ray_address"] == address and s["rows_written"] == ROWS
        assert [e["rows_written"] for e in s["engines"]] == [ROWS // 2] * 2
        assert_same_records(out, one)
    finally:
        cluster.stdin.close()  # type: ignore[union-attr]
        try:
            cluster.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(cluster.pid, 9)
            cluster.wait(10)
        cluster.stdout.close()  # type: ignore[union-attr]
        subprocess.run(["rm", "-rf", ray_tmp], check=False)
