"""``layertap generate`` run in a process that imported vLLM before it (the command from Python,
a second run in one process): vLLM read its logging variables when it configured its logging, so
the command applies its own logging configuration itself and vLLM's lines still go to the run's
``vllm.log``. Found by a suite whose first in-process run came after another test's import of
vLLM: that run's log stayed empty and vLLM's lines went to the root logger. In a fresh
interpreter, with the real vLLM: logging's configuration is global."""

from __future__ import annotations

from test_generate_vllm_log import run_python

CODE = """
import logging
import vllm.logger
from vllm.config.logging import LoggingConfig
vllm.logger.configure_logging(LoggingConfig())  # as an engine of an earlier run left it
from layertap.generate import vllm_log
vllm_log.configure(verbose=False)
path = vllm_log.start(".")
logging.getLogger("vllm.engine").info("a line of the run")
print([type(h).__name__ for h in logging.getLogger("vllm").handlers], logging.getLogger("vllm").propagate)
print(open(path).read(), end="")
"""


def test_a_run_after_vllm_was_imported_logs_into_the_runs_file(tmp_path):
    proc = run_python(CODE, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    handlers, log = proc.stdout.split("\n", 1)
    assert handlers == "['RunLogHandler', 'ErrorsToStderr'] False", proc.stdout
    assert log.startswith("MainProcess pid=") and log.endswith("[vllm.engine:9] a line of the run\n"), log
    assert "a line of the run" not in proc.stderr
