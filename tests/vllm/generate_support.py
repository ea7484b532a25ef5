"""Helpers of the ``layertap generate`` tests: prompt datasets built from the tiny model's words,
engine arguments for the tiny model, and running the command in a child process."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

#: LLM arguments for the tiny model on the CPU (generate adds the extraction and the connector).
TINY_ENGINE_ARGS = {"enforce_eager": True, "block_size": 32, "kv_cache_memory_bytes": 64 << 20, "seed": 0}


def words(rng: random.Random, lo: int, hi: int) -> str:
    from tiny_llama import WORDS

    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def chat_rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` chats: a system message now and then, one to three turns, some ending with the user
    (rendered with the generation prompt)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        msgs = [{"role": "system", "content": words(rng, 2, 6)}] if i % 7 == 0 else []
        for turn in range(1 + i % 3):
            msgs.append({"role": "user", "content": words(rng, 1, 20)})
            if turn < i % 3 or i % 5 != 4:
                msgs.append({"role": "assistant", "content": words(rng, 1, 25)})
        rows.append({"messages": msgs})
    return rows


def id_rows(n: int, lo: int, hi: int, seed: int = 0, loss_mask: bool = False) -> list[dict]:
    """``n`` rows of token ids (3.., the tiny vocabulary's words) of ``lo`` to ``hi`` tokens."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ids = [rng.randrange(3, 400) for _ in range(rng.randint(lo, hi))]
        row: dict = {"input_ids": ids}
        if loss_mask:
            row["loss_mask"] = [int(rng.random() < 0.6) for _ in ids]
        rows.append(row)
    return rows


def write_jsonl(path: Path, rows: list) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def generate_cmd(model: str, data: str, out: str, *extra: str, engine_args: dict | None = None) -> list[str]:
    return [
        sys.executable,
        "-m",
        "layertap",
        "generate",
        model,
        "--data",
        data,
        "--out",
        out,
        "--engine-args",
        json.dumps({**TINY_ENGINE_ARGS, **(engine_args or {})}),
        *extra,
    ]


#: tests/, on the test process's path for the tests' imports.
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def engine_processes_in_default_layout(monkeypatch) -> None:
    """For ``layertap generate`` run in the test's process: its engine in vLLM's default layout
    (engine core and worker in processes of their own), which multiprocessing starts with this
    process's path, less tests/: there tests/triton_kernels (checks of our kernels) is the
    package vLLM probes by that name, and they logged "Failed to import Triton kernels" on
    stderr, which a command's own processes do not."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p or ".") != TESTS])


def child_env(multiprocessing: bool) -> dict:
    env = dict(os.environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
    env.pop("VLLM_LOGGING_LEVEL", None)
    return env


class Child:
    """``layertap generate`` in a process group of its own (so that SIGKILL reaches the whole
    tree), its stderr collected line by line (``\\r`` ends a line too, as a progress bar
    redraws) and its stdout kept."""

    def __init__(self, cmd: list[str], multiprocessing: bool, stderr_fd: int | None = None):
        self.proc = subprocess.Popen(
            cmd,
            env=child_env(multiprocessing),
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=stderr_fd if stderr_fd is not None else subprocess.PIPE,
        )
        self.lines: list[str] = []
        self.stdout = b""
        self._cond = threading.Condition()
        self._threads = [threading.Thread(target=self._read_stdout, daemon=True)]
        if stderr_fd is None:
            reader = threading.Thread(target=self._read_lines, args=(self.proc.stderr.fileno(),), daemon=True)
            self._threads.append(reader)
        for t in self._threads:
            t.start()

    def _read_stdout(self) -> None:
        self.stdout = self.proc.stdout.read()

    def _read_lines(self, fd: int) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # a pty's master reads EIO once the child side is closed
                chunk = b""
            if not chunk:
                break
            buf += chunk
            *done, buf = buf.replace(b"\r", b"\n").split(b"\n")
            with self._cond:
                self.lines += [d.decode(errors="replace") for d in done if d]
                self._cond.notify_all()
        with self._cond:
            if buf:
                self.lines.append(buf.decode(errors="replace"))
            self._cond.notify_all()

    def follow(self, fd: int) -> None:
        """Collects lines from ``fd`` (a pty's master side) instead of a pipe."""
        t = threading.Thread(target=self._read_lines, args=(fd,), daemon=True)
        t.start()
        self._threads.append(t)

    def wait_for(self, predicate, timeout: float) -> str | None:
        """The first line for which ``predicate`` holds, waiting up to ``timeout`` s (None if
        the process ended or the time ran out first)."""
        with self._cond:
            seen = 0
            deadline = _now() + timeout
            ended = False
            while True:
                for line in self.lines[seen:]:
                    if predicate(line):
                        return line
                seen = len(self.lines)
                if ended or _now() > deadline:
                    return None
                if self.proc.poll() is not None:
                    # Its last lines may still be in the pipe: read them all, then look once more.
                    self._cond.release()
                    try:
                        for t in self._threads:
                            t.join(10)
                    finally:
                        self._cond.acquire()
                    ended = True
                    continue
                self._cond.wait(0.1)

    def outputs_closed(self, timeout: float) -> bool:
        """Whether every process holding the child's stdout and stderr has ended (its engine's
        processes inherit them) within ``timeout`` s: the readers see their ends."""
        for t in self._threads:
            t.join(timeout)
        return not any(t.is_alive() for t in self._threads)

    def finish(self, timeout: float) -> int:
        rc = self.proc.wait(timeout)
        for t in self._threads:
            t.join(10)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        return rc

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)


def _now() -> float:
    import time

    return time.monotonic()


class RowsHeldBack:
    """A JSONL dataset at ``path`` served through named pipes, its last row held back until
    ``release()``: a run cannot finish before then, however fast its engine (800 rows took 0.9 s
    on this machine's CPU), so an interrupt sent once a handshake shows records written lands in
    a run with work left, by construction rather than by a margin of rows. The command reads the
    file twice (``JsonlRows`` counts the lines, then streams them): the first pipe gives every
    line, the second, which ``path`` names by the time the run opens it again, all but the last.
    ``as_file()`` then puts the same rows in a plain file at ``path``, for the same command to
    resume."""

    def __init__(self, path: Path, rows: list):
        self.path = str(path)
        self.lines = [(r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows]
        self._released = threading.Event()
        os.mkfifo(self.path)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            with open(self.path, "w") as counted:  # returns once the run opened it to count
                # The pipe of the second read replaces this one's name now: the run holds this
                # one open, so its count sees this one's end, never the other's lines.
                second = self.path + ".next"
                os.mkfifo(second)
                os.replace(second, self.path)
                counted.writelines(self.lines)
            with open(self.path, "w") as streamed:
                streamed.writelines(self.lines[:-1])
                streamed.flush()
                self._released.wait()
        except BrokenPipeError:  # the run ended (interrupted, killed) before it read them all
            pass

    def release(self) -> None:
        """Ends the pipe without the held-back row, once the run is over (a run still reading, a
        failed test's, keeps the writer: the test reports what failed, not this)."""
        self._released.set()
        deadline = _now() + 10
        while self._thread.is_alive() and _now() < deadline:
            # A run that ended before it opened a pipe: open and close the other end, so that
            # the writer's open returns and its writes fail (BrokenPipeError).
            with contextlib.suppress(OSError):
                os.close(os.open(self.path, os.O_RDONLY | os.O_NONBLOCK))
            self._thread.join(0.1)

    def as_file(self) -> str:
        """Releases the pipe and leaves the same rows in a plain file at ``path``."""
        self.release()
        assert not self._thread.is_alive(), "the rows' writer did not end"
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(self.lines)
        os.replace(tmp, self.path)
        return self.path


def wait_for_records(child: Child, out: Path, timeout: float, writer_id: str = "gen-0") -> int:
    """Waits until the shards of the run's writer in ``out`` hold a record (counted as the run's
    progress counts them, from the frames in the files); returns how many there are, or 0 if the
    child ended or the time ran out first."""
    from layertap.generate.progress import ShardFollower

    deadline = _now() + timeout
    follower = None
    try:
        while child.proc.poll() is None and _now() < deadline:
            if follower is None and out.is_dir():
                follower = ShardFollower(str(out), writer_id)
            if follower is not None:
                follower.poll()
                if follower.records:
                    return follower.records
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(0.05)  # or until it ends
    finally:
        if follower is not None:
            follower.close()
    return 0
