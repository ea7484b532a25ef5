"""Where vLLM's log goes during ``layertap generate`` (docs/GENERATE.md, "What is shown").

vLLM logs some 30 lines while its engine starts, into the line the progress bar is drawn on. By
default they go to ``vllm.log`` in the directory the engine writes into, and only vLLM's errors
to stderr; ``--verbose`` leaves them on stderr; a user who set vLLM's logging variables gets what
they set.

vLLM configures logging in every process it starts from ``VLLM_LOGGING_CONFIG_PATH``, a
``dictConfig`` file naming ``RunLogHandler``. The checks import vLLM before the output directory
exists (bad input must leave nothing behind), so the handler keeps what is logged until ``start``
names the directory; the processes vLLM starts afterwards find the file in ``PATH_ENV``.

When the engine does not start, ``root_cause`` reads this run's part of the log for vLLM's own
error ("Engine core initialization failed" names none). The stderr of vLLM's processes passes
through ``EngineOutput``, which keeps their tracebacks in the log and, once the run is
interrupted (``silence``), everything they print.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import logging.config
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator

from layertap.generate.errors import first_line

LOG_NAME = "vllm.log"
#: The log file of this run, for the processes vLLM starts (they inherit the environment).
PATH_ENV = "LAYERTAP_VLLM_LOG"
CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_logging.json")
#: Lines kept while no file is known: what vLLM logs during the checks is a few dozen.
PENDING_LINES = 10_000
#: Variables with which a user chooses vLLM's logging themselves.
_USER_SETTINGS = ("VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM")


def configure(verbose: bool) -> None:
    """Sets vLLM's logging before vLLM is imported. Never to stdout, which holds the summary
    (vLLM logs to stdout by default)."""
    user = any(v in os.environ for v in _USER_SETTINGS) or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0"
    if verbose or user:
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        return
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = CONFIG
    if "vllm.logger" in sys.modules:
        # vLLM reads the variable when it configures its logging, and not again while its
        # configuration is unchanged: a process where vLLM ran before (the command run from
        # Python, a second run in one process) gets the file's handlers here.
        with open(CONFIG, encoding="utf-8") as f:
            logging.config.dictConfig(json.load(f))
    # torch's C++ warnings (NUMA binding on a CPU) bypass Python's logging: they cannot go to the
    # file, so only errors are shown.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # torch warns once per process, at import, that it has no Triton (CPU builds); this process
    # may import torch before vLLM does, so before the file's configuration applies.
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)


def in_use() -> bool:
    return os.environ.get("VLLM_LOGGING_CONFIG_PATH") == CONFIG


def localize() -> None:
    """In a Ray task: our configuration file where this machine's layertap has it."""
    given = os.environ.get("VLLM_LOGGING_CONFIG_PATH", "")
    if given != CONFIG and given.endswith(os.path.join("layertap", "generate", "vllm_logging.json")):
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = CONFIG


def start(directory: str) -> str | None:
    """vLLM's log of this process and those it starts from now on goes to ``directory/vllm.log``
    (appended to: a rerun's log follows the earlier runs'); None when vLLM logs elsewhere."""
    _LOG.new_run()
    if not in_use():
        return None
    path = os.path.join(directory, LOG_NAME)
    _LOG.open(path)
    os.environ[PATH_ENV] = path
    return path


def note(message: str) -> None:
    """A line of layertap's own in the run's log file."""
    if _LOG.path is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S")
        _LOG.write(f"MainProcess pid={os.getpid()} INFO {when} [layertap.generate] {message}\n")


def current() -> str | None:
    return _LOG.path


def log_file(directory: str) -> str | None:
    path = os.path.join(directory, LOG_NAME)
    return path if in_use() and os.path.exists(path) else None


