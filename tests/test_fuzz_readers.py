"""A short run of the readers' fuzzer (tests/fuzz/fuzz_readers.py, atheris over tests/vectors):
the pure-Python reader and the Rust reader through the bindings, each on its own and against
each other, never fail, hang or grow past their memory bound. Long runs: benches/fuzz/README.md."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO, subprocess_env

HARNESS = REPO / "tests" / "fuzz" / "fuzz_readers.py"


#: The same inputs on every machine: libFuzzer's seed and the hash seed fixed, and a count of
#: inputs instead of a time (which would make the count, and so the inputs, depend on the
#: machine's speed). A gate that found a new input by chance on one run in three would stop
#: unrelated work; new inputs come from the long runs of benches/fuzz/README.md, and what they
#: find becomes a vector (tests/vectors) that every reader's tests read.
SEED, RUNS = 1, 2000


@pytest.mark.parametrize("reader", ["python", "rust", "both"])
def test_a_short_fuzz_run_finds_nothing(tmp_path, reader):
    proc = subprocess.run(
        [
            sys.executable,
            str(HARNESS),
            *("--reader", reader, "--seconds", "200", "--out", str(tmp_path)),
            *(f"-seed={SEED}", f"-runs={RUNS}"),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env={**subprocess_env(), "PYTHONHASHSEED": "0"},
    )
    # The uncaught exception (a disagreement, with what each reader found) comes before
    # libFuzzer's last lines of progress and statistics: show the end of both streams.
    tail = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}"
    assert proc.returncode == 0, tail
    assert "stat::number_of_executed_units" in proc.stderr, tail
    runs = int(proc.stderr.split("stat::number_of_executed_units:")[1].split()[0])
    assert runs >= RUNS, tail
    assert list(tmp_path.iterdir()) == [], "failing inputs were written"
