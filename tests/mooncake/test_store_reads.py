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
from layertap.mooncake.client import connect
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
