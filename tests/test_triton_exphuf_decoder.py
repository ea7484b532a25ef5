"""The Triton decoder of exp-huf (layertap.gpu.exphuf_decode) in Triton's interpreter on the CPU:
records the Rust encoder wrote decode to tensors bit for bit equal to the originals (bf16, f16,
f32, raw blocks, other dtypes, special values; blocks coded by element, mode 1, and by column,
mode 2, the ``cols-`` cases, equal to the core's decode too), and damaged payloads raise a
CorruptRecordError naming what is wrong. tests/triton_kernels/check_exphuf_decoder.py does the work in a subprocess
(triton lives outside the virtualenv, ``.venv/triton``, so that vLLM's CPU build in this process
never sees it): once for every case, its decoding cases in one batch as a trainer's would be
(the interpreter's time is the longest segment's, not the batch's), and each test reads its
case's line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from helpers import case_lines, run_in_triton_interpreter

# The checks run once, in the first test's setup: 15-20 s of CPU in the interpreter as
# tests/triton_kernels/faster_interpreter.py makes it (35-37 s without), more on a loaded machine.
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "triton_kernels" / "check_exphuf_decoder.py"

CASES = [
    "BF16-2x3x256",
    "BF16-7x2x100",
    "BF16-1000",
    "F16-6x4x64",
    "F32-20x50",
    "BF16-2x800",
    "BF16-1200x1",
    "BF16-400x2",
    "F32-400x3",
    "one-symbol",
    "special-values",
    "incompressible",
    "short",
    "ids-only",
    "multi-tensor",
    "cols-BF16-2x3x256",
    "cols-BF16-70x13",
    "cols-BF16-1000",
    "cols-F16-6x4x64",
    "cols-F32-20x50",
    "cols-F32-400x3",
    "cols-special-values",
    "cols-multi-tensor",
    "cols-BF16-60x20-streams-7",
    "cols-F32-300x9-streams-9",
    "cols-BF16-16x3x64-streams-16",
    "cols-BF16-800-streams-1",
    "BF16-1000-plain-kernel",
    "BF16-400x2-plain-kernel",
    "F32-400x3-plain-kernel",
    "multi-tensor-plain-kernel",
    "BF16-1000-live-4",
    "F32-20x50-live-4",
    "multi-tensor-live-4",
    "BF16-400x2-pos64",
    "F32-20x50-pos64",
    "cols-BF16-70x13-pos64",
    "cols-F32-20x50-pos64",
    "cols-BF16-60x20-streams-7-column-lanes-4",
    "cols-multi-tensor-column-lanes-4",
    "tensor-payloads",
    "damaged-stream-lengths",
    "damaged-stream-garbage",
    "damaged-stream-padding",
    "damaged-code-lengths",
    "damaged-trailing-byte",
    "damaged-cut-off",
    "cols-damaged-stream-lengths",
    "cols-damaged-stream-garbage",
    "cols-damaged-flipped-byte",
    "cols-damaged-stream-padding",
    "cols-damaged-plane-padding",
    "cols-damaged-columns",
    "cols-damaged-streams",
    "cols-damaged-trailing-byte",
    "cols-damaged-cut-stream",
    "cols-damaged-cut-plane",
    "compiles-for-sm90",
]


def run_check(*args: str) -> subprocess.CompletedProcess:
    return run_in_triton_interpreter(SCRIPT, *args)


@pytest.fixture(scope="module")
def checked() -> subprocess.CompletedProcess:
    """Every case the script has, in one run (``all``: torch and triton start once)."""
    return run_check("all")


def test_the_script_runs_the_cases_tested_here(checked):
    assert checked.returncode in (0, 1), checked.stdout + checked.stderr
    assert list(case_lines(checked)) == CASES, checked.stdout + checked.stderr


@pytest.mark.parametrize("case", CASES)
def test_the_triton_decoder_gives_the_original_tensors_or_refuses_a_damaged_payload(checked, case):
    line = case_lines(checked).get(case, "")
    assert line.startswith(f"ok {case}: "), checked.stdout + checked.stderr
