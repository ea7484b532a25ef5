"""Codec ``none`` records read out of Mooncake Store without a copy: their tensors view the
object where Mooncake received it, in the reader's transfer buffer (``StoreClient.lend``), over
TCP and through the store node (``node=``). The tensors stay the record's (later reads never land
under them), the payload is checked as a copied one is, records held take at most half the
buffer, a process may exit holding them, and a node restarted while they are held is refused
rather than read through. A real store on loopback (store_support.py), whose clients have a
64 MiB transfer buffer (``LoopbackStore.address``)."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

import numpy as np
import pytest
from store_support import BIN, LoopbackStore, _wait_port, shard_frames

import layertap
from layertap._spec.format import frame_header_len
from layertap.errors import CorruptRecordError
from layertap.mooncake.address import parse_address
from layertap.mooncake.client import NodeRestartedError, _Lending, connect
from layertap.mooncake.layout import record_name
from layertap.vllm import fetch
from layertap.vllm.mooncake_forwarder import Forwarder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Floats of a 1 MiB record.
SMALL = 1 << 18
#: Floats of a 12 MiB record: two held take 24 MiB of the 64 MiB buffer, a third would take 36.
LARGE = 3 << 20


def _mapping_of(address: int) -> tuple[int, int]:
    """The mapping of this process (``/proc/self/maps``) that holds ``address``."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return lo, hi
    raise AssertionError(f"no mapping holds {address:#x}")


def _buffer_of(client, name: str) -> tuple[int, int]:
    """The mapping the client's transfer buffer lies in: where its gets land."""
    view = client.get_view(name)
    return _mapping_of(np.frombuffer(view, np.uint8).ctypes.data)


def _rows(i: int, n: int) -> np.ndarray:
    return np.arange(n, dtype=np.float32) + np.float32(i * 1000)


def _put(address: str, spool, writer_id: str, sizes: list[int]) -> dict[str, np.ndarray]:
    want = {}
    with layertap.ShardWriter(spool, writer_id=writer_id, codec="none") as w:
        for i, n in enumerate(sizes):
            want[f"{writer_id}-{i}"] = _rows(i, n)
            w.submit(f"{writer_id}-{i}", {"x": want[f"{writer_id}-{i}"]}, {})
    f = Forwarder(parse_address(address), str(spool), writer_id, {}, keep_shards=True)
    f.close(timeout=60)
    assert f.error is None and f.stats["records_put"] == len(sizes), (f.error, f.stats)
    return want


def _location(tmp_path, address: str, writer_id: str, key: str) -> dict:
    return {"layertap": {"dataset": str(tmp_path), "writer_id": writer_id, "key": key, "store": address}}


def _addresses(store, prefix: str, how: str) -> tuple[str, str]:
    """The dataset's address over TCP (what a response names) and the one to read it through."""
    tcp = store.address(prefix)
    return tcp, tcp if how == "tcp" else store.node_address(prefix)


@pytest.mark.parametrize("how", ["tcp", "node"])
def test_codec_none_tensors_view_the_object_where_mooncake_received_it(store, tmp_path, how):
    """fetch and ``layertap.open`` of a codec none record: its tensor lies in the reader's
    transfer buffer (no copy), holds the record's values, and is the record's own to write:
    the store's object is as it was."""
    tcp, reader = _addresses(store, f"t/lent-{how}", how)
    want = _put(tcp, tmp_path / "spool", "w", [SMALL])
    client = connect(parse_address(reader))
    buffer = _buffer_of(client, record_name(f"t/lent-{how}", "w-0"))
    got = fetch(_location(tmp_path, tcp, "w", "w-0"), timeout=10, store=reader)["x"]
    assert buffer[0] <= got.data_ptr() < buffer[1]
    assert np.array_equal(got.numpy(), want["w-0"])
    with layertap.open(reader, tensors="numpy") as ds:
        held = ds["w-0"]["x"]
    assert buffer[0] <= held.ctypes.data < buffer[1] and held.flags.writeable
    got.fill_(-1.0)
    held[:] = 7
    again = fetch(_location(tmp_path, tcp, "w", "w-0"), timeout=10, store=reader)["x"]
    assert np.array_equal(again.numpy(), want["w-0"]) and (got == -1).all() and (held == 7).all()


@pytest.mark.parametrize("how", ["tcp", "node"])
def test_lent_tensors_keep_their_values_through_many_later_reads(store, tmp_path, how):
    """Three records held while 120 more reads (120 MiB, the 64 MiB buffer's room given back and
    taken again many times) go through the same client: each held tensor still has the values
    written, and still lies in the transfer buffer."""
    tcp, reader = _addresses(store, f"t/kept-{how}", how)
    want = _put(tcp, tmp_path / "spool", "w", [SMALL] * 8)
    client = connect(parse_address(reader))
    buffer = _buffer_of(client, record_name(f"t/kept-{how}", "w-0"))
    held = {k: fetch(_location(tmp_path, tcp, "w", k), timeout=10, store=reader)["x"] for k in ("w-0", "w-1", "w-2")}
    assert all(buffer[0] <= t.data_ptr() < buffer[1] for t in held.values())
    with layertap.open(reader, tensors="numpy") as ds:
        for i in range(120):
            key = f"w-{3 + i % 5}"
            assert np.array_equal(ds[key]["x"], want[key])
    for key, tensor in held.items():
        assert np.array_equal(tensor.numpy(), want[key]), key


