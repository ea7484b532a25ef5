"""The store layer against a real Mooncake Store on loopback: records forwarded from a writer's
shards, read back by ``layertap.open`` (CRC checked), verified, inspected, pulled into shards."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from store_support import shard_frames, silent_port

import layertap
from layertap.errors import CorruptRecordError, InvalidInputError, RecordMissingError
from layertap.mooncake.address import parse_address
from layertap.mooncake.client import connect
from layertap.mooncake.layout import record_name
from layertap.vllm.mooncake_forwarder import Forwarder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "python"), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "layertap", *args], capture_output=True, text=True, env=env, timeout=120
    )


def _write(directory, writer_id: str, n: int, codec: str = "bp16-zstd", shard_size: int = 64 << 10, seed: int = 0):
    """n records, as the connector's would be, by the Rust writer; returns their tensors by key."""
    rng = np.random.default_rng(seed)
    want = {}
    with layertap.ShardWriter(directory, writer_id=writer_id, codec=codec, shard_size=shard_size) as w:
        for i in range(n):
            t = int(rng.integers(1, 40))
            hs = rng.standard_normal((t, 3, 32)).astype(np.float32)
            ids = rng.integers(0, 1000, t).astype(np.int64)
            key = f"{writer_id}-r{i}"
            w.submit(key, {"hidden_states": hs, "token_ids": ids}, {"model": "m", "num_tokens": str(t)})
            want[key] = (hs, ids)
    return want


def _forward(address: str, directory, writer_id: str, keep: bool = True) -> Forwarder:
    f = Forwarder(parse_address(address), str(directory), writer_id, {"user": {"run": "t"}}, keep_shards=keep)
    f.close(timeout=60)
    assert f.error is None
    return f


def test_records_through_the_store(store, tmp_path):
    address = store.address("t/records")
    spool = tmp_path / "spool"
    want = _write(spool, "w0", 60)
    f = _forward(address, spool, "w0", keep=True)
    assert f.stats["records_put"] == 60 and f.stats["records_failed"] == 0
    with layertap.open(address, tensors="numpy") as ds, layertap.open(str(spool), tensors="numpy") as disk:
        assert ds.keys() == disk.keys() == list(want)
        for key, (hs, ids) in want.items():
            r = ds[key]
            assert np.array_equal(r["hidden_states"], hs) and np.array_equal(r["token_ids"], ids)
            assert r.metadata == disk[key].metadata
        report = ds.verify()
        assert report.ok and report.records_ok == 60, report.problems
        assert ds.shards[0].complete and ds.shards[0].meta["user"] == {"run": "t"}
    # the torch Dataset reads the store dataset as it reads shards
    from layertap.torch import HiddenStatesDataset

    items = HiddenStatesDataset(address)
    assert len(items) == 60
    for key in list(want)[::7]:
        item, (hs, ids) = items[items.keys.index(key)], want[key]
        assert np.array_equal(item["hidden_states"].numpy(), hs) and np.array_equal(item["token_ids"].numpy(), ids)
    # verify and inspect on the command line
    r = _cli("verify", address)
    assert r.returncode == 0 and "60 records ok" in r.stdout, r.stdout + r.stderr
    r = _cli("inspect", address)
    assert r.returncode == 0 and "60" in r.stdout, r.stdout + r.stderr
    # pull: shards on disk that verify accepts, each frame byte for byte the writer's
    out = tmp_path / "pulled"
    r = _cli("pull", address, str(out))
    assert r.returncode == 0 and "60 records" in r.stdout, r.stdout + r.stderr
    assert _cli("verify", str(out)).returncode == 0
    assert shard_frames(out) == shard_frames(spool)
    # pulling again adds nothing
    r = _cli("pull", address, str(out))
    assert r.returncode == 0 and "60 already there" in r.stdout, r.stdout


