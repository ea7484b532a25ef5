"""Shards that are torn before they hold anything (issue 11, items 2 and 3).

A writer killed between creating a shard file and writing its header used to leave a 0-byte
``.lts`` that ``verify`` called a foreign file and ``recover`` refused. Now the writer (and the
shard files ``layertap mooncake pull`` writes) never show a file under a shard name without its
header (they link it complete), a file that is only the start of a header (from older writers)
is a torn empty shard that ``verify`` reports as recoverable and ``recover`` removes, and a
directory whose ``.lts`` files are all garbage is not a dataset.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import layertap
from helpers import VECTORS, run_cli, subprocess_env
from layertap.errors import FormatError

CHILD = r"""
import sys, numpy as np
from layertap import ShardWriter
out, kind = sys.argv[1], sys.argv[2]

def record(i):
    # About 2.3 KiB a record: every record starts a shard of its own.
    return {"hidden_states": np.full((4, 2, 64), i, dtype=np.float32)}

if kind == "shardfile":
    # The Python shard file that `layertap mooncake pull` writes its shards with.
    from layertap._py.encode import Encoder
    from layertap._py.shardfile import ShardFile
    from layertap._py.write import encode_record
    for i in range(4):
        meta = {"writer_id": "w", "shard_index": i, "created_unix_ms": 0, "writer": "test", "user": {}}
        f = ShardFile(f"{out}/w-{i:06d}.lts", bytes(16), meta, sync_dir=False)
        frame, entry = encode_record(Encoder(0, 1), f"k{i}", record(i), None)
        f.entries.append(entry._replace(frame_offset=f.offset))
        f.write([frame])
        f.finish(sync=False)
        print(f"k{i}", flush=True)
else:
    w = ShardWriter(out, writer_id="w", shard_size=4096, codec="none", durability="none", io="pwrite")
    for i in range(4):
        w.submit(f"k{i}", record(i))
        w.flush()
        print(f"k{i}", flush=True)
    w.close()
