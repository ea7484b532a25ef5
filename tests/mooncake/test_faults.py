"""Faults of the store: what a store smaller than the data evicted (or refused) is reported as
missing, never read as another record, and what is there reads back equal; a master gone costs
one slow call, not one per call."""

from __future__ import annotations

import time

import numpy as np
import pytest
from store_support import LoopbackStore

import layertap
from layertap.errors import RecordMissingError
from layertap.mooncake.address import parse_address
from layertap.mooncake.client import RPC_FAIL, connect
from layertap.vllm.mooncake_sink import Forwarder


@pytest.fixture
def small_store(tmp_path):
    s = LoopbackStore(str(tmp_path), segment="16MB")
    try:
        yield s
    finally:
        s.stop()


def test_a_store_smaller_than_the_data(small_store, tmp_path):
    address = small_store.address("small")
    rng = np.random.default_rng(3)
    want = {}
    with layertap.ShardWriter(tmp_path / "spool", writer_id="big", codec="none", shard_size=4 << 20) as w:
        for i in range(40):  # 40 MiB into a 16 MiB store
            x = rng.standard_normal(1 << 18).astype(np.float32)
            w.submit(f"k{i}", {"x": x})
            want[f"k{i}"] = x
    f = Forwarder(parse_address(address), str(tmp_path / "spool"), "big", {}, keep_shards=True)
    f.close(timeout=120)
    assert f.error is None
    put, failed = f.stats["records_put"], f.stats["records_failed"]
    assert put + failed == 40
    with layertap.open(address, tensors="numpy") as ds:
        report = ds.verify()
        missing = {p.key for p in report.problems if p.kind == "missing_record" and p.key}
        assert report.records_ok + len(missing) == put and len(missing) + failed > 0
        assert report.records_ok > 0
        for key in ds.keys():
            if key in missing:
                with pytest.raises(RecordMissingError):
                    ds[key]
            else:
                assert np.array_equal(ds[key]["x"], want[key])


def test_calls_fail_at_once_while_the_master_is_gone(tmp_path):
    """Mooncake's client spends about 4 s on each call to a master that is gone; once one call
    has failed, the next ones fail at once (a connector's shutdown, which puts its index and
    head, must end within vLLM's 5 s grace for its workers, or it is killed before it reports)."""
    store = LoopbackStore(str(tmp_path))
    writer = None
    try:
        address = parse_address(store.address("gone"))
        writer = layertap.ShardWriter(tmp_path / "spool", writer_id="late", codec="none")
        forwarder = Forwarder(address, str(tmp_path / "spool"), "late", {}, keep_shards=True)
        client = connect(address)  # the forwarder's client too: one a process and address
        assert client.put("gone/a", b"x") == 0 and client.exists("gone/a") is True
        store.kill_master()
        assert client.put("gone/b", b"y") != 0  # Mooncake's client finds out (seconds)
        t0 = time.monotonic()
        assert client.put("gone/c", b"z") == RPC_FAIL
        assert client.upsert("gone/head", b"h") == RPC_FAIL
        assert client.exists("gone/a") is None and client.get("gone/a") is None
        # about 4 s a call without the check, milliseconds with it; the bound leaves room for a
        # loaded machine
        assert time.monotonic() - t0 < 3.0, "each call waited for the master that is gone"
        # A record written now fails, and the close, which publishes the index and the head,
        # returns at once too.
        writer.submit("k", {"x": np.zeros(4, np.float32)})
        writer.close()
        t0 = time.monotonic()
        forwarder.close(timeout=30)
        took = time.monotonic() - t0
        assert forwarder.error is None and forwarder.stats["records_put"] == 0
        assert forwarder.stats["records_failed"] == 1
        assert took < 3.5, f"the forwarder took {took:.1f} s to close"
    finally:
        if writer is not None:
            writer.close()
        store.stop()
