"""Mooncake's own log into files, not onto the process's stderr.

Mooncake's C++ client logs through glog, to stderr, about 17 lines each time a process sets it
up (and a line per failed put at run time). ``GLOG_minloglevel`` and the other ``GLOG_*``
variables have no effect on it: Mooncake sets glog's level itself (``MC_LOG_LEVEL``). What it
does honour is ``MC_LOG_DIR``: it then starts glog's files in that directory
(``mooncake-transfer-engine.HOST.USER.log.SEVERITY.DATE-TIME.PID``, the INFO file holding every
line, ``mooncake-transfer-engine.INFO`` a link to the latest process's), but glog still copies
each ERROR line to stderr. That copy is glog's ``FLAGS_stderrthreshold``, which no variable
sets here; it is set in the loaded glog library itself (``quiet_stderr``). Where that library or
its flag cannot be found, the client's set-up (the ~17 lines) runs with fd 2 redirected into a
file of the directory (``setup_output``).

``LAYERTAP_MOONCAKE_LOG`` chooses: unset, the files go to ``default_dir()``; a directory, they go
there; ``stderr``, Mooncake logs as it does by itself. Unset, a ``MC_LOG_DIR`` the user set is
used. ``MC_LOG_DIR`` is set only while the client is set up (``into_files``)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
from collections.abc import Iterator

#: The switch: unset (files in ``default_dir()``), a directory, or ``stderr``.
ENV = "LAYERTAP_MOONCAKE_LOG"
#: Mooncake's variable for the directory of its glog files.
MC_LOG_DIR = "MC_LOG_DIR"
#: glog's severities; stderr gets a line at or above ``FLAGS_stderrthreshold``.
_GLOG_FATAL = 3
#: glog's ``FLAGS_stderrthreshold`` (an int32 in namespace ``fLI``), as the library exports it.
_STDERR_THRESHOLD = "_ZN3fLI21FLAGS_stderrthresholdE"


def default_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"layertap-mooncake-log-{os.getuid()}")


def log_dir() -> str | None:
    """Where Mooncake's log goes in this process; None: to stderr (``LAYERTAP_MOONCAKE_LOG=stderr``)."""
    chosen = os.environ.get(ENV, "")
    if chosen == "stderr":
        return None
    return chosen or os.environ.get(MC_LOG_DIR) or default_dir()


#: The directory this process's Mooncake logs into (None: stderr, or no client set up yet).
_dir: str | None = None


def _usable(d: str | None) -> str | None:
    if d is None:
        return None
    try:
        os.makedirs(d, exist_ok=True)
    except OSError:
        return None
    return d if os.access(d, os.W_OK) else None


@contextlib.contextmanager
def into_files() -> Iterator[str | None]:
    """Around ``import mooncake.store`` and the client's set-up, when Mooncake reads its
    environment: ``MC_LOG_DIR`` names the log directory, made if need be (yielded; None when
    Mooncake logs to stderr: asked for, or a directory that cannot be made, a log being no
    reason to fail). The variable is restored after: a ``mooncake_client`` started with it set
    aborts (glog set up twice), and this process may start one."""
    global _dir
    d = _usable(log_dir())
    old = os.environ.get(MC_LOG_DIR)
    if d is not None:
        os.environ[MC_LOG_DIR] = d
        _dir = d
    try:
        yield d
    finally:
        if d is not None:
            if old is None:
                os.environ.pop(MC_LOG_DIR, None)
            else:
                os.environ[MC_LOG_DIR] = old


def _loaded_glog() -> str | None:
    """The path of the glog library that Mooncake's extension loaded (bundled beside it)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libglog" in line}
    except OSError:
        return None
    ours = sorted(p for p in paths if "mooncake" in p and os.path.isfile(p))
    return ours[0] if ours else None


def quiet_stderr() -> bool:
    """After ``import mooncake.store``: glog copies no line to stderr but fatal ones (the
    files keep them all). Whether that could be done."""
    path = _loaded_glog()
    if path is None:
        return False
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # the copy already loaded
        ctypes.c_int32.in_dll(lib, _STDERR_THRESHOLD).value = _GLOG_FATAL
    except (OSError, ValueError):
        return False
    return True


@contextlib.contextmanager
def setup_output(directory: str | None, quiet: bool) -> Iterator[None]:
    """Around the client's set-up: when glog's copy to stderr could not be turned off
    (``quiet`` false), fd 2 goes into ``directory/mooncake-setup.PID.log`` meanwhile, and is
    restored after (whatever else writes to stderr in those milliseconds lands there too)."""
    if directory is None or quiet:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        fd = os.open(
            os.path.join(directory, f"mooncake-setup.{os.getpid()}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND
        )
    except OSError:
        os.close(saved)
        yield
        return
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def where() -> str:
    """Where to read Mooncake's log, for a message."""
    if _dir is None:
        return "Mooncake's log above"
    return f"Mooncake's log in {_dir}/mooncake-transfer-engine.INFO ({ENV}=stderr shows it)"


__all__ = ["ENV", "default_dir", "into_files", "log_dir", "quiet_stderr", "setup_output", "where"]
