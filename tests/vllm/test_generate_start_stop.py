"""``layertap generate``'s engine starting and stopping, as the command shows them (issue 34):
an engine that does not start is one line naming vLLM's own error (not its "Engine core
initialization failed"), and the log; the documented command, with no engine arguments, works on
a CPU (the run sizes the KV cache from the memory there is, and says so); Ctrl-C stops the run
with the interrupted line and the summary, none of the engine's tracebacks, exit status 130, and
the same command resumes; SIGTERM does as Ctrl-C does (with --verbose: vLLM's log on stderr)."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import sys
import warnings

import pytest
from generate_support import (
    Child,
    RowsHeldBack,
    engine_processes_in_default_layout,
    generate_cmd,
    id_rows,
    wait_for_records,
    write_jsonl,
)

import layertap
from layertap.cli import main as layertap_cli
from vllm_support import VLLM_WARNINGS

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

#: gc's own unfreeze, which the fixtures replace while they run (vllm_support.collections_of_young_objects).
_unfreeze = gc.unfreeze


def documented(model: str, data: str, out: str, *extra: str) -> list[str]:
    """``layertap generate MODEL --data DATA --out DIR``, as README and GENERATE.md show it."""
    return [sys.executable, "-m", "layertap", "generate", model, "--data", data, "--out", out, *extra]


def not_progress(lines: list[str]) -> list[str]:
    return [line for line in lines if not line.startswith("generate: ")]


def test_an_engine_that_does_not_start_is_one_line_naming_vllms_error(
    tiny_model, tmp_path, capfd, in_process_command, monkeypatch
):
    """A KV cache larger than the machine: vLLM's worker refuses it in its memory check, the
    engine core reports only that it failed; the line printed names the check's error and the log,
    and none of the processes' tracebacks reach stderr (they are in the log). The command runs in
    this process (a child's import of vLLM saved: 10 s of CPU), its engine in vLLM's default
    layout, the engine core and its worker each in a process of its own."""
    engine_processes_in_default_layout(monkeypatch)
    data = write_jsonl(tmp_path / "ids.jsonl", id_rows(4, 3, 8))
    out = tmp_path / "out"
    capfd.readouterr()
    cmd = generate_cmd(tiny_model, data, str(out), engine_args={"kv_cache_memory_bytes": 1 << 50})
    # vLLM's client leaves its ZMQ context open when its engine does not start (a command's
    # process exits then): its warning is ignored where it is collected, in the run or here
    # (among objects the fixtures keep frozen), rather than in whichever test collects it later.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        status = layertap_cli(cmd[3:])  # the arguments after `python -m layertap`
        _unfreeze()
        gc.collect()
        gc.freeze()
    got = capfd.readouterr()  # the engine's processes' stderr is this process's
    assert status == 1, got.err
    line = next(line for line in got.err.splitlines() if line.startswith("layertap generate: "))
    assert line.startswith("layertap generate: vLLM's engine did not start: ValueError: Available memory on node 0 "), (
        got.err
    )
    assert "less than requested memory for kv" in line and f"vLLM log: {out / 'vllm.log'}" in line, line
    assert "Traceback" not in got.err and "Engine core initialization failed" not in got.err, got.err
    log = (out / "vllm.log").read_text()
    assert "Engine core initialization failed" in log and "Traceback" in log  # where they went
    assert got.out == ""


@pytest.mark.timeout(900)
def test_ctrl_c_then_the_documented_command_resumes(tiny_model, tmp_path, capfd, in_process_command):
    """The documented command, no engine arguments (on a CPU, vLLM's own default takes 92% of
    the machine's memory for the KV cache, which fails its check or gets it killed), in vLLM's
    default process layout. SIGINT to its process group (what Ctrl-C in a terminal does) once
    records are being written: exit 130, the interrupted line and the summary, and nothing of
    the engine's processes' stopping on stderr (nor of their start, torch's compilation
    included: the first run is the one that compiles). The same command then finishes the
    dataset, in this process (its engine too): what it does after the interrupt is the run's,
    not the process's, and the test saves a child's three imports of vLLM (its stderr in vLLM's
    default layout is the interrupted run's here and test_generate.py's progress tests')."""
    # Its rows come through a pipe that holds the last one back (RowsHeldBack): the run cannot
    # end before the interrupt, which comes once a record is in a shard. 800 rows took 0.9 s of
    # generation here, and the progress line the test waited for came with half a second left.
    # 600 rows keep the engine at work for most of that second (it takes 512 at once).
    from layertap.generate.holders import flock_holders

    rows = id_rows(600, 100, 200, seed=11)
    data = RowsHeldBack(tmp_path / "ids.jsonl", rows)
    out = tmp_path / "out"
    # The command starts with SIGINT ignored, as a script's background job (`layertap generate
    # ... &`, or `make test &` for this test) does: a child keeps SIG_IGN across exec and Python
    # then installs no KeyboardInterrupt, while vLLM's engine processes set handlers of their own;
    # the engine stopped and the command said "the run failed: EngineDeadError", with a traceback.
    # The command takes SIGINT as Ctrl-C then (cli/generate.py), and from there on its run is the
    # same as from a terminal, where Python's handler is there from the start.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        child = Child(documented(tiny_model, data.path, str(out)), multiprocessing=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        written = wait_for_records(child, out, 600)
        assert written, f"no record written before the run ended:\n{child.stderr[-3000:]}"
        os.killpg(child.proc.pid, signal.SIGINT)
        assert child.finish(timeout=300) == 130, child.stderr
    finally:
        data.release()
    said = not_progress(child.lines)
    assert said == ["layertap generate: interrupted; run the same command again to resume"], child.stderr
    summary = child.stdout.decode()
    assert "rows written this run" in summary and "dataset incomplete: " in summary, summary
    assert re.search(
        r"engine: kv_cache_memory_bytes [\d.]+ MiB \(chosen for a CPU engine: room for about \d+ sequences", summary
    )
    # The engine's processes stop in the log, not on stderr (checked above). Whether they print
    # tracebacks as they go depends on where the interrupt finds them: seen once (make test,
    # 2026-12-06), the engine core took SIGINT in the middle of a step whose worker had stopped,
    # waited, and was killed by vLLM's client after its 60 s shutdown timeout, with no traceback.
    log = (out / "vllm.log").read_text()
    assert "[shutdown] EngineCore: trigger received signal=SIGINT" in log, log[-3000:]
    with layertap.open(str(out)) as ds:  # the engine completed its shards and let go of them
        assert ds.shards and all(s.complete for s in ds.shards), ds.shards
        assert not [s.path for s in ds.shards if flock_holders(s.path)]

    # vLLM's CPU platform turns inductor's dynamic threads on through TORCHINDUCTOR_CPP_DYNAMIC_THREADS,
    # which torch reads once, at import: the interrupted run's worker process compiled with them,
    # an engine in this process (torch imported long before) would compile without, into another
    # folder of vLLM's compile cache (its key hashes inductor's settings), all of it again (17 s
    # here). With the setting vLLM's worker has, the key is the interrupted run's: vLLM's own load
    # of its saved function fails on a CPU ("'function' object has no attribute
    # 'finalize_loading'") and it compiles again, but inductor finds its kernels there (8 s).
    import torch._inductor.config as inductor_config

    capfd.readouterr()
    data.as_file()  # the same rows at the same path, all of them there now
    with inductor_config.patch({"cpp.dynamic_threads": True}):
        status = layertap_cli(documented(tiny_model, data.path, str(out), "--json")[3:])  # after `python -m layertap`
    again = capfd.readouterr()
    assert status == 0, again.err[-3000:]
    final = json.loads(again.out)
    assert final["complete"] and final["rows_done_before"] > 0, final
    assert final["rows_done_before"] + final["rows_written"] == len(rows) and final["duplicate_records"] == 0
    assert final["engine_defaults"]["kv_cache_memory_bytes"] > 0
    print(f"interrupted after {final['rows_done_before']} of {len(rows)} rows")  # shown if a later check fails
    with layertap.open(out) as ds:
        assert sorted(ds.keys(), key=int) == [str(i) for i in range(len(rows))] and ds.verify().ok


@pytest.mark.timeout(600)
def test_sigterm_stops_the_engine_as_ctrl_c_does(tiny_model, tmp_path):
    """SIGTERM to the command alone (``kill PID``, ``timeout``, a job scheduler): it ended the
    command at once (exit 143, no summary), and vLLM's engine processes went on, holding the
    shard they wrote, so that the same command stopped on "a live writer holds this shard". Now
    the run stops its engine as on Ctrl-C: the interrupted line, the summary, exit 143, every
    shard complete and held by no process.

    The same run shows --verbose (test_generate.py's test of it was a child of its own, 15 s of
    CPU): vLLM's log on stderr at its own level, as without layertap, stdout the summary alone
    (--json), and no log file written."""
    from layertap.generate.holders import flock_holders

    data = RowsHeldBack(tmp_path / "ids.jsonl", id_rows(600, 100, 200, seed=12))  # the last row held back
    out = tmp_path / "out"
    child = Child(generate_cmd(tiny_model, data.path, str(out), "--verbose", "--json"), multiprocessing=True)
    try:
        assert wait_for_records(child, out, 300), f"no record written before the run ended:\n{child.stderr[-3000:]}"
        child.proc.send_signal(signal.SIGTERM)  # the command's process only, not its group
        assert child.finish(timeout=300) == 128 + signal.SIGTERM, child.stderr
    finally:
        data.release()
    said = not_progress(child.lines)  # vLLM's log lines, then the command's
    assert said[-1] == "layertap generate: interrupted; run the same command again to resume", child.stderr
    assert "Traceback" not in child.stderr, child.stderr
    summary = json.loads(child.stdout)  # the summary alone on stdout, vLLM's log on stderr
    assert summary["interrupted"] and 0 < summary["rows_written"] < 600, summary
    assert any(re.search(r"\(MainProcess pid=\d+\) INFO ", line) for line in child.lines), child.stderr
    assert not (out / "vllm.log").exists()
    with layertap.open(str(out)) as ds:
        assert ds.shards and all(s.complete for s in ds.shards), ds.shards
        assert not [s.path for s in ds.shards if flock_holders(s.path)]


def test_a_context_no_cpu_cache_can_hold_is_refused_before_the_engine(tiny_model, tmp_path, monkeypatch):
    """On a CPU, without a KV cache size of the user's: a --max-len for which two sequences need
    more than 90% of the memory free is refused, naming --max-len, before any engine starts."""
    import psutil

    from layertap.generate import GenerateError

    # The tiny model's context (4,096 positions) would refuse the --max-len first: vLLM's own
    # switch lifts that limit, as for a model whose context is larger than the memory holds.
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")

    data = write_jsonl(tmp_path / "ids.jsonl", id_rows(2, 3, 8))
    too_long = psutil.virtual_memory().total // 1024  # 1 KiB a token at least: twice that is twice the memory
    with pytest.raises(GenerateError, match=r"KV cache for sequences of [\d,]+ tokens .* pass a smaller --max-len"):
        layertap.generate(tiny_model, data, tmp_path / "out", max_len=too_long, progress="none")
    assert not (tmp_path / "out").exists()


def test_engines_started_on_one_machine_share_its_default_kv_cache(monkeypatch):
    """--data-parallel-size N on a CPU: the orchestrator sizes the KV cache once for engines
    that all start here, so each gets its share of the free memory, not a quarter of all of it
    (N of them would then take N quarters)."""
    from types import SimpleNamespace

    from layertap.generate import engine

    monkeypatch.delenv(engine.KV_CACHE_ENV, raising=False)
    monkeypatch.setattr(engine, "_cpu_available_memory", lambda: 64 << 30)
    # 22,528 bytes a token: 32 sequences of 32,768 tokens want more than a quarter of 64 GiB.
    info = SimpleNamespace(kv_elements_per_token=8192, hidden_size=1024)
    alone, shared = {}, {}
    engine.cpu_kv_cache_default(alone, info, 3, 32768)
    chosen = engine.cpu_kv_cache_default(shared, info, 3, 32768, engines_here=4)
    assert alone["kv_cache_memory_bytes"] == 16 << 30
    assert shared["kv_cache_memory_bytes"] == 4 << 30
    assert "for each of 4 engines" in chosen["reason"]