"""

#: Syscalls on the second shard's name at whose entry the writer is killed: ``flock`` is the
#: issue's reproduction (the moment an old writer had created the file but not written it).
KILL_AT = ["flock", "linkat,link", "pwrite64,pwritev,write"]


def _strace() -> str:
    path = shutil.which("strace")
    if path is None:
        pytest.fail("strace is needed to kill a writer at a chosen system call (apt-get install strace)")
    return path


@pytest.mark.parametrize("kill_at", KILL_AT)
@pytest.mark.parametrize("kind", ["shardfile", "rust"])
def test_a_writer_killed_while_starting_a_shard_leaves_no_headerless_file(tmp_path, kind, kill_at):
    out = tmp_path / "ds"
    out.mkdir()
    second = out / "w-000001.lts"
    strace = [_strace(), "-f", "-qq", "-o", "/dev/null", "-P", str(second), "-e", f"trace={kill_at}"]
    proc = subprocess.run(
        [*strace, "-e", f"inject={kill_at}:signal=KILL", sys.executable, "-c", CHILD, str(out), kind],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )
    done = proc.stdout.split()
    if kill_at == "linkat,link":
        # Both link the second shard into place: the kill lands there, before it shows.
        assert proc.returncode in (137, -9), (proc.returncode, proc.stderr[-2000:])
        assert done == ["k0"] and not second.exists()
    # Whatever the moment, every .lts file is a shard with its header: none is a foreign file,
    # none a torn empty shard.
    with layertap.open(out) as ds:
        assert ds.unreadable == [] and all(info.meta for info in ds.shards), ds.shards
    for shard in sorted(out.glob("*.lts")):
        assert run_cli("recover", shard).returncode == 0
    verify = run_cli("verify", out)
    assert verify.returncode == 0, verify.stderr
    with layertap.open(out) as ds:
        assert set(done) <= set(ds.keys())
    assert [p.name for p in out.iterdir() if not p.name.endswith(".lts")] == []


@pytest.mark.parametrize("backend", ["rust", "python"])
@pytest.mark.parametrize("size", [0, 20])
def test_a_torn_empty_shard_is_recoverable_and_recover_removes_it(tmp_path, backend, size):
    # What older writers left: a file cut before the end of its header's checksum.
    ds = tmp_path / "ds"
    ds.mkdir()
    shutil.copyfile(VECTORS / "none.lts", ds / "w-000000.lts")
    torn = ds / "w-000001.lts"
    torn.write_bytes((VECTORS / "none.lts").read_bytes()[:size])

    inspect = json.loads(run_cli("inspect", "--json", "--backend", backend, ds).stdout)
    row = inspect["shards"][1]
    assert (row["state"], row["records"], row["torn_tail_bytes"]) == ("open", 0, size)
    assert inspect["unreadable"] == []
    verify = run_cli("verify", "--backend", backend, ds)
    assert verify.returncode == 1
    assert f"torn_tail: {torn} offset 0: " in verify.stderr and "torn empty shard" in verify.stderr
    assert "`layertap recover` removes it" in verify.stderr and "not_a_shard" not in verify.stderr

    recover = run_cli("recover", "--backend", backend, "--json", torn)
    assert recover.returncode == 0, recover.stderr
    [result] = json.loads(recover.stdout)["shards"]
    assert result["removed"] and result["ok"] and result["records"] == 0
    assert not torn.exists()
    assert run_cli("verify", "--backend", backend, ds).returncode == 0
    # A shard of the dataset on its own: the same, and the message says what happened.
    torn.write_bytes(b"")
    text = run_cli("recover", "--backend", backend, torn)
    assert text.returncode == 0 and "removed: a torn empty shard" in text.stdout


@pytest.mark.parametrize("backend", ["rust", "python"])
def test_a_shard_whose_meta_len_was_damaged_is_not_removed(tmp_path, backend):
    """One flipped bit can raise a complete shard's meta_len past the end of a file under 1 MiB,
    which then looks like a header that was never finished; its frames say otherwise. It is not a
    torn empty shard: verify reports it as not a shard and recover leaves it for a person to
    repair (it removed it, and its records, before)."""
    ds = tmp_path / "ds"
    ds.mkdir()
    shutil.copyfile(VECTORS / "none.lts", ds / "w-000000.lts")
    damaged = ds / "w-000001.lts"
    data = bytearray((VECTORS / "none.lts").read_bytes())
    meta_len = int.from_bytes(data[12:16], "little")
    k = len(data).bit_length()  # one bit of meta_len: a header longer than the file, under 1 MiB
    data[12 + k // 8] ^= 1 << (k % 8)
    assert int.from_bytes(data[12:16], "little") == meta_len + 2**k <= 1 << 20
    damaged.write_bytes(bytes(data))
    verify = run_cli("verify", "--backend", backend, ds)
    assert verify.returncode == 1
    assert f"not_a_shard: {damaged}" in verify.stderr and "torn empty shard" not in verify.stderr, verify.stderr
    said = (
        f"its header's metadata length ({meta_len + 2**k} bytes) runs past the end of the file: the header was damaged"
    )
    assert said in verify.stderr, verify.stderr
    recover = run_cli("recover", "--backend", backend, damaged)
    assert recover.returncode == 2 and said in recover.stderr, recover.stdout + recover.stderr
    assert len(recover.stderr.strip().splitlines()) == 1, recover.stderr
    assert damaged.read_bytes() == bytes(data)


@pytest.mark.parametrize("backend", ["rust", "python"])
def test_a_directory_whose_only_lts_file_is_garbage_is_not_a_dataset(tmp_path, backend):
    (tmp_path / "x.lts").write_bytes(b"this is not a shard at all, it is text\n")
    with pytest.raises(FormatError, match="no shards in this directory") as info:
        layertap.open(tmp_path, backend=backend)
    assert str(tmp_path / "x.lts") in str(info.value) and "not a layertap shard" in str(info.value)
    for command in ("inspect", "verify"):
        proc = run_cli(command, "--backend", backend, tmp_path)
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        assert "no shards in this directory" in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    # Beside a shard, the garbage is a problem of the dataset, not the end of it.
    shutil.copyfile(VECTORS / "none.lts", tmp_path / "w-000000.lts")
    assert run_cli("inspect", "--backend", backend, tmp_path).returncode == 0
    verify = run_cli("verify", "--backend", backend, tmp_path)
    assert verify.returncode == 1 and f"not_a_shard: {tmp_path / 'x.lts'}" in verify.stderr
    with layertap.open(tmp_path, backend=backend) as ds:
        assert len(ds) == 3 and [p.kind for p in ds.unreadable] == ["not_a_shard"]


def test_the_writers_name_no_temporary_file_as_a_shard(tmp_path):
    # The fallback names (where O_TMPFILE is refused) start with a dot and do not end in .lts.
    from layertap._py.shardfile import _under_temporary_name

    fd = _under_temporary_name(str(tmp_path), str(tmp_path / "w-000000.lts"), b"header")
    os.close(fd)
    assert os.listdir(tmp_path) == ["w-000000.lts"]
