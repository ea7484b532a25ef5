"""Faults of a store smaller than the data: what the store evicted (or refused) is reported as
missing, never read as another record; what is there reads back equal."""

from __future__ import annotations

import numpy as np
import pytest
from store_support import LoopbackStore

import layertap
from layertap.errors import RecordMissingError
from layertap.mooncake.address import parse_address
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
