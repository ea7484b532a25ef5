"""SIGINT to ``layertap generate`` started with SIGINT ignored: a script's background job
(``layertap generate ... &`` in a non-interactive shell, which ignores SIGINT in it) stopped with
``kill -INT -- -PGID``. vLLM's engine core, which sets a handler of its own, took the signal and
stopped; the command, which had inherited SIG_IGN (so Python installed no KeyboardInterrupt),
did not, and ended with "the run failed: EngineDeadError", a traceback and exit status 1. It now
stops as on Ctrl-C: the interrupted line, the summary, exit status 130, the shards complete."""

from __future__ import annotations

import os
import re
import signal

import pytest
from generate_support import Child, generate_cmd, id_rows, write_jsonl

import layertap
from vllm_support import VLLM_WARNINGS

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

PROGRESS = re.compile(r"^generate: ([\d,]+)/([\d,]+) rows")


@pytest.mark.timeout(600)
def test_sigint_to_a_command_started_with_sigint_ignored_stops_it_as_ctrl_c(tiny_model, tmp_path):
    from layertap.generate.holders import flock_holders

    data = write_jsonl(tmp_path / "ids.jsonl", id_rows(800, 100, 200, seed=14))
    out = tmp_path / "out"
    # The child inherits SIG_IGN across exec, as a shell's background job does.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        child = Child(generate_cmd(tiny_model, data, str(out), "--progress-interval", "0.2"), multiprocessing=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    line = child.wait_for(lambda s: (m := PROGRESS.match(s)) and m[1] != "0" and " 0 B written" not in s, 300)
    assert line is not None, f"no record written before the run ended:\n{child.stderr[-3000:]}"
    os.killpg(child.proc.pid, signal.SIGINT)  # kill -INT -- -PGID: the command and its engine's processes
    assert child.finish(timeout=300) == 130, child.stderr
    said = [s for s in child.lines if not s.startswith("generate: ")]
    assert said[-1] == "layertap generate: interrupted; run the same command again to resume", child.stderr
    assert "Traceback" not in child.stderr and "EngineDeadError" not in child.stderr, child.stderr
    assert "rows written this run" in child.stdout.decode(), child.stdout
    with layertap.open(str(out)) as ds:
        assert ds.shards and all(s.complete for s in ds.shards), ds.shards
        assert not [s.path for s in ds.shards if flock_holders(s.path)]