class _RunLog:
    """The file this process's ``RunLogHandler`` s write to: vLLM builds new handlers each time
    it configures logging (several times per process), so the file lives here, once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._file = None
        self._pending: deque[str] = deque(maxlen=PENDING_LINES)
        self._full = False
        """A write into the file failed (a full disk): lines are dropped from then on."""
        self.path: str | None = None
        self.run_offset = 0
        """Where this run's lines begin in the file (a rerun appends to the earlier runs')."""
        self.quiet = False
        """Set by ``silence``."""
        atexit.register(self.close)

    def new_run(self) -> None:
        """A run begins (perhaps after an interrupted one, or one that filled its disk)."""
        with self._lock:
            self._full = False
            self.quiet = False

    def open(self, path: str) -> None:
        with self._lock:
            if self._file is not None:
                if self._file.name == path:
                    return
                with contextlib.suppress(OSError):  # what an earlier run's full disk did not take
                    self._file.close()
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the process's life
            self.path, self.run_offset = path, self._file.tell()
            self._file.writelines(self._pending)
            self._file.flush()
            self._pending.clear()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                with contextlib.suppress(OSError):  # what a full disk did not take (see ``write``)
                    self._file.close()
                self._file = None

    def write(self, text: str) -> None:
        if self._file is None and os.environ.get(PATH_ENV):  # a process vLLM started for the run
            self.open(os.environ[PATH_ENV])
        with self._lock:
            if self._file is None:
                self._pending.append(text)
                return
            if self._full:
                return
            try:
                self._file.write(text)
                self._file.flush()  # each line as it comes: a process that dies loses nothing
            except OSError:
                # The run's directory is on a full disk (the writer says so, in one line): the
                # log is what gives way, without a traceback per line on stderr.
                self._full = True


_LOG = _RunLog()


def silence() -> None:
    """From now on vLLM's processes say nothing on stderr, only into the log file: the run was
    interrupted, and their errors as they stop are its consequences."""
    _LOG.quiet = True


#: The error file the run's writer leaves if it fails (``vllm/online.py``), for the processes vLLM
#: starts (``watch_writer``).
WRITER_ERROR_ENV = "LAYERTAP_WRITER_ERROR_FILE"


def watch_writer(error_file: str) -> None:
    """vLLM's errors stay off stderr (here and in the processes vLLM starts) once ``error_file``
    exists: the writer failed (a full disk), which the command says in one line, and what vLLM
    logs then follows from it."""
    os.environ[WRITER_ERROR_ENV] = error_file


class ErrorsToStderr(logging.StreamHandler):
    """vLLM's errors on stderr, one line each (tracebacks go to the log file only)."""

    def emit(self, record: logging.LogRecord) -> None:
        writer_error = os.environ.get(WRITER_ERROR_ENV)
        if not _LOG.quiet and not (writer_error and os.path.exists(writer_error)):
            super().emit(record)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None}))
        return text.rstrip("\n")


def write_traceback() -> bool:
    """The exception being handled, with its traceback, into the run's log file (False: none)."""
    if _LOG.path is None:
        return False
    _LOG.write("".join(traceback.format_exc()))
    return True


class RunLogHandler(logging.Handler):
    """Records into the run's log file; built by vLLM from ``vllm_logging.json``. Python's
    warnings go there too (vLLM's imports raise FutureWarnings): off the progress bar."""

    def __init__(self) -> None:
        super().__init__()
        logging.captureWarnings(True)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            _LOG.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


#: A line of the log file (``vllm_logging.json``'s format): process, pid, level, time, logger.
LOG_LINE = re.compile(r"^(?P<process>\S+) pid=\d+ (?P<level>[A-Z]+) \S+ \S+ \[[^\]]*\] (?P<message>.*)$")
#: The engine core's line for a worker process that ended, by a signal when the code is negative.
_WORKER_DIED = re.compile(r"Worker proc (?P<worker>\S+) died unexpectedly \(exit code: (?P<code>-?\d+)\)")
#: vLLM's messages that only pass on an error raised elsewhere, or say that a process stops
#: because of one: the root cause is another line.
_CONSEQUENCES = (
    "Engine core initialization failed",
    "EngineCore failed to start",
    "WorkerProc hit an exception",
    "WorkerProc failed to start",
    "Worker failed with error",
    "RuntimeError: cancelled",
)
#: Lines that begin a traceback, or the next one of a chain (a process's name: multiprocessing's
#: line before the traceback of a process that failed).
_TRACEBACK_START = re.compile(
    r"^(Traceback \(most recent call last\):|Process \S+:$|The above exception |During handling of the above)"
)
#: A worker's error as the engine core passes it on (``RuntimeError: Worker failed with error 'X', ...``).
_PASSED_ON = re.compile(r"Worker failed with error '(?P<error>.*)', please check")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def root_cause(text: str) -> str | None:
    """vLLM's own error in a run's log: the first exception of a traceback that wraps none, else
    a worker killed by a signal (SIGKILL: the out-of-memory killer, as a rule), else the first
    error line that is not a consequence."""
    in_traceback = False
    first_error = passed_on = None
    for line in text.splitlines():
        if line.startswith("Traceback (most recent call last):"):
            in_traceback = True
            continue
        if in_traceback:
            if not line.strip() or line[0].isspace():
                continue
            in_traceback = False  # the exception's own line ends the traceback
            m = _PASSED_ON.search(line)
            passed_on = passed_on or (m and m["error"])
            if not any(c in line for c in _CONSEQUENCES):
                return line.strip()
            continue
        m = LOG_LINE.match(line)
        if m is None or m["level"] not in ("ERROR", "CRITICAL"):
            continue
        died = _WORKER_DIED.search(m["message"])
        if died is not None:
            code = int(died["code"])
            if code < 0:
                oom = ": most likely the kernel's out-of-memory killer (see dmesg)" if -code == signal.SIGKILL else ""
                return f"vLLM's worker process {died['worker']} was killed by {_signal_name(-code)}{oom}"
            continue  # it ended after an error of its own
        if first_error is None and not any(c in m["message"] for c in _CONSEQUENCES):
            first_error = m["message"].strip()
    return first_error or passed_on