def test_the_forwarder_keeps_no_finished_shard(store, tmp_path):
    """A served engine forwards for weeks: the shards it has forwarded and removed are not held
    (their entries were about 300 bytes a record), and every record goes into the store once."""
    address = store.address("t/bounded")
    spool = tmp_path / "spool"
    spool.mkdir()
    f = Forwarder(parse_address(address), str(spool), "wb", {}, keep_shards=False)
    want = _write(spool, "wb", 150, shard_size=4 << 10)  # while the forwarder runs
    f.close(timeout=60)
    assert f.error is None and f.stats["records_put"] == 150 and f.stats["spool_shards_removed"] >= 30
    assert f._tail.shards() == []
    with layertap.open(address) as ds:
        assert ds.keys() == list(want)


def test_missing_and_foreign_records_are_never_read(store, tmp_path):
    address = store.address("t/missing")
    spool = tmp_path / "spool"
    _write(spool, "w1", 5)
    _forward(address, spool, "w1", keep=False)
    assert not [n for n in os.listdir(spool) if n.endswith(".lts")]  # forwarded, removed
    a = parse_address(address)
    client = connect(a)
    assert client.store.remove(record_name(a.prefix, "w1-r2"), True) == 0  # as eviction would
    # another record under a key of the index: a different frame than the index says
    other = tmp_path / "other"
    _write(other, "w1", 5, seed=7)
    frame = shard_frames(other)["w1-r3"]
    assert client.store.remove(record_name(a.prefix, "w1-r3"), True) == 0
    assert client.put(record_name(a.prefix, "w1-r3"), frame) == 0
    with layertap.open(address) as ds:
        with pytest.raises(RecordMissingError, match="not in the store"):
            ds["w1-r2"]
        with pytest.raises(CorruptRecordError, match="another record than the index lists"):
            ds["w1-r3"]
        report = ds.verify()
        kinds = sorted((p.key, p.kind) for p in report.problems)
        assert kinds == [("w1-r2", "missing_record"), ("w1-r3", "corrupt_record")]
        assert report.records_ok == 3
        # iter(errors="skip") names them as verify and follow do
        it = ds.iter(errors="skip")
        assert [r.key for r in it] == ["w1-r0", "w1-r1", "w1-r4"] and it.skipped == 2
        assert [(p.key, p.kind) for p in it.problems] == [("w1-r2", "missing_record"), ("w1-r3", "corrupt_record")]
    # follow skips both with errors="skip", and by default stops at the first
    with layertap.follow(address, timeout=0, errors="skip") as records:
        assert [r.key for r in records] == ["w1-r0", "w1-r1", "w1-r4"]
    assert records.skipped == 2
    assert [(p.key, p.kind) for p in records.problems] == [("w1-r2", "missing_record"), ("w1-r3", "corrupt_record")]
    with layertap.follow(address, timeout=0) as records:
        assert next(records).key == "w1-r0" and next(records).key == "w1-r1"
        with pytest.raises(RecordMissingError, match="not in the store"):
            next(records)
    r = _cli("pull", address, str(tmp_path / "pulled"))
    assert r.returncode == 1 and "3 records" in r.stdout and "1 missing, 1 corrupt" in r.stdout, r.stdout
    assert _cli("verify", str(tmp_path / "pulled")).returncode == 0


def test_key_already_there_is_refused(store, tmp_path):
    address = store.address("t/dup")
    _write(tmp_path / "a", "wa", 3)
    _forward(address, tmp_path / "a", "wa")
    (tmp_path / "b").mkdir()
    with layertap.ShardWriter(tmp_path / "b", writer_id="wb") as w:
        w.submit("wa-r1", {"x": np.zeros(3, np.float32)})  # a key writer wa put already
        w.submit("wb-r0", {"x": np.ones(3, np.float32)})
    f = _forward(address, tmp_path / "b", "wb")
    assert f.stats["duplicates_refused"] == 1 and f.stats["records_put"] == 1
    with layertap.open(address, tensors="numpy") as ds:
        assert sorted(ds.keys()) == ["wa-r0", "wa-r1", "wa-r2", "wb-r0"]
        assert "hidden_states" in ds["wa-r1"].tensors  # wa's record, not wb's
        assert ds.verify().ok


