"""Helpers shared by the Python tests (``from helpers import ...``); fixtures are in conftest.py.

Tests that need the Rust implementation do not skip when it is missing: they fail, saying what
is not built, because a skipped test must never count as a pass.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PYTHON_SRC = REPO / "python"
VECTORS = REPO / "tests" / "vectors"


# ---------------------------------------------------------------------------------------------
# Which implementations are there


def rust_writer_class():
    """``layertap.ShardWriter`` if it is the real Rust writer, else a string saying why not."""
    try:
        from layertap import ShardWriter
    except ImportError as e:
        return f"layertap.ShardWriter cannot be imported: {e}"
    if not hasattr(ShardWriter, "submit"):
        return "layertap.ShardWriter is still a placeholder (the Rust writer binding is not built)"
    return ShardWriter


def rust_reader_class():
    """``layertap._rust_reader.RustShardReader``, else a string saying why not."""
    try:
        from layertap._rust_reader import RustShardReader
    except ImportError as e:
        return f"layertap._rust_reader.RustShardReader cannot be imported (run `make build`): {e}"
    return RustShardReader


def require(impl, what: str):
    """The implementation, or a test failure (never a skip) naming what is missing."""
    if isinstance(impl, str):
        pytest.fail(f"{what} is required by this test but is missing: {impl}", pytrace=False)
    return impl


def writer_class():
    """``layertap.ShardWriter`` (failing the test if the extension is missing)."""
    return require(rust_writer_class(), "the Rust writer (layertap.ShardWriter)")


def reader_class(kind: str):
    """``"python"`` -> PyShardReader, ``"rust"`` -> RustShardReader (failing if missing)."""
    if kind == "python":
        from layertap._py.reader import PyShardReader

        return PyShardReader
    return require(rust_reader_class(), "the Rust reader (layertap._rust_reader.RustShardReader)")


# ---------------------------------------------------------------------------------------------
# Records


def make_tensors(i: int, tokens: int = 3, layers: int = 2, hidden: int = 8, dtype=torch.bfloat16) -> dict:
    """A connector-like record: ``hidden_states [tokens, layers, hidden]`` and ``token_ids``,
    with values that depend on ``i``."""
    g = torch.Generator().manual_seed(i)
    return {
        "hidden_states": torch.randn(tokens, layers, hidden, generator=g).to(dtype),
        "token_ids": torch.arange(tokens, dtype=torch.int64) + 1000 * i,
    }


def write_records(path, n: int, writer_id: str = "w", prefix: str = "k", cls=None, **options) -> list:
    """Writes ``n`` records ``{prefix}{i}`` and returns the completions."""
    if cls is None:
        cls = writer_class()
    with cls(os.fspath(path), writer_id=writer_id, **options) as w:
        for i in range(n):
            w.submit(f"{prefix}{i}", make_tensors(i), {"layer_ids": "[1, 3]", "i": str(i)})
        w.flush()
        done = w.poll()
    return done + w.poll()


def shard_files(path) -> list[str]:
    return sorted(str(p) for p in Path(path).glob("*.lts"))


def flip_bit(path, offset: int, mask: int = 0x01) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def cut_footer(path, extra: bytes = b"") -> int:
    """Turns a complete shard into an open one: removes index and trailer, appends ``extra``.
    Returns where the records end."""
    from layertap._spec.format import decode_trailer

    with open(path, "r+b") as f:
        f.seek(-32, os.SEEK_END)
        index_offset = decode_trailer(f.read(32)).index_offset
        f.truncate(index_offset)
        f.seek(index_offset)
        f.write(extra)
    return index_offset


def payload_offset(path, record: int) -> tuple[int, int, str]:
    """``(payload offset, stored_len, key)`` of a record of a shard, from the Python reader."""
    from layertap._py.reader import PyShardReader

    with PyShardReader(path, probe_lock=False) as r:
        e = r.raw_entries()[record]
    return e.payload_offset, e.stored_len, e.key


# ---------------------------------------------------------------------------------------------
# Subprocesses


def subprocess_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PYTHON_SRC), env.get("PYTHONPATH")]))
    return env


def run_python(code: str, *args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter with the package importable."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(),
        **kw,
    )


#: Triton, installed outside the virtualenv (requirements-triton.txt) so that vLLM's CPU build in
#: the test process never sees it.
TRITON_SITE = REPO / ".venv" / "triton"


def run_in_triton_interpreter(script: Path, *args: str) -> subprocess.CompletedProcess:
    """Runs a check script of tests/triton_kernels/ in a child process with Triton on its path and
    its interpreter on (``TRITON_INTERPRET=1``: the kernels run on CPU tensors)."""
    assert (TRITON_SITE / "triton").is_dir(), (
        f"{TRITON_SITE} has no triton: install it with `make` (requirements-triton.txt)"
    )
    env = {**os.environ, "PYTHONPATH": f"{TRITON_SITE}{os.pathsep}{REPO / 'python'}", "TRITON_INTERPRET": "1"}
    return subprocess.run(
        [sys.executable, str(script), *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )


def case_lines(checked: subprocess.CompletedProcess) -> dict[str, str]:
    """The first ``ok CASE: ...`` or ``FAIL CASE: ...`` line of each case a check script of
    tests/triton_kernels/ printed, by case, in the order printed."""
    out: dict[str, str] = {}
    for line in checked.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("ok", "FAIL") and rest.split(":")[0]:
            out.setdefault(rest.split(":")[0], line)
    return out


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs ``python -m layertap ARGS``."""
    return subprocess.run(
        [sys.executable, "-m", "layertap", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(),
    )


@contextlib.contextmanager
def mounted(mnt: Path, *mount_args: str, purpose: str):
    """A file system mounted at ``mnt`` (created) while the block runs: ``mount_args`` as
    ``mount`` takes them before the directory. The test fails (never skips) if it cannot be
    mounted; ``purpose`` says what for."""
    mnt.mkdir()
    proc = subprocess.run(["mount", *mount_args, str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"cannot mount {' '.join(mount_args)} for {purpose}: {proc.stderr.strip()}", pytrace=False)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


#: A child script for ``Holder``: holds an exclusive flock on the file ``argv[1]`` (as a writer
#: does on the shard it writes) until told to stop.
HOLD_LOCK = (
    "import fcntl, sys\n"
    "f = open(sys.argv[1], 'rb')\n"
    "fcntl.flock(f, fcntl.LOCK_EX)\n"
    "print('locked', flush=True)\n"
    "sys.stdin.readline()\n"
)


class Holder:
    """A child process that does something (take a lock, keep a writer open), prints one line
    when it is ready, then waits for a line on stdin before finishing."""

    def __init__(self, code: str, *args: str, timeout: float = 60):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=subprocess_env(),
        )
        self.timeout = timeout

    def __enter__(self) -> Holder:
        self.ready = self.proc.stdout.readline().strip()
        return self

    def release(self) -> int:
        """Lets the child go on and waits for it; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
        return self.proc.wait(timeout=self.timeout)

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


def hand_made_shard(path, records: list, meta_key: dict | None = None) -> None:
    """Writes a complete codec-``none`` shard with the format functions alone (no writer, so no
    writer-side checks): ``records`` is ``[(key, [(name, dtype, shape, data bytes)], metadata)]``.
    ``meta_key`` maps a record key to a different ``__metadata__`` key (a corrupt record)."""
    from layertap._spec import blob
    from layertap._spec import format as fmt

    head = fmt.encode_file_header(
        bytes(16), {"writer_id": "hand", "shard_index": 0, "created_unix_ms": 0, "writer": "hand-made", "user": {}}
    )
    body = b""
    entries = []
    for key, tensors, metadata in records:
        meta = {**metadata, "key": (meta_key or {}).get(key, key)}
        payload = blob.build_header([(n, d, s) for n, d, s, _ in tensors], meta) + b"".join(t[3] for t in tensors)
        num_tokens = next((s[0] for n, _, s, _ in tensors if n == "token_ids" and s), 0)
        crc = fmt.crc32c(payload)
        kb = key.encode()
        frame = fmt.encode_frame_header(1, 0, kb, len(payload), len(payload), num_tokens, crc)
        entries.append(fmt.RawEntry(len(head) + len(body), len(payload), len(payload), num_tokens, crc, 0, key))
        body += frame + payload + bytes(fmt.align8(len(payload)) - len(payload))
    with open(path, "wb") as f:
        f.write(head + body + fmt.encode_footer(entries, len(head) + len(body)))


def takes_o_direct(directory) -> bool:
    """Whether the file system of ``directory`` opens files with O_DIRECT (tmpfs does since
    Linux 6.6, ramfs never): what a writer with ``direct=True`` reports in ``stats["direct"]``."""
    probe = os.path.join(os.fspath(directory), ".o_direct_probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT)
    except OSError:
        return False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)
    os.close(fd)
    return True


#: Writer options under which ``busy_record`` keeps the one compression thread busy for seconds:
#: zstd 19 on 16 MiB of random bytes (0.9 s for 4 MiB on this machine). A test that submits it
#: first holds every later record in the writer (records are written in submission order) while
#: it checks what happens meanwhile: longer than the scheduling delays of a loaded CI machine,
#: where a record written in milliseconds left no window (and CI once saw a 4 MiB one written
#: before the test's next call).
BUSY_WRITER = {"codec": "zstd", "level": 19, "threads": 1}


def busy_record(mib: int = 16) -> dict[str, torch.Tensor]:
    """A record's tensors (``mib`` MiB of random bytes) that take ``BUSY_WRITER``'s thread seconds
    to compress (16 MiB: about 4 s on the 2-core machine)."""
    return {"x": torch.frombuffer(bytearray(os.urandom(mib << 20)), dtype=torch.uint8)}


#: The switch interval while ``python_runs_during`` watches: longer than any test, so that a
#: thread waiting for the GIL never makes the caller give it up (CPython asks the holder to
#: drop it once the waiter has waited this long). Only a call that lets the GIL go lets the
#: probe run, however slow or loaded the machine.
NEVER_FORCED = 1000.0


def python_runs_during(fn) -> int:
    """How many times another Python thread ran while ``fn`` ran: 0 exactly when ``fn`` kept
    the GIL throughout, and more than 0 when it let the GIL go long enough for a waiting thread
    to take it.

    A handshake rather than a rate: the probe thread is known to be running (and so waiting for
    the GIL) before ``fn`` is called, it counts only while ``fn`` is running, and it gives the
    GIL back after every loop (``time.sleep(0)``), so that the caller gets it back at once.
    The switch interval is ``NEVER_FORCED`` meanwhile: the probe cannot make this thread drop
    the GIL between bytecodes, so a held call counts 0 however long a loaded machine makes it
    take. (With the default 5 ms a waiting thread takes the GIL after 5 ms of any call, and a
    call that kept it looked as if it had released it.) No clock is read. Whatever ``fn`` needs
    that lets the GIL go by itself (``os.urandom``, torch's tensor methods, a file's I/O) must be
    made before it."""
    count = 0
    loops = 0
    inside = False
    stop = False

    def probe():
        nonlocal count, loops
        while not stop:
            loops += 1
            if inside:
                count += 1
            time.sleep(0)  # gives the GIL back: the caller never waits on this thread

    old = sys.getswitchinterval()
    sys.setswitchinterval(NEVER_FORCED)
    thread = threading.Thread(target=probe, daemon=True)
    try:
        thread.start()
        while loops == 0:  # the handshake: the probe runs, and now wants the GIL back
            time.sleep(0)
        # A collection during fn runs finalizers that let the GIL go (a file's close): not
        # fn's doing. Collected now, none runs until fn has returned.
        collecting = gc.isenabled()
        gc.collect()
        gc.disable()
        inside = True  # from here to the end of fn this thread holds the GIL unless fn lets it go
        try:
            fn()
        finally:
            inside = False
            if collecting:
                gc.enable()
        return count
    finally:
        stop = True
        sys.setswitchinterval(old)
        thread.join()


class HandClock:
    """A clock the test moves (``advance``), for code that takes a clock (``clock=``) or reads
    one the test replaces: intervals and limits are checked at their edges, with no sleep, and
    nothing depends on how long a loaded machine takes between two calls."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@contextlib.contextmanager
def mounted_tmpfs(path, size: str):
    """A tmpfs of ``size`` (``"600k"``, ``"2m"``) mounted on ``path`` (created), unmounted at
    the end: a small disk that fills up (the tests run as root). Skips, saying why, where
    mounting is refused; a skipped test has checked nothing."""
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", os.fspath(path)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"NOT RUN: mounting a {size} tmpfs was refused (root needed): {done.stderr.strip()}")
    try:
        yield os.fspath(path)
    finally:
        subprocess.run(["umount", "-l", os.fspath(path)], check=False)


def free_bytes(path) -> int:
    """What an unprivileged writer can still write on the file system holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
