"""Resume, exactly once: ``layertap generate`` killed with SIGKILL (its whole process group: the
command and, when it has one, vLLM's engine process; once the command's process alone) at random
moments (drawn from the ``seed`` fixture, which a failure's report shows), again and again, then
run to the end, leaves exactly one verified record per row; a further run has nothing to do."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import sys
import time
from collections.abc import Iterator

import pytest
from generate_support import TINY_ENGINE_ARGS, Child, generate_cmd, id_rows, write_jsonl

import layertap
from layertap.cli import main as layertap_cli
from vllm_support import VLLM_WARNINGS

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

#: Small steps, so that a run takes seconds and a kill lands while records are being written.
SLOW_ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 256, "dtype": "float32"}
ROWS = 300
PROGRESS = re.compile(r"^generate: ([\d,]+)/([\d,]+) rows")


def rows_done(line: str) -> int:
    m = PROGRESS.match(line)
    return int(m.group(1).replace(",", "")) if m else -1


def rows_of_the_run(line: str) -> int:
    """The rows this run has to do, as its progress line says (what earlier runs left)."""
    m = PROGRESS.match(line)
    return int(m.group(2).replace(",", "")) if m else ROWS


@contextlib.contextmanager
def ended_if_this_fails(child: Child) -> Iterator[None]:
    """A step that fails leaves no process of the child's group and no pipe of it open: a pipe
    collected during a later test is a ResourceWarning that fails that test instead."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            os.killpg(child.proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            child.finish(timeout=30)
        raise


def kill_group(child: Child) -> None:
    """SIGKILL to every process of the child's group, then waits until none is left."""
    os.killpg(child.proc.pid, signal.SIGKILL)
    child.finish(timeout=60)
    deadline = time.monotonic() + 30
    while True:
        try:
            os.killpg(child.proc.pid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, "processes of the killed group are still alive"
        time.sleep(0.1)


def kill_command_alone(child: Child, out) -> None:
    """SIGKILL to the command's process only, not its group (the kernel's OOM killer does the
    same). vLLM 0.32's engine processes do not stop with the process that started them and went on
    holding the shard their writer had open; the connector's watch in the engine core
    (``vllm/parent_watch.py``) stops them: they end, every shard is complete and no process holds
    one, so the same command can resume at once."""
    from layertap.generate.holders import flock_holders

    child.proc.kill()
    try:
        assert child.proc.wait(60) == -signal.SIGKILL
        # The engine's processes hold the command's stdout and stderr while they run.
        assert child.outputs_closed(240), "the engine's processes outlived the command"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.proc.pid, signal.SIGKILL)  # what is left of the group, if the watch failed
        child.finish(timeout=60)
    with layertap.open(str(out)) as ds:
        assert ds.shards and all(s.complete for s in ds.shards), ds.shards
        assert not [s.path for s in ds.shards if flock_holders(s.path)]
        assert ds.verify().ok


@pytest.mark.timeout(900)  # three runs killed, each importing vLLM and starting an engine, then one to the end
def test_sigkill_at_random_moments_then_resume(tiny_model, tmp_path, seed, capsys, in_process_command):
    rng = random.Random(seed)  # how many rows before each kill, and how long after
    rows = id_rows(ROWS, 20, 160, seed=5, loss_mask=True)
    data = write_jsonl(tmp_path / "ids.jsonl", rows)
    out = tmp_path / "out"
    cmd = generate_cmd(tiny_model, data, str(out), "--progress-interval", "0.2", "--json", engine_args=SLOW_ENGINE)
    killed_at = []
    t0 = time.monotonic()
    # Three kills: two while records are written (the engine in the command's process, then in
    # its own process, the command alone killed), after a random number of rows; one at a random
    # moment from the start (start-up, recovering the earlier runs' shards, or writing).
    for multiprocessing, after_rows in ((False, True), (True, True), (False, False)):
        child = Child(cmd, multiprocessing=multiprocessing)
        with ended_if_this_fails(child):
            if after_rows:
                want = rng.randint(5, 60)
                # ... (at most half of what the earlier runs left it: a kill can land hundreds of rows
                # after the line that set it off, a loaded machine reading that line late) and records
                # in the shards (the line says how many bytes), not only finished rows.
                line = child.wait_for(
                    lambda s, want=want: rows_done(s) >= min(want, rows_of_the_run(s) // 2) and " 0 B written" not in s,
                    timeout=240,
                )
                if line is None:  # it ended by itself before a line showed half its rows, or it stalled
                    status = child.finish(timeout=60)
                    assert status == 0, f"the run ended or stalled before {want} rows:\n{child.stderr[-3000:]}"
                    killed_at.append(-1)  # not killed: it had ended
                    continue
                time.sleep(rng.uniform(0, 0.5))
            else:
                time.sleep(rng.uniform(0, 15))
            if multiprocessing:
                kill_command_alone(child, out)
            else:
                kill_group(child)
            killed_at.append(max([rows_done(s) for s in child.lines] + [0]))
        # On stderr: stdout is the final run's summary, read below (a failure's report shows both).
        print(f"killed run {len(killed_at)} after {killed_at[-1]} rows, {time.monotonic() - t0:.0f} s", file=sys.stderr)
    # The same command to the end, in this process (its engine too): what it does after the
    # kills is the run's, not the process's, and the test saves a child's import of vLLM.
    status = layertap_cli(cmd[3:])  # the arguments after `python -m layertap`
    captured = capsys.readouterr()
    assert status == 0, captured.err[-3000:]
    summary = json.loads(captured.out)
    context = f"seed {seed}, rows seen before each kill {killed_at}, summary {summary}"
    assert summary["complete"] and summary["rows_missing"] == 0 and summary["duplicate_records"] == 0, context
    # The killed runs left records behind (in shards that this run or an earlier one completed).
    assert summary["rows_done_before"] > 0, context
    if summary["rows_written"]:
        assert 1 <= summary["run"] <= 3, context  # the run number counts the runs that started an engine
    else:
        # The killed runs had written every row (a kill can land after the last record): the final
        # run starts no engine, so it has no run number of its own.
        assert summary["rows_done_before"] == ROWS and summary["run"] is None, context
    assert summary["rows_done_before"] + summary["rows_written"] == ROWS, context
    with layertap.open(out) as ds:
        keys = ds.keys()
        assert sorted(keys, key=int) == [str(i) for i in range(ROWS)], context  # each row exactly once
        assert ds.verify().ok, context
        assert all(s.complete for s in ds.shards), context
        assert {s.meta["writer_id"] for s in ds.shards} <= {f"gen-{i}" for i in range(4)}
        for i, row in enumerate(rows):
            record = ds[str(i)]
            assert record.token_ids.tolist() == row["input_ids"] and record.metadata["row"] == str(i)
            assert record.tensors["loss_mask"].tolist() == row["loss_mask"]
    # Once more: nothing left to do, so no engine starts and nothing is written.
    again = layertap.generate(tiny_model, data, out, progress="none", engine_args={**TINY_ENGINE_ARGS, **SLOW_ENGINE})
    assert again["rows_done_before"] == ROWS and again["rows_written"] == 0 and again["complete"]
    assert again["seconds"]["engine_start"] == 0
    with layertap.open(out) as ds:
        assert len(ds) == ROWS
