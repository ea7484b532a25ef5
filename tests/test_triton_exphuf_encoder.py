"""The Triton kernels of the exp-huf encoder (layertap.gpu.exphuf_triton, ``impl="triton"``) in
Triton's interpreter on the CPU: bit for bit the Rust encoder's blocks on the cases of
tests/test_gpu_exphuf.py, its edge cases, a mode among tied counts, f32 values spanning three
packing words, a batch, and real activations, and the same buffer as the torch operations; with the code tables
built on the device too, and those tables against the Rust core's on counts with ties and
counts whose codes need the bisection (among them tables whose last bisection step does not
fit); and every kernel compiled for sm_90 without a GPU, none over the PTX size that takes
minutes to compile (``PTX_LIMIT``). The cases run in tests/triton_kernels/check_exphuf_encoder.py, in one
subprocess (torch and triton start once: seconds): triton lives outside the virtualenv
(``.venv/triton``, installed from requirements-triton.txt) so that vLLM's CPU build in this
process never sees it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from helpers import run_in_triton_interpreter

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "triton_kernels" / "check_exphuf_encoder.py"

CASES = [
    "BF16-64x3x256",
    "BF16-33x2x100",
    "BF16-1000",
    "F16-100x4x64",
    "F32-40x50",
    "BF16-2x3000",
    "short",
    "one-symbol",
    "incompressible",
    "special-values",
    "tied-mode",
    "long-codes-f32",
    "batch",
    "real",
    "code-tables",
    "compiles-for-sm90",
]


def run_check(*args: str) -> subprocess.CompletedProcess:
    return run_in_triton_interpreter(SCRIPT, *args)


@pytest.fixture(scope="module")
def checked() -> subprocess.CompletedProcess:
    """Every case, in one run of the script."""
    return run_check("all")


def test_the_script_runs_the_cases_tested_here(checked):
    assert checked.returncode in (0, 1), checked.stdout + checked.stderr
    names = [
        line.split()[1].rstrip(":") for line in checked.stdout.splitlines() if line.split()[:1] in (["ok"], ["FAIL"])
    ]
    assert list(dict.fromkeys(names)) == CASES, checked.stdout + checked.stderr


@pytest.mark.parametrize("case", CASES)
def test_the_triton_encoder_equals_the_rust_encoder(checked, case):
    lines = [line for line in checked.stdout.splitlines() if line.split()[1:2] in ([case], [f"{case}:"])]
    assert lines and all(line.startswith("ok ") for line in lines), checked.stdout + checked.stderr
