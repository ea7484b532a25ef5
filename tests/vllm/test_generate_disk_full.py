"""``layertap generate`` into a directory on a full disk (issue 34 item 3), a real 600 KB tmpfs:
the run stops once the engine's writer fails, with one line naming the directory and the space
left (and no line of vLLM's), exit 1; its progress counted the records written, not the rows the engine finished; the
records written before the failure read back whole, and the same command resumes after them once
there is room. It used to wait DRAIN_STALL_SECONDS (120 s)
for records that could never come, then print a summary saying to run again."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from generate_support import chat_rows, engine_processes_in_default_layout, generate_cmd, write_jsonl

import layertap
from helpers import mounted_tmpfs
from layertap.cli import main as layertap_cli
from vllm_support import VLLM_WARNINGS

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]


def test_generate_stops_at_a_full_disk_with_one_line(tiny_model, tmp_path, capfd, in_process_command, monkeypatch):
    # The command in this process (a child's import of vLLM saved: 10 s of CPU), its engine in
    # vLLM's default layout, whose processes' stderr is this process's.
    engine_processes_in_default_layout(monkeypatch)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(50, seed=1))
    with mounted_tmpfs(tmp_path / "hs", "600k") as out:
        capfd.readouterr()
        status = layertap_cli(
            generate_cmd(tiny_model, data, out, "--progress", "lines", "--progress-interval", "0.2")[3:]
        )
        got = capfd.readouterr()
        lines = got.err.replace("\r", "\n").splitlines()
        assert status == 1, got.err[-3000:]
        assert got.out == "", got.out  # no summary: the run did not go on to one
        # Besides the progress lines, one line: not vLLM's errors as its engine stops. (The drain's
        # path never prints it: it ends with a summary on stdout instead.)
        others = [text for text in lines if not text.startswith("generate: ")]
        assert len(others) == 1, got.err[-3000:]
        line = others[0]
        assert line.startswith(f"layertap generate: {out}: disk full, "), line
        free = re.search(r"disk full, (.+?) free \(write of gen-0-000000\.lts failed: ", line)
        assert free, line
        assert line.endswith("then run the same command again to resume"), line
        assert "Traceback" not in got.err, got.err[-3000:]
        # What was written before the failure is there, whole, and the progress counted it.
        with layertap.open(out) as ds:
            written = len(ds)
            assert all(ds[k]["hidden_states"].shape[0] > 0 for k in ds.keys())
        assert 0 < written < 50
        progress = [text for text in lines if text.startswith("generate: ")]
        assert progress and progress[-1].startswith(f"generate: {written}/50 rows "), (progress, written)
        verified = subprocess.run([sys.executable, "-m", "layertap", "verify", out], capture_output=True, text=True)
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert os.path.exists(os.path.join(out, "gen-0.error"))
        # With room, the same command resumes after them (the error file left is the run's), its
        # engine in this process too.
        subprocess.run(["mount", "-o", "remount,size=8m", out], check=True)
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        status = layertap_cli(generate_cmd(tiny_model, data, out, "--progress", "none")[3:])
        captured = capfd.readouterr()
        assert status == 0, captured.err[-3000:]
        assert "dataset complete: 50 of 50 usable rows" in captured.out, captured.out
        with layertap.open(out) as ds:
            assert sorted(map(int, ds.keys())) == list(range(50))