def test_fetch_never_returns_another_requests_record_as_its_own(store, tmp_path):
    """Two data-parallel ranks (writers) given one sample_id: the key is put once, so the second
    rank's record is refused; fetching its response finds the first rank's record under the key,
    and says so instead of returning it as this response's."""
    from layertap._tensors import tensor_maker
    from layertap.errors import DuplicateKeyError
    from layertap.vllm.mooncake_forwarder import fetch_from_store

    address = store.address("t/ranks")
    for rank, request in ((0, "req-a"), (1, "req-b")):
        spool = tmp_path / f"dp{rank}"
        with layertap.ShardWriter(spool, writer_id=f"dp{rank}") as w:
            w.submit("s1", {"x": np.full(4, rank, np.float32)}, {"request_id": request, "num_tokens": "4"})
        f = _forward(address, spool, f"dp{rank}")
    assert f.stats["duplicates_refused"] == 1
    make = tensor_maker("numpy")
    record = fetch_from_store(address, "dp0", "s1", 10, make, request_id="req-a", num_tokens=4)
    assert record["x"][0] == 0 and record.metadata["request_id"] == "req-a"
    with pytest.raises(DuplicateKeyError, match="key 's1' is another request's \\(request 'req-a'"):
        fetch_from_store(address, "dp1", "s1", 10, make, request_id="req-b", num_tokens=4)
    with pytest.raises(DuplicateKeyError, match="not 5 tokens"):
        fetch_from_store(address, "dp0", "s1", 10, make, num_tokens=5)


def test_bad_addresses_and_unreachable_master(tmp_path):
    from store_support import unreachable_port

    from layertap.errors import InvalidInputError, StoreUnavailableError

    for bad, words in [
        ("mooncake://host/prefix", "HOST:PORT"),
        ("mooncake://h:1/", "prefix"),
        ("mooncake://h:1/p?segment=3", "segment"),
        ("mooncake://h:1/p?color=red", "unknown option"),
    ]:
        with pytest.raises(InvalidInputError, match=words):
            parse_address(bad)
    with unreachable_port() as port:
        with pytest.raises(StoreUnavailableError, match=f"cannot reach the Mooncake master at 127.0.0.1:{port}"):
            layertap.open(f"mooncake://127.0.0.1:{port}/x")
        r = _cli("verify", f"mooncake://127.0.0.1:{port}/x")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "mooncake_master" in r.stderr, r.stderr


#: A line of Mooncake's own log (glog's format), or glog's note before its set-up.
GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]|Logging before InitGoogleLogging", re.M)


def test_malformed_addresses_are_refused_in_one_line(tmp_path):
    """Nothing in an address is normalised: a trailing or doubled '/' would name another prefix
    than the one written (a whole run went into it), an option without a value is not a default.
    Every command that takes an address refuses it in one line, exit status 2, before it looks
    for a master (none runs here) or writes anything."""
    for bad, words in [
        ("mooncake://127.0.0.1:1/runs/hs/", "no leading or trailing '/'"),
        ("mooncake://127.0.0.1:1//hs", "no leading or trailing '/'"),
        ("mooncake://127.0.0.1:1/runs//hs", "joined by single '/'"),
        ("mooncake://127.0.0.1:1/hs?segment", "option 'segment' has no value"),
        ("mooncake://127.0.0.1:1/hs?local=", "option 'local' has no value"),
        ("mooncake://127.0.0.1:0/hs", "HOST:PORT"),
    ]:
        with pytest.raises(InvalidInputError, match=re.escape(words)):
            layertap.open(bad)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"input_ids": [5, 6, 7]}\n')
    trailing = "mooncake://127.0.0.1:1/runs/hs/"
    for args in (
        ["inspect", trailing],
        ["verify", trailing],
        ["pull", trailing, str(tmp_path / "pulled")],
        ["generate", str(tmp_path / "no-model"), "--data", str(rows), "--out", trailing],
        # a typo of the scheme is no directory to write into
        ["generate", str(tmp_path / "no-model"), "--data", str(rows), "--out", "mooncake:/127.0.0.1:1/hs"],
    ):
        r = _cli(*args)
        words = "no leading or trailing '/'" if trailing in args else "is not a Mooncake address"
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and words in r.stderr, (args, r.stderr)
    assert sorted(os.listdir(tmp_path)) == ["rows.jsonl"]  # no directory made, by pull or generate


