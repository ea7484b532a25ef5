"""A writer process killed with SIGKILL in the middle of writing loses nothing it reported done.

A child process writes records as fast as it can (several shards, batches in flight) and prints
the key of every record its writer reports done (``poll()``), flushing stdout at once. The test
kills it with SIGKILL at a moment chosen from the stream of completions, recovers every shard it
left open, and checks that every record the child heard about is present, verifies, and holds
exactly the data written; records it did not hear about may be present too, intact, or absent.
"""

from __future__ import annotations

import functools
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import layertap
from helpers import PYTHON_SRC, shard_files, takes_o_direct

CHILD = r"""
import sys, torch
from layertap import ShardWriter
out, io, o_direct = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
g = torch.Generator().manual_seed(0)
base = torch.randn(1024 + 64, 3, 256, generator=g).to(torch.bfloat16)

def tensors(i):
    # Views of one tensor (no time spent making data), so the child spends its time writing
    # and the kill lands in the middle of writes.
    n = 256 + (i * 37) % 768
    return {"hidden_states": base[i % 64 : i % 64 + n], "token_ids": torch.arange(i, i + n)}

opts = dict(codec="none", shard_size=48 << 20, durability="none", batch_bytes=8 << 20,
            writer_id="victim")
# "uring-direct": io_uring with O_DIRECT (staged blocks, the partial last one buffered)
opts["io"], _, mode = io.partition("-")
opts["direct"] = mode == "direct"
w = ShardWriter(out, **opts)
assert w.stats["direct"] == (opts["direct"] and o_direct), w.stats
i = 0
while True:
    w.submit(f"rec-{i:06d}", tensors(i))
    i += 1
    for c in w.poll():
        sys.stdout.write(c.key + "\n")
    sys.stdout.flush()
"""


@functools.cache
def _base() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(1024 + 64, 3, 256, generator=g).to(torch.bfloat16)


def _expected(i: int) -> dict:
    base = _base()
    n = 256 + (i * 37) % 768
    return {"hidden_states": base[i % 64 : i % 64 + n], "token_ids": torch.arange(i, i + n)}


def _run_and_kill(out: Path, io: str, kill_after: int) -> list[str]:
    """Starts the writer child, reads the keys it reports done, kills it after ``kill_after``."""
    env = dict(os.environ, PYTHONPATH=str(PYTHON_SRC))
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(out), io, str(int(takes_o_direct(out)))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    done: list[str] = []
    buf = b""
    try:
        while len(done) < kill_after:
            # A stall, not a slow run: 120 s without a completion (each takes milliseconds).
            ready, _, _ = select.select([proc.stdout], [], [], 120)
            assert ready, f"the writer child reported no record done for 120 s (after {len(done)})"
            chunk = os.read(proc.stdout.fileno(), 65536)
            assert chunk, f"the writer child exited: {proc.stderr.read().decode()}"
            buf += chunk
            *lines, buf = buf.split(b"\n")
            done += [line.decode() for line in lines]
        proc.send_signal(signal.SIGKILL)  # while it is submitting, encoding and writing
    finally:
        proc.kill()
        proc.wait(timeout=30)
    # Completions printed before the kill but not yet read are done too.
    rest = proc.stdout.read()
    done += [line.decode() for line in (buf + rest).split(b"\n")[:-1]]
    proc.stdout.close()
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    return done


def _recover_once_unlocked(path: str, timeout: float = 30) -> layertap.RecoverReport:
    """Recovers a shard of the killed child. The kernel releases the child's lock when the last
    reference to its file goes; an io_uring ring of the child may hold one for a moment after
    the child is reaped (the ring is torn down asynchronously), so a refusal is retried."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return layertap.recover(path)
        except layertap.ShardLockedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.parametrize(
    "io,kill_after",
    [("uring", 40), ("uring", 157), ("pwrite", 90), ("uring-direct", 70), ("pwrite-direct", 133)],
)
def test_records_reported_done_survive_sigkill(tmp_path, io, kill_after):
    done = _run_and_kill(tmp_path, io, kill_after)
    assert len(done) >= kill_after
    shards = shard_files(tmp_path)
    if kill_after > 100:
        assert len(shards) >= 2, "the child should have rotated shards before the kill"
    for path in shards:
        report = _recover_once_unlocked(path)
        assert report.problems == [], report.problems
    with layertap.open(tmp_path) as ds:
        report = ds.verify()
        assert report.ok, report.problems
        present = set(ds.keys())
        missing = [k for k in done if k not in present]
        assert not missing, f"{len(missing)} records reported done are gone, e.g. {missing[:3]}"
        # Every record present, reported or not, holds exactly what was written.
        for rec in ds:
            want = _expected(int(rec.key.split("-")[1]))
            assert torch.equal(rec.hidden_states, want["hidden_states"]), rec.key
            assert torch.equal(rec.token_ids, want["token_ids"]), rec.key
        keys = ds.keys()
        assert keys == sorted(keys), "records are stored in submission order"
