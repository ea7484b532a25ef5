"""Faults of the store: what a store smaller than the data evicted (or refused) is reported as
missing, never read as another record, and what is there reads back equal; a master gone costs
one slow call, not one per call; a read that fails is never taken for an object that is not
there."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from store_support import LoopbackStore, shard_frames

import layertap
from layertap._spec.format import CODECS
from layertap.errors import RecordMissingError, StoreUnavailableError
from layertap.mooncake.address import parse_address
from layertap.mooncake.client import RPC_FAIL, connect
from layertap.mooncake.layout import StoreEntry, chunk_name
from layertap.mooncake.publisher import StorePublisher
from layertap.vllm import fetch
from layertap.vllm.mooncake_forwarder import CLOSE_TIMEOUT, Forwarder


@pytest.fixture
def small_store(tmp_path):
    # Leases of an hour: what a check or a read finds in the store is not evicted after it (see
    # LoopbackStore), so what the test reads back is what the check saw.
    s = LoopbackStore(str(tmp_path), segment="16MB", lease_ttl="1h")
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


def test_a_run_whose_records_were_evicted_is_not_complete(small_store, tmp_path):
    """generate's settling step after a run into a store smaller than its records: every put
    may have succeeded and every record be listed while the later ones evicted the first. The
    store is asked for each listed record's object: those gone count as missing
    (``store_evicted`` of them), the run is not complete, and its spool is kept."""
    from layertap.generate.store import Spool, settle_store_run

    address = small_store.address("evicted")
    spool = tmp_path / "spool"
    rng = np.random.default_rng(5)
    with layertap.ShardWriter(spool, writer_id="big", codec="none", shard_size=4 << 20) as w:
        for i in range(40):  # 40 MiB into a 16 MiB store
            w.submit(f"k{i}", {"x": rng.standard_normal(1 << 18).astype(np.float32)})
    f = Forwarder(parse_address(address), str(spool), "big", {}, keep_shards=True)
    f.close(timeout=120)
    assert f.error is None and f.stats["records_put"] > 0 and f.stats["index_failures"] == 0
    # Mooncake evicts in its master's eviction thread, after the puts that found no room: the
    # settling step may come first (it then rightly counts nothing evicted). Wait for the master
    # to have evicted one of the records put (its count of evicted keys, a handshake).
    small_store.wait_evicted(1)
    settled = settle_store_run({"complete": True}, address, Spool(str(spool), keep=False))
    with layertap.open(address) as ds:
        report = ds.verify()
    # The settling step's check leased what it found for an hour, so nothing it found has been
    # evicted since: the store holds now what it held then, and every record verify finds gone
    # is counted as evicted.
    gone = [p.key for p in report.problems if p.kind == "missing_record" and p.key]
    assert settled["store_missing"] == 40 - report.records_ok and not settled["complete"]
    # The master evicted these at least (its count also takes other objects of the run, such as
    # an index chunk: a fresh-clone CI run of the command's twin saw 108 keys for 97 records).
    assert settled["store_evicted"] == len(gone) > 0
    assert small_store.evicted_keys() >= len(gone)
    assert settled["store_refused"] == 0 and settled["also_dir"] == str(spool)


def test_a_run_whose_puts_were_refused_is_not_complete(store, tmp_path):
    """A second run into a prefix that holds a first run's records under the same keys: its puts
    are refused (a key is put once), so the store lists the keys but holds the first run's
    records, not this run's: counted in ``store_refused``, the run not complete."""
    from layertap.generate.store import Spool, settle_store_run

    address = store.address("t/refused")
    for run, value in (("first", 0.0), ("second", 1.0)):
        with layertap.ShardWriter(tmp_path / run, writer_id=run, codec="none") as w:
            for i in range(5 if run == "first" else 7):
                w.submit(f"k{i}", {"x": np.full(64, value, np.float32)})
        f = Forwarder(parse_address(address), str(tmp_path / run), run, {}, keep_shards=True)
        f.close(timeout=60)
    assert f.stats["duplicates_refused"] == 5 and f.stats["records_put"] == 2
    settled = settle_store_run({"complete": True}, address, Spool(str(tmp_path / "second"), keep=False))
    assert not settled["complete"] and settled["store_refused"] == 5 and settled["store_missing"] == 0
    assert settled["also_dir"] == str(tmp_path / "second")


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
        assert client.exists("gone/a") is None
        with pytest.raises(StoreUnavailableError, match="does not answer"):
            client.get("gone/a")
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


def _spool_records(directory, writer_id: str, n: int) -> list[tuple[StoreEntry, bytes]]:
    """n records written by the Rust writer, as ``(index entry, frame)`` for a publisher."""
    with layertap.ShardWriter(directory, writer_id=writer_id, codec="none") as w:
        for i in range(n):
            w.submit(f"{writer_id}-{i}", {"x": np.full(64, i, np.float32)})
    frames = shard_frames(directory)
    with layertap.open(str(directory)) as ds:
        entries = [e for s in ds.backends for e in s.entries]
    return [
        (StoreEntry(e.key, e.stored_len, e.raw_len, e.num_tokens, CODECS.index(e.codec), e.payload_crc), frames[e.key])
        for e in entries
    ]