def this_run() -> str:
    if _LOG.path is None:
        return ""
    try:
        with open(_LOG.path, encoding="utf-8", errors="replace") as f:
            f.seek(_LOG.run_offset)
            return f.read()
    except OSError:
        return ""


def start_error(e: BaseException) -> str:
    """One line naming why the engine did not start: what ``LLM(...)`` raised, or, when that only
    reports that a process of vLLM's failed ("See root cause above"), the error in the log."""
    chain = []
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for exc in reversed(chain):  # the innermost first: the others wrap it
        line = _one_line(exc)
        if not any(c in line for c in _CONSEQUENCES):
            return line
    return root_cause(this_run()) or _one_line(chain[0])


def _one_line(e: BaseException) -> str:
    validation = _validation_errors(e)
    return f"{type(e).__name__}: {validation}" if validation else first_line(e)


def _validation_errors(e: BaseException) -> str | None:
    """A pydantic ``ValidationError`` as one line ("ModelConfig: User-specified max_model_len
    ..."): vLLM's configurations are pydantic dataclasses, whose error's first line is
    only "1 validation error for ModelConfig". Duck-typed: pydantic is vLLM's."""
    errors, title = getattr(e, "errors", None), getattr(e, "title", None)
    if not callable(errors) or not isinstance(title, str):
        return None
    try:
        found = errors(include_url=False)
    except Exception:  # not pydantic's after all
        return None
    parts = []
    for error in found:
        message = str(error.get("msg", "")).strip().splitlines() or [""]
        message = message[0].removeprefix("Value error, ")
        where = ".".join(str(part) for part in error.get("loc", ()))
        parts.append(f"{where}: {message}" if where else message)
    return f"{title}: {'; '.join(parts)}" if parts else None


#: What ``EngineOutput.close`` writes after the output of the stopped processes.
_DRAINED = b"\0layertap: engine output drained\n"


class EngineOutput:
    """The stderr of the processes vLLM starts, which write to it directly (tracebacks, signals,
    warnings): a pipe whose lines go on to stderr, but tracebacks, and after ``silence``
    everything, which go into the log file."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        self._stderr = os.dup(2)
        self._thread = threading.Thread(target=self._relay, name="layertap-engine-output", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def spawning(self) -> Iterator[None]:
        """fd 2 is the pipe while vLLM starts its processes (``LLM(...)``), which inherit it."""
        sys.stderr.flush()
        os.dup2(self._write, 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(self._stderr, 2)

    def close(self, timeout: float) -> None:
        """Once vLLM's processes are stopped: waits up to ``timeout`` s for the relay to pass on
        what they printed. Not until the pipe ends: multiprocessing's resource tracker holds it
        as long as this process lives. A marker after their output ends the relay, which closes
        its descriptors, so a run leaves none behind (``layertap.generate`` called in a loop)."""
        try:
            with contextlib.suppress(OSError):  # the relay failed and closed the pipe
                os.write(self._write, _DRAINED)
            self._thread.join(timeout)
        finally:
            os.close(self._write)

    def _relay(self) -> None:
        try:
            with open(self._read, "rb", buffering=0) as pipe:
                in_traceback = False
                pending = b""
                while chunk := pipe.read(65536):
                    *lines, pending = (pending + chunk).split(b"\n")
                    for raw in lines:
                        marked = raw.endswith(_DRAINED[:-1])
                        raw = raw.removesuffix(_DRAINED[:-1])  # after a line left unfinished, if any
                        if raw:
                            in_traceback = self._line(raw.decode(errors="replace"), in_traceback)
                        if marked:
                            return
                if pending:
                    self._line(pending.decode(errors="replace"), in_traceback)
        finally:
            os.close(self._stderr)

    def _line(self, line: str, in_traceback: bool) -> bool:
        """Passes ``line`` on; returns whether a traceback goes on after it."""
        if not line.strip():  # kept in the log, where it may separate a chain's tracebacks
            _LOG.write("\n")
            return in_traceback
        if _TRACEBACK_START.match(line) or (in_traceback and line[0].isspace()):
            _LOG.write(line + "\n")
            return True
        if in_traceback:  # the exception's own line
            _LOG.write(line + "\n")
            return False
        if _LOG.quiet:
            if not LOG_LINE.match(line):
                _LOG.write(line + "\n")
        else:
            os.write(self._stderr, (line + "\n").encode())
        return False
