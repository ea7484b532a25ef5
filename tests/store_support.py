"""A real Mooncake Store on loopback for the tests: ``mooncake_master`` and one store node
(``mooncake_client``, which lends the memory records live in), on free ports, stopped by pid."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import layertap
from layertap._spec.format import align8, frame_header_len

BIN = os.path.dirname(sys.executable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Exited(RuntimeError):
    """A process of the store exited while starting: most often a port another process took
    between ``free_port`` and its bind; a start on other ports can succeed."""


@contextlib.contextmanager
def unreachable_port():
    """A loopback port where nothing listens, and nothing can while the block runs: bound and
    not listening, so a connection is refused (a port that ``free_port`` found free could be
    taken by another process before the test connects)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@contextlib.contextmanager
def silent_port():
    """A loopback port that accepts connections and never answers: listening, never accepting
    (the kernel completes each connection into the backlog), as a hung service or another
    protocol's server waiting for more would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, what: str, log: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise _Exited(f"{what} exited with {proc.returncode}; see {log}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout} s; see {log}")


def shard_frames(directory) -> dict[str, bytes]:
    """Every record's frame, as its shard in ``directory`` holds it, by key: what a store's
    copy of the records must equal byte for byte."""
    out = {}
    with layertap.open(str(directory)) as ds:
        for s in ds.backends:
            with open(s.path, "rb") as f:
                data = f.read()
            for e in s.entries:
                n = frame_header_len(len(e.key.encode())) + align8(e.stored_len)
                out[e.key] = data[e.frame_offset : e.frame_offset + n]
    return out


class LoopbackStore:
    """A master and a store node of ``segment`` bytes; ``address(prefix)`` names a dataset.

    ``lease_ttl`` is the master's ``-default_kv_lease_ttl`` (milliseconds or a duration such as
    ``1h``). Mooncake evicts in a thread of its master (every 10 ms: when its use is over its
    high watermark, or after a put found no room), and only objects whose lease has run out: a
    put leaves an object none, a read or an existence check grants it ``lease_ttl``. A store
    where a test counts evictions takes a lease longer than the test, so that what a check
    found there stays there: the eviction thread cannot take it after the check."""

    #: Starts tried when a process exits while starting (``_Exited``).
    STARTS = 3

    def __init__(self, workdir: str, segment: str = "256MB", lease_ttl: str = "50"):
        self.workdir = workdir
        self.lease_ttl = lease_ttl
        for attempt in range(self.STARTS):
            self.procs: list[subprocess.Popen] = []
            self.logs = []
            try:
                self._start(segment)
                return
            except _Exited:
                self.stop()
                if attempt == self.STARTS - 1:
                    raise

    def _start(self, segment: str) -> None:
        self.port = free_port()
        self.metrics_port = free_port()  # the master's HTTP port (metrics): no master's RPC port
        env = dict(os.environ)
        log = os.path.join(self.workdir, "mooncake_master.log")
        self.master = subprocess.Popen(
            [
                os.path.join(BIN, "mooncake_master"),
                "-rpc_address=127.0.0.1",
                f"-rpc_port={self.port}",
                f"-metrics_port={self.metrics_port}",
                f"-default_kv_lease_ttl={self.lease_ttl}",
            ],
            stdout=self._log(log),
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.procs.append(self.master)
        _wait_port(self.port, self.master, "mooncake_master", log)
        _wait_port(self.metrics_port, self.master, "mooncake_master's metrics port", log)
        self.node_port = node_port = free_port()
        log = os.path.join(self.workdir, "mooncake_client.log")
        self.node = subprocess.Popen(
            [
                os.path.join(BIN, "mooncake_client"),
                "-host=127.0.0.1",
                f"-port={node_port}",
                f"-global_segment_size={segment}",
                "-local_buffer_size=16MB",
                f"-master_server_address=127.0.0.1:{self.port}",
                "-metadata_server=P2PHANDSHAKE",
                "-protocol=tcp",
            ],
            stdout=self._log(log),
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.procs.append(self.node)
        _wait_port(node_port, self.node, "mooncake_client", log)
        self._wait_segment()

    def _wait_segment(self) -> None:
        """Until the node's segment is mounted (a put lands somewhere); the probe is then
        removed, so that the store holds, and its master evicts, only what the test puts."""
        from layertap.mooncake.address import parse_address
        from layertap.mooncake.client import connect

        client = connect(parse_address(self.address("probe")))
        deadline = time.monotonic() + 15
        while client.put("probe/ready", b"1") != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the store node's segment was not mounted within 15 s")
            time.sleep(0.1)
        if client.store.remove("probe/ready") != 0:
            raise RuntimeError("the store's probe object could not be removed")

    def metric(self, name: str) -> float:
        """One of the master's metrics (its Prometheus text on the metrics port)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.split(" ", 1)[0] == name:
                return float(line.split()[1])
        raise KeyError(f"mooncake_master has no metric {name}")

    def evicted_keys(self) -> int:
        """How many objects the master has evicted (its count, updated once they are gone)."""
        return int(self.metric("master_evicted_key_count"))

    def wait_evicted(self, at_least: int = 1, timeout: float = 60.0) -> int:
        """Until the master has evicted ``at_least`` objects (its eviction thread runs apart
        from the puts that need it: a handshake on its count, not a wait of a set length);
        returns the count. ``timeout`` only bounds a master that never evicts."""
        deadline = time.monotonic() + timeout
        while (n := self.evicted_keys()) < at_least:
            if time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master evicted {n} objects within {timeout} s, not {at_least}")
            time.sleep(0.01)
        return n

    def address(self, prefix: str, **options: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in {"local": "127.0.0.1", "buffer": "64MiB", **options}.items())
        return f"mooncake://127.0.0.1:{self.port}/{prefix}?{query}"

    def node_address(self, prefix: str, **options: str) -> str:
        """``address(prefix)`` read through the store node (``node=``: shared memory)."""
        query = "&".join(f"{k}={v}" for k, v in {"buffer": "64MiB", **options}.items())
        return f"mooncake://127.0.0.1:{self.port}/{prefix}?{query}&node=127.0.0.1:{self.node_port}"

    def _log(self, path: str):
        f = open(path, "w")  # noqa: SIM115 - open as long as the process writes to it
        self.logs.append(f)
        return f

    def kill_master(self) -> None:
        os.kill(self.master.pid, signal.SIGKILL)
        self.master.wait()

    def kill_node(self) -> None:
        os.kill(self.node.pid, signal.SIGKILL)
        self.node.wait()

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait()
        for f in self.logs:
            f.close()