def test_a_read_that_outlives_its_lease_is_read_again(store):
    """The store node holding an object answers late (here: stopped for 0.3 s, longer than the
    test master's 50 ms lease): Mooncake's get fails with LEASE_EXPIRED and returns what it
    returns for an object that is not there. The object is read again, not reported missing."""
    a = parse_address(store.address("t/lease"))
    client = connect(a)
    assert client.put("t/lease/x", b"x" * 5000) == 0
    os.kill(store.node.pid, signal.SIGSTOP)
    resume = threading.Timer(0.3, os.kill, (store.node.pid, signal.SIGCONT))
    resume.start()
    try:
        assert client.get("t/lease/x") == b"x" * 5000
    finally:
        resume.join()
    assert client.get("t/lease/absent") is None


def test_follow_hands_out_each_record_once_when_an_index_chunk_is_unreadable_for_a_while(store, tmp_path):
    """A follower counts a writer's records by their position in its index: a look that cannot
    read chunk 1 lists the records up to it, not chunk 2's in its place (which the next look,
    with chunk 1 back, would hand out again while chunk 1's were never)."""
    address = store.address("t/gap")
    a = parse_address(address)
    client = connect(a)
    records = _spool_records(tmp_path / "spool", "wg", 9)
    publisher = StorePublisher(client, a, "wg", {})
    for chunk in range(3):
        for entry, frame in records[3 * chunk : 3 * chunk + 3]:
            assert publisher.publish(entry, frame)
        publisher.flush_index()
    publisher.close()
    name = chunk_name(a.prefix, "wg", 1)
    chunk1 = client.get(name)
    assert client.store.remove(name, True) == 0
    put_back = threading.Timer(1.0, client.put, (name, chunk1), {"pinned": True})
    put_back.start()
    try:
        with layertap.follow(address, timeout=3) as followed:
            keys = [r.key for r in followed]
    finally:
        put_back.join()
    assert keys == [e.key for e, _ in records]


def test_a_store_that_cannot_be_read_is_unavailable_not_empty_or_missing(tmp_path):
    """Reads that fail (the master gone) raise StoreUnavailableError: a record is not reported
    missing, a dataset not reported absent ("no dataset there"), a follower does not end as if
    no more records came, a fetch does not wait for a record it cannot look for."""
    store = LoopbackStore(str(tmp_path))
    try:
        address = store.address("t/down")
        a = parse_address(address)
        publisher = StorePublisher(connect(a), a, "wd", {})
        for entry, frame in _spool_records(tmp_path / "spool", "wd", 2):
            publisher.publish(entry, frame)
        publisher.close()
        location = {"layertap": {"dataset": str(tmp_path), "writer_id": "wd", "key": "wd-0", "store": address}}
        assert fetch(location, timeout=10)["x"][0] == 0
        with layertap.open(address) as ds:
            store.kill_master()
            with pytest.raises(StoreUnavailableError, match="does not answer"):
                ds["wd-0"]
        # a served request's record, looked for in a store that does not answer: not a wait
        # until the timeout (or for ever)
        location["layertap"]["key"] = "wd-7"
        with pytest.raises(StoreUnavailableError, match="cannot look for record 'wd-7'"):
            fetch(location, timeout=20)
        with pytest.raises(StoreUnavailableError):
            layertap.open(address)  # not FormatError: no dataset there
        with pytest.raises(StoreUnavailableError), layertap.follow(address, timeout=0) as followed:
            list(followed)
    finally:
        store.stop()


def test_a_forwarder_that_stopped_says_so_in_its_statistics(store, tmp_path):
    """The connector's statistics carry the forwarder's (under ``mooncake``): a thread that died
    on an error is seen there, not only in a log line."""
    spool = tmp_path / "spool"
    spool.mkdir()
    forwarder = Forwarder(parse_address(store.address("t/dies")), str(spool), "wx", {}, keep_shards=True)
    assert forwarder.stats["state"] == "forwarding"
    spool.rmdir()  # the spool gone from under it
    forwarder.close(timeout=30)
    assert forwarder.stats["state"] == "failed"
    assert forwarder.stats["error"].startswith("FileNotFoundError"), forwarder.stats


def test_close_waits_a_bounded_time_for_a_store_that_does_not_answer(tmp_path):
    """A master that does not answer (stopped: its port still takes connections, so each call
    waits for Mooncake's 30 s RPC timeout): the worker's close of its forwarder returns within
    ``CLOSE_TIMEOUT``, inside vLLM's 5 s grace for its workers, and says the forwarding was cut
    short; the forwarder goes on, and puts the record once the master answers again."""
    store = LoopbackStore(str(tmp_path))
    resume = None
    try:
        spool = tmp_path / "spool"
        writer = layertap.ShardWriter(spool, writer_id="slow", codec="none")
        forwarder = Forwarder(parse_address(store.address("t/slow")), str(spool), "slow", {}, keep_shards=True)
        os.kill(store.master.pid, signal.SIGSTOP)
        resume = threading.Timer(8.0, os.kill, (store.master.pid, signal.SIGCONT))
        resume.start()
        writer.submit("k", {"x": np.zeros(4, np.float32)})
        writer.close()
        t0 = time.monotonic()
        forwarder.close()
        took = time.monotonic() - t0
        assert took < CLOSE_TIMEOUT + 1.5, f"close took {took:.1f} s"
        assert forwarder.stats["state"] == "closing"
        # The master answers again as soon as the close has returned (the timer only stands
        # in for a close that hangs): the forwarder, still running, then puts the record.
        resume.cancel()
        os.kill(store.master.pid, signal.SIGCONT)
        forwarder.close(timeout=60)
        assert forwarder.stats["state"] == "closed" and forwarder.stats["records_put"] == 1, forwarder.stats
    finally:
        if resume is not None:
            resume.join()
            os.kill(store.master.pid, signal.SIGCONT)
        store.stop()