def test_a_port_that_is_not_a_master_is_one_line(store, tmp_path):
    """A port that takes connections but is no master (the master's own metrics port, which
    speaks HTTP; a service that never answers): Mooncake's client would retry its set-up for
    minutes, logging each try. The command (inspect; generate, before any engine) ends with one
    line saying so, after the 3 s connect and 3 s handshake bounds (the process ending with that
    line is the bound)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"input_ids": [5, 6, 7]}\n')
    with silent_port() as port:
        for command in (
            ["inspect", f"mooncake://127.0.0.1:{store.metrics_port}/x"],
            ["generate", str(tmp_path / "no-model"), "--data", str(rows), "--out", f"mooncake://127.0.0.1:{port}/x"],
        ):
            r = _cli(*command)
            assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
            assert "is not a Mooncake master" in r.stderr and "-rpc_port" in r.stderr, r.stderr


def test_mooncake_logs_into_a_file_unless_asked(store, tmp_path):
    """Mooncake's client logs ~17 lines each time a process sets it up: they go to files of its
    own (LAYERTAP_MOONCAKE_LOG, a directory), not into a command's output; with
    LAYERTAP_MOONCAKE_LOG=stderr they are shown."""
    address = store.address("t/logs")
    spool = tmp_path / "spool"
    _write(spool, "wl", 3)
    _forward(address, spool, "wl")
    logs = tmp_path / "mooncake-logs"
    for args in (["inspect", address], ["verify", address], ["pull", address, str(tmp_path / "pulled")]):
        r = _cli(*args, env={"LAYERTAP_MOONCAKE_LOG": str(logs)})
        assert r.returncode == 0, r.stdout + r.stderr
        assert not GLOG_LINE.search(r.stdout + r.stderr), r.stdout + r.stderr
    assert GLOG_LINE.search((logs / "mooncake-transfer-engine.INFO").read_text())
    r = _cli("inspect", address, env={"LAYERTAP_MOONCAKE_LOG": "stderr"})
    assert r.returncode == 0 and GLOG_LINE.search(r.stderr), r.stderr


SETUP_WITHOUT_GLOG_FLAG = """
import sys
from layertap.mooncake import logs
logs.quiet_stderr = lambda: False  # as where the glog library or its flag is not found
from layertap.mooncake.address import parse_address
from layertap.mooncake.client import connect
print(connect(parse_address(sys.argv[1])).exists("t/none"))
"""


def test_mooncake_set_up_into_a_file_where_glog_cannot_be_told(store, tmp_path):
    """Where glog's copy of ERROR lines to stderr cannot be turned off in its library, the
    client's set-up runs with fd 2 redirected into a file of the log directory, and restored:
    the process's own stderr works after."""
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "python"), "LAYERTAP_MOONCAKE_LOG": str(tmp_path)}
    code = SETUP_WITHOUT_GLOG_FLAG + "print('after', file=sys.stderr)\n"
    r = subprocess.run(
        [sys.executable, "-c", code, store.address("t")], capture_output=True, text=True, env=env, timeout=60
    )
    assert r.returncode == 0 and r.stdout == "False\n" and r.stderr == "after\n", r.stderr
    setup_logs = list(tmp_path.glob("mooncake-setup.*.log"))
    assert len(setup_logs) == 1 and GLOG_LINE.search(setup_logs[0].read_text())


