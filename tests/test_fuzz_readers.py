"""A short run of the readers' fuzzer (tests/fuzz/fuzz_readers.py, atheris over tests/vectors):
the pure-Python reader and the Rust reader through the bindings, each on its own and against
each other, never fail, hang or grow past their memory bound. Long runs: benches/fuzz/README.md."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO, subprocess_env

HARNESS = REPO / "tests" / "fuzz" / "fuzz_readers.py"


@pytest.mark.parametrize("reader", ["python", "rust", "both"])
def test_a_short_fuzz_run_finds_nothing(tmp_path, reader):
    proc = subprocess.run(
        [sys.executable, str(HARNESS), "--reader", reader, "--seconds", "8", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=subprocess_env(),
    )
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    assert "stat::number_of_executed_units" in proc.stderr, tail
    runs = int(proc.stderr.split("stat::number_of_executed_units:")[1].split()[0])
    assert runs >= 50, tail
    assert list(tmp_path.iterdir()) == [], "failing inputs were written"
