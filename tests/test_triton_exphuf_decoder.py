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

from helpers import run_in_triton_interpreter

# The checks run once, in the first test's setup: about 40 s of CPU, minutes on a loaded machine.
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "triton_kernels" / "check_exphuf_decoder.py"

CASES = [
    "BF16-8x3x256",
    "BF16-33x2x100",
    "BF16-1000",
    "F16-24x4x64",
    "F32-40x50",
    "BF16-2x3000",
    "BF16-3000x1",
    "BF16-1500x2",
    "F32-1000x3",
    "one-symbol",
    "special-values",
    "incompressible",
    "short",
    "ids-only",
    "multi-tensor",
    "cols-BF16-8x3x256",
    "cols-BF16-400x13",
    "cols-BF16-1000",
    "cols-F16-24x4x64",
    "cols-F32-40x50",
    "cols-F32-1000x3",
    "cols-special-values",
    "cols-multi-tensor",
    "cols-BF16-200x20-streams-7",
    "cols-F32-300x9-streams-9",
    "cols-BF16-16x3x64-streams-16",
    "cols-BF16-3000-streams-1",
    "BF16-1000-plain-kernel",
    "BF16-1500x2-plain-kernel",
    "F32-1000x3-plain-kernel",
    "multi-tensor-plain-kernel",
    "BF16-1000-live-4",
    "F32-40x50-live-4",
    "multi-tensor-live-4",
    "BF16-1500x2-pos64",
    "F32-40x50-pos64",
    "cols-BF16-400x13-pos64",
    "cols-F32-40x50-pos64",
    "cols-BF16-200x20-streams-7-column-lanes-4",
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
    return run_check(*CASES)


def test_the_script_lists_the_cases_tested_here():
    got = run_check()
    assert got.returncode == 0, got.stdout + got.stderr
    assert got.stdout.split() == CASES


@pytest.mark.parametrize("case", CASES)
def test_the_triton_decoder_gives_the_original_tensors_or_refuses_a_damaged_payload(checked, case):
    lines = checked.stdout.splitlines()
    mine = [ln for ln in lines if ln.startswith((f"ok {case}: ", f"FAIL {case}: "))]
    assert mine and mine[0].startswith("ok "), checked.stdout + checked.stderr