@pytest.mark.parametrize("how", ["tcp", "node"])
def test_a_lent_payload_is_checked_as_a_copied_one(store, tmp_path, how):
    """An object whose payload differs from its frame's checksum (one byte of its tensor data
    changed, its header intact) is a corrupt record, not tensors over it."""
    tcp, reader = _addresses(store, f"t/bad-{how}", how)
    spool = tmp_path / "spool"
    _put(store.address(f"t/good-{how}"), spool, "w", [SMALL])
    frame = bytearray(shard_frames(spool)["w-0"])
    frame[frame_header_len(len(b"w-0")) + 4096] ^= 1
    assert connect(parse_address(tcp)).put(record_name(f"t/bad-{how}", "w-0"), bytes(frame)) == 0
    with pytest.raises(CorruptRecordError, match=r"key \"w-0\"\): payload checksum mismatch \(frame says"):
        fetch(_location(tmp_path, tcp, "w", "w-0"), timeout=10, store=reader)


def test_records_held_take_at_most_half_the_transfer_buffer(store, tmp_path):
    """12 MiB records kept through a 64 MiB buffer: the first two view it (24 MiB), the next ones
    are copies, and reads go on (a 20 MiB object still finds room)."""
    tcp = store.address("t/half")
    want = _put(tcp, tmp_path / "spool", "w", [LARGE] * 4)
    client = connect(parse_address(tcp))
    buffer = _buffer_of(client, record_name("t/half", "w-0"))
    with layertap.open(tcp, tensors="numpy") as ds:
        kept = [ds[f"w-{i}"]["x"] for i in range(4)]
        assert [buffer[0] <= x.ctypes.data < buffer[1] for x in kept] == [True, True, False, False]
        assert client.put("t/half/big", bytes(20 << 20)) == 0
        assert client.get_view("t/half/big") is not None
        assert all(np.array_equal(x, want[f"w-{i}"]) for i, x in enumerate(kept))


def test_only_writable_memory_is_lent():
    """A store node's hot cache is mapped read-only (shared with its other readers): memory
    there is never handed out as a record's tensors."""
    lending = _Lending()
    with mmap.mmap(-1, 1 << 16, prot=mmap.PROT_READ) as ro:
        start = np.frombuffer(ro, np.uint8).ctypes.data
        assert not lending.writable(start, start + 4096)
    rw = np.zeros(1 << 16, np.uint8)
    assert lending.writable(rw.ctypes.data, rw.ctypes.data + rw.nbytes)


_EXIT_HOLDING = """
import sys
import torch  # first, as a training script does: Python then tears layertap's modules down first
import layertap
from layertap.mooncake.address import parse_address
from layertap.mooncake.client import connect
from layertap.vllm import fetch
location = {location!r}
client = connect(parse_address({node!r}))  # before what it lends: cleared first at exit
tcp = fetch(location, timeout=10)
node = fetch(location, timeout=10, store={node!r})
view, lent = client.lend({name!r})
assert tcp["x"][1] == 1 and node["x"][1] == 1 and lent
sys.exit(0)
"""


def test_a_process_that_exits_holding_lent_records_exits_cleanly(store, tmp_path):
    """A process whose records and lent objects still view its transfer buffers when it exits
    ends with status 0: their handles give the memory back through Mooncake clients that are
    still there (torn down first, Mooncake's release aborted the process)."""
    tcp = store.address("t/exit")
    _put(tcp, tmp_path / "spool", "w", [SMALL])
    script = _EXIT_HOLDING.format(
        location=_location(tmp_path, tcp, "w", "w-0"),
        node=store.node_address("t/exit"),
        name=record_name("t/exit", "w-0"),
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def _restart_node(store: LoopbackStore) -> None:
    """SIGKILL of the store node, and a new one on its port with its options (an empty segment)."""
    store.kill_node()
    log = os.path.join(store.workdir, "mooncake_client-2.log")
    store.node = subprocess.Popen(
        [
            os.path.join(BIN, "mooncake_client"),
            "-host=127.0.0.1",
            f"-port={store.node_port}",
            "-global_segment_size=256MB",
            "-local_buffer_size=16MB",
            f"-master_server_address=127.0.0.1:{store.port}",
            "-metadata_server=P2PHANDSHAKE",
            "-protocol=tcp",
        ],
        stdout=store._log(log),
        stderr=subprocess.STDOUT,
    )
    store.procs.append(store.node)
    _wait_port(store.node_port, store.node, "mooncake_client", log)


def test_a_node_restarted_while_records_are_held_is_not_read_through(tmp_path):
    """A restarted node places its reads anywhere in the memory it shares with the reader: while
    records it lent are held, reads through it fail (NodeRestartedError naming node= and what to
    do) and the held tensors keep their values; once they are gone, reads go on."""
    store = LoopbackStore(str(tmp_path))
    try:
        tcp, node = store.address("t/restart"), store.node_address("t/restart")
        want = _put(tcp, tmp_path / "spool", "w", [SMALL] * 2)
        held = fetch(_location(tmp_path, tcp, "w", "w-0"), timeout=10, store=node)["x"]
        client = connect(parse_address(node))
        buffer = _buffer_of(client, record_name("t/restart", "w-1"))
        assert buffer[0] <= held.data_ptr() < buffer[1]
        _restart_node(store)
        with pytest.raises(NodeRestartedError, match=r"node=127.0.0.1:\d+ stopped or was restarted while 1 objects"):
            client.get(record_name("t/restart", "w-1"))
        with pytest.raises(NodeRestartedError, match="drop those records or keep copies"):
            fetch(_location(tmp_path, tcp, "w", "w-1"), timeout=10, store=node)
        assert np.array_equal(held.numpy(), want["w-0"])
        del held
        # The object went with the old node's segment: whatever this read gives, it is not
        # refused for the restart, and the new node is the one that lends from now on.
        outcome = _raised(client.lend, record_name("t/restart", "w-1"))
        assert "restarted" not in str(outcome)
        assert client._lending.node is not None and client._lending.node[0] == store.node.pid
    finally:
        store.stop()


def _raised(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # the test asserts what
        return e
