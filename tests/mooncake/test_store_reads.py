"""Reads of records out of Mooncake Store without a copy into ``bytes``: the record's object is
decoded where Mooncake's ``get`` received it, in the client's transfer buffer (``get_view``),
which a decoded record never holds; ``fetch`` reads a record at once and looks for it only
while it is not there. A real store on loopback (store_support.py), whose clients have a
64 MiB transfer buffer (``LoopbackStore.address``)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import layertap
from layertap.mooncake.address import parse_address
from layertap.mooncake.client import BufferTooSmallError, connect
from layertap.mooncake.layout import record_name
from layertap.vllm import fetch
from layertap.vllm.mooncake_forwarder import Forwarder

#: A codec ``none`` record of 20 MiB: three fill the 64 MiB transfer buffer.
ROWS = 5 << 20


def _forward(address: str, spool, writer_id: str) -> None:
    f = Forwarder(parse_address(address), str(spool), writer_id, {}, keep_shards=True)
    f.close(timeout=60)
    assert f.error is None, f.error


def test_a_view_is_the_object_and_missing_is_none(store):
    client = connect(parse_address(store.address("t/views")))
    data = bytes(range(256)) * 4096
    assert client.put("t/views/obj", data) == 0
    view = client.get_view("t/views/obj")
    assert view == data and view.readonly and view.format == "B" and client.get("t/views/obj") == data
    assert client.get_view("t/views/nothing") is None


@pytest.mark.parametrize("backend", ["rust", "python"])
def test_decoded_records_leave_the_transfer_buffer_free(store, tmp_path, backend):
    """Seven 20 MiB records read and kept (140 MiB) through a 64 MiB transfer buffer, as records
    and as the store backend's decoded buffers: each read gives its room back once decoded (the
    Rust core's tensors own their memory; the Python reference's codec none tensors are views of
    what they decode, so it decodes a copy)."""
    address = store.address(f"t/room-{backend}")
    spool = tmp_path / "spool"
    rows = np.arange(ROWS, dtype=np.float32)
    with layertap.ShardWriter(spool, writer_id="w", codec="none") as w:
        w.submit("big", {"x": rows}, {})
    _forward(address, spool, "w")
    with layertap.open(address, backend=backend, tensors="numpy") as ds:
        kept = [ds["big"] for _ in range(7)]
        (shard,) = ds.backends
        decoded = [shard.read(0) for _ in range(7)]
    assert all(np.array_equal(r["x"], rows) for r in kept)
    for _, tensors in decoded:
        ((name, dtype, shape, buffer),) = tensors
        assert (name, dtype, tuple(shape)) == ("x", "F32", (ROWS,))
        assert np.array_equal(np.frombuffer(buffer, np.float32), rows)


def test_fetch_reads_a_record_there_and_waits_for_one_that_is_not(store, tmp_path):
    address = store.address("t/fetch-reads")
    spool = tmp_path / "spool"
    location = {"layertap": {"dataset": str(tmp_path), "writer_id": "w", "key": "k0", "store": address}}
    with pytest.raises(TimeoutError, match="did not appear"):
        fetch(location, timeout=0)
    got = []
    waiting = threading.Thread(target=lambda: got.append(fetch(location, timeout=60)))
    waiting.start()
    with layertap.ShardWriter(spool, writer_id="w") as w:
        w.submit("k0", {"x": np.arange(8, dtype=np.float32)}, {})
    _forward(address, spool, "w")
    waiting.join()
    assert np.array_equal(got[0]["x"].numpy(), np.arange(8, dtype=np.float32))
    assert connect(parse_address(address)).get_view(record_name("t/fetch-reads", "k0")) is not None
    assert fetch(location, timeout=0)["x"][7] == 7


def test_an_object_larger_than_the_transfer_buffer_says_so(store, tmp_path):
    """A record larger than the reader's transfer buffer: the error names the buffer and the size
    to raise it to (where Mooncake's get answers as for a store that does not answer)."""
    address = store.address("t/small-buffer")
    spool = tmp_path / "spool"
    with layertap.ShardWriter(spool, writer_id="w", codec="none") as w:
        w.submit("big", {"x": np.arange(ROWS, dtype=np.float32)}, {})
    _forward(address, spool, "w")
    small = store.address("t/small-buffer", buffer="16MiB")
    with (
        layertap.open(small) as ds,
        pytest.raises(
            BufferTooSmallError, match=r"more than .*\(buffer=16MiB\): raise buffer= in the address above 21MiB"
        ),
    ):
        ds["big"]
    location = {"layertap": {"dataset": str(tmp_path), "writer_id": "w", "key": "big", "store": address}}
    with pytest.raises(BufferTooSmallError, match="raise buffer="):
        fetch(location, timeout=10, store=small)
    assert fetch(location, timeout=10)["x"].shape == (ROWS,)  # the default buffer, 256 MiB


def test_a_transfer_buffer_full_of_held_objects_says_so(store):
    """Views held fill the 64 MiB transfer buffer: the next read names the buffer, not a store
    that does not answer; once they are gone it reads."""
    client = connect(parse_address(store.address("t/full")))
    data = bytes(20 << 20)
    assert client.put("t/full/a", data) == 0
    held = [client.get_view("t/full/a") for _ in range(3)]
    with pytest.raises(BufferTooSmallError, match=r"transfer buffer \(buffer=64MiB\) had no room for 20971520 bytes"):
        client.get_view("t/full/a")
    del held
    assert client.get_view("t/full/a") == data


def test_errors_name_the_address_the_caller_gave(store):
    """Datasets of one master share its client (one Mooncake client per master and options);
    each one's errors name its own address, not the first one connected."""
    first = connect(parse_address(store.address("t/first", buffer="16MiB")))
    second = connect(parse_address(store.address("t/second", buffer="16MiB")))
    assert second.store is first.store and second is connect(parse_address(store.address("t/second", buffer="16MiB")))
    assert connect(parse_address(store.address("t/second"))).put("t/second/big", bytes(20 << 20)) == 0
    with pytest.raises(BufferTooSmallError, match=rf"^mooncake://127.0.0.1:{store.port}/t/second: cannot read"):
        second.get("t/second/big")