def test_follow_records_as_they_arrive(store, tmp_path):
    import threading

    address = store.address("t/follow")
    spool = tmp_path / "spool"
    spool.mkdir()
    got: list[str] = []
    with layertap.ShardWriter(spool, writer_id="wf", shard_size=16 << 10) as w:
        for i in range(5):
            w.submit(f"f{i}", {"x": np.full(700, i, np.float32)})
        w.flush()
        fwd = Forwarder(parse_address(address), str(spool), "wf", {}, keep_shards=False)

        def reader():
            # The idle timeout only ends a reader that falls short; a full one stops at 12.
            with layertap.follow(address, timeout=20, tensors="numpy") as f:
                for r in f:
                    assert r["x"][0] == int(r.key[1:])
                    got.append(r.key)
                    if len(got) == 12:
                        break

        t = threading.Thread(target=reader)
        t.start()
        for i in range(5, 12):
            w.submit(f"f{i}", {"x": np.full(700, i, np.float32)})
    fwd.close(timeout=60)
    t.join(30)
    assert not t.is_alive() and got == [f"f{i}" for i in range(12)]


def test_speculators_backend_reads_from_the_store(store, tmp_path):
    from layertap.speculators.backend import LayertapTransfer, check_dataset

    address = store.address("t/spec")
    spool = tmp_path / "spool"
    with layertap.ShardWriter(spool, writer_id="ws") as w:
        for i in range(3):
            hs = np.full((4, 2, 8), i, np.float32)
            w.submit(str(i), {"hidden_states": hs, "token_ids": np.arange(4, dtype=np.int64)})
    _forward(address, spool, "ws")
    assert check_dataset(address, explicit=True) == address
    transfer = LayertapTransfer(address)
    sample = transfer.get_cached(2)
    assert sample["token_ids"].tolist() == [0, 1, 2, 3] and float(sample["hidden_states"][0, 0, 0]) == 2.0
    assert transfer.get_cached(5) is None
    transfer.close()


def test_a_spool_of_parts_is_put_into_the_store_under_each_writer(store, tmp_path):
    """``generate --out mooncake://``'s settling step over a parallel run's spool (a dataset of
    parts, one writer each), of which the store holds one writer's records and lacks the other's
    (its puts failed): it puts what is missing under the writer that wrote it, the store then
    lists every record, byte for byte the spool's, and the run is complete."""
    from layertap.generate.store import Spool, check_store, settle_store_run
    from layertap.parts import write_manifest

    spool = tmp_path / "spool"
    for i in range(2):
        _write(spool / f"engine-{i}", f"gen-{i}", 15, seed=i)
    write_manifest(spool, [str(spool / "engine-0"), str(spool / "engine-1")])
    address = store.address("settle")
    _forward(address, spool / "engine-0", "gen-0")  # gen-1's records never reached the store
    assert check_store(address, str(spool)).not_listed == {f"gen-1-r{i}" for i in range(15)}

    settled = settle_store_run({"complete": True}, address, Spool(str(spool), keep=False))
    assert settled["complete"] and settled["store_missing"] == 0 and settled["also_dir"] is None
    with layertap.open(address) as ds:
        assert sorted(ds.keys()) == sorted(f"gen-{w}-r{i}" for w in range(2) for i in range(15))
        assert sorted(s.meta["writer_id"] for s in ds.shards) == ["gen-0", "gen-1"] and ds.verify().ok
    pulled = tmp_path / "pulled"
    assert _cli("pull", address, str(pulled)).returncode == 0
    assert shard_frames(pulled) == {**shard_frames(spool / "engine-0"), **shard_frames(spool / "engine-1")}
