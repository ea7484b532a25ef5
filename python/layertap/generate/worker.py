"""One engine of ``layertap generate --data-parallel-size N``, in its own process (started by
``layertap.generate.local``; not a command for people).

Standard input: one JSON line ``{"options", "first_run", "rows", "fd"}`` then ``rows`` row
indices (int64, little-endian): the rows this engine writes. It writes JSON lines ``[kind, value]``
to file descriptor ``fd``: ``["report", totals]`` now and then, and at the end ``["summary", ...]``
or ``["error", [kind, text]]`` (``run.run_engine``'s result). When its standard input closes (the
run that started it died) it kills its process group.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

import numpy as np

from layertap.generate.run import run_engine


def _read_exactly(stream, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise EOFError(f"standard input ended {left} bytes short of the rows")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _watch_parent() -> None:
    """Blocks until standard input closes, then ends this engine and its children: the run
    that started it is gone, and nothing must keep writing into its part. (The descriptor is
    read directly: a thread blocked in ``sys.stdin`` would hold its lock at exit.)"""
    try:
        while os.read(0, 65536):
            pass
    finally:
        os.killpg(os.getpgrp(), signal.SIGKILL)


def main() -> int:
    stdin = sys.stdin.buffer
    spec = json.loads(stdin.readline())
    rows = np.frombuffer(_read_exactly(stdin, 8 * spec["rows"]), dtype="<i8")
    out = os.fdopen(spec["fd"], "w", buffering=1)
    threading.Thread(target=_watch_parent, name="layertap-parent", daemon=True).start()
    # SIGTERM (the run stops its engines) ends this process as Ctrl-C would: the engine shuts down.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    def send(kind: str, value: object) -> None:
        out.write(json.dumps([kind, value]) + "\n")

    kind, value = run_engine(spec["options"], spec["first_run"], rows, lambda totals: send("report", totals))
    send(kind, value)
    return 0 if kind == "summary" else 2 if value[0] == "input" else 1


if __name__ == "__main__":
    sys.exit(main())
