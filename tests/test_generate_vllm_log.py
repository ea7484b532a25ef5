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
