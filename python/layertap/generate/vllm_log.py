"""Where vLLM's log goes during ``layertap generate`` (docs/GENERATE.md, "What is shown").

vLLM logs some 30 lines while its engine starts (on a CPU: no Triton, no tcmalloc, NUMA binding,
experimental APIs...), into the line the progress bar is drawn on. By default the command sends
them to ``vllm.log`` in the directory the engine writes into, and only vLLM's errors to stderr;
``--verbose`` leaves them on stderr at vLLM's own level. A user who set vLLM's logging variables
gets what they set.

vLLM configures logging in every process it starts (engine core, workers) from
``VLLM_LOGGING_CONFIG_PATH``, a ``logging.config.dictConfig`` file: ours names ``RunLogHandler``.
The checks import vLLM before the output directory exists (bad input must leave nothing behind),
so the handler keeps what is logged until ``start`` names the directory; the processes that vLLM
starts afterwards find the file in ``PATH_ENV``.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections import deque

LOG_NAME = "vllm.log"
#: The log file of this run, for the processes vLLM starts (they inherit the environment).
PATH_ENV = "LAYERTAP_VLLM_LOG"
CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_logging.json")
#: Lines kept while no file is known: what vLLM logs during the checks is a few dozen.
PENDING_LINES = 10_000
#: Variables with which a user chooses vLLM's logging themselves.
_USER_SETTINGS = ("VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM")


def configure(verbose: bool) -> None:
    """Sets vLLM's logging for this command, before vLLM is imported: into the run's log file,
    unless ``verbose`` or the user configured it. Either way its lines never go to stdout,
    which holds the summary (vLLM logs to stdout by default)."""
    user = any(v in os.environ for v in _USER_SETTINGS) or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0"
    if verbose or user:
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        return
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = CONFIG
    # torch's C++ warnings (NUMA binding on a CPU) bypass Python's logging: they cannot go to the
    # file, so only errors are shown.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # torch warns once per process, at import, that it has no Triton (CPU builds); this process
    # may import torch before vLLM does, so before the file's configuration applies.
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)


def in_use() -> bool:
    """Whether vLLM logs into the run's file (the command set it up)."""
    return os.environ.get("VLLM_LOGGING_CONFIG_PATH") == CONFIG


def localize() -> None:
    """In a process on another machine (a Ray task): our configuration file where this machine's
    layertap has it, which may be another path than on the machine that started the run."""
    given = os.environ.get("VLLM_LOGGING_CONFIG_PATH", "")
    if given != CONFIG and given.endswith(os.path.join("layertap", "generate", "vllm_logging.json")):
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = CONFIG


def start(directory: str) -> str | None:
    """vLLM's log of this process, and of the processes it starts from now on, goes to
    ``directory/vllm.log`` (appended to: a rerun's log follows the earlier runs'). Returns the
    file, or None when vLLM logs elsewhere."""
    if not in_use():
        return None
    path = os.path.join(directory, LOG_NAME)
    _LOG.open(path)
    os.environ[PATH_ENV] = path
    return path


def log_file(directory: str) -> str | None:
    """The log file of a run writing into ``directory``, if there is one."""
    path = os.path.join(directory, LOG_NAME)
    return path if in_use() and os.path.exists(path) else None


class _RunLog:
    """The file this process's ``RunLogHandler`` s write to. vLLM builds new handlers each time
    it configures logging (several times per process), so the file and the lines waiting for it
    live here, once per process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._file = None
        self._pending: deque[str] = deque(maxlen=PENDING_LINES)
        atexit.register(self.close)

    def open(self, path: str) -> None:
        with self._lock:
            if self._file is not None:
                if self._file.name == path:
                    return
                self._file.close()
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the process's life
            self._file.writelines(self._pending)
            self._file.flush()
            self._pending.clear()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def write(self, text: str) -> None:
        if self._file is None and os.environ.get(PATH_ENV):  # a process vLLM started for the run
            self.open(os.environ[PATH_ENV])
        with self._lock:
            if self._file is None:
                self._pending.append(text)
                return
            self._file.write(text)
            self._file.flush()  # each line as it comes: a process that dies loses nothing


_LOG = _RunLog()


class RunLogHandler(logging.Handler):
    """Writes records into the run's log file (see ``start``); built by vLLM from
    ``vllm_logging.json``. The processes that use it also log Python's warnings there (the
    FutureWarnings vLLM's imports raise), so they stay off the progress bar too."""

    def __init__(self) -> None:
        super().__init__()
        logging.captureWarnings(True)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            _LOG.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


__all__ = ["CONFIG", "LOG_NAME", "PATH_ENV", "RunLogHandler", "configure", "in_use", "localize", "log_file", "start"]
