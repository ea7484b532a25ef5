"""``HiddenStatesDataset(..., decode_on=...)``: exp-huf records decoded by the Triton decoder give
batches bit for bit equal to the CPU path's (items, pad_collate, pack_collate, layers, exp-huf
and codec-none records mixed; the Rust writer's exp-huf records, coded by column, decoded by the
kernel too; a batch's payloads read straight into one staging buffer, ``Staging``), a damaged
record raises CorruptRecordError or is skipped as the CPU path skips it, and a missing CUDA device, an unknown device and DataLoader workers are refused
in one line. tests/triton_kernels/check_torch_gpu_decode.py does the work in a subprocess, in
Triton's interpreter on CPU tensors (``decode_on="cpu"``; triton lives outside the virtualenv,
``.venv/triton``, so that vLLM's CPU build in this process never sees it): once for every case,
and each test reads its case's line. In this process, without triton, decode_on is refused in one
line and never imports the decoder."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import layertap
from helpers import case_lines, run_in_triton_interpreter
from layertap.errors import InvalidInputError
from layertap.torch import HiddenStatesDataset

# The checks run once, in the first test's setup: 13-27 s of CPU in the interpreter as
# tests/triton_kernels/faster_interpreter.py makes it (41-47 s without), minutes on a loaded machine.
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "triton_kernels" / "check_torch_gpu_decode.py"

CASES = ["batches-equal", "by-column", "staged", "layers", "damaged-record", "damaged-by-column", "refused"]


def run_check(*args: str) -> subprocess.CompletedProcess:
    return run_in_triton_interpreter(SCRIPT, *args)


@pytest.fixture(scope="module")
def checked() -> subprocess.CompletedProcess:
    """Every case the script has, in one run (``all``)."""
    return run_check("all")


def test_the_script_runs_the_cases_tested_here(checked):
    assert checked.returncode in (0, 1), checked.stdout + checked.stderr
    assert list(case_lines(checked)) == CASES, checked.stdout + checked.stderr


@pytest.mark.parametrize("case", CASES)
def test_decoding_on_the_device_gives_the_cpu_paths_batches(checked, case):
    line = case_lines(checked).get(case, "")
    assert line.startswith(f"ok {case}: "), checked.stdout + checked.stderr


def test_without_triton_decode_on_says_what_it_needs_in_one_line(tmp_path, monkeypatch):
    assert importlib.util.find_spec("triton") is None, "this process must not see triton (vLLM's CPU build)"
    with layertap.ShardWriter(str(tmp_path), writer_id="w") as w:
        w.submit("0", {"hidden_states": torch.zeros(2, 1, 4), "token_ids": torch.arange(2)})
    with pytest.raises(InvalidInputError, match=r"^decode_on='cuda' needs a CUDA device and triton; .*triton is not installed"):  # fmt: skip
        HiddenStatesDataset(tmp_path, decode_on="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(InvalidInputError, match=r"^decode_on='cpu' runs the Triton kernel .* set TRITON_INTERPRET=1"):
        HiddenStatesDataset(tmp_path, decode_on="cpu")
    assert HiddenStatesDataset(tmp_path)[0]["token_ids"].tolist() == [0, 1]
    assert "layertap.gpu.exphuf_decode" not in sys.modules
