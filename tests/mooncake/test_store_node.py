"""Reading through the store node on this host (the address option ``node=HOST:PORT``:
Mooncake's dummy client, the objects moved through memory shared with the node), against a
real master and store node on loopback (store_support.py): the same records, missing records
and errors as over the network; a node that is not there, or is killed while a reader is
attached, is StoreUnavailableError naming ``node=``, never a hang or a record taken for
missing."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from store_support import LoopbackStore, shard_frames, unreachable_port

import layertap
from layertap.errors import InvalidInputError, RecordMissingError, StoreUnavailableError
from layertap.mooncake.address import parse_address
from layertap.mooncake.client import connect
from layertap.mooncake.layout import record_name
from layertap.vllm import fetch
from layertap.vllm.config import ConfigError, parse_options
from layertap.vllm.mooncake_forwarder import Forwarder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Seconds a read may take to fail once the node is gone: far above what it takes (a refused
#: connection on this host), only so that a hang fails the test instead of stalling it.
HANG = 60


def _write_and_forward(address: str, spool, writer_id: str, codec: str, n: int = 6) -> dict:
    rng = np.random.default_rng(len(writer_id))
    want = {}
    with layertap.ShardWriter(spool, writer_id=writer_id, codec=codec) as w:
        for i in range(n):
            hs = rng.standard_normal((50 + i, 3, 64)).astype(np.float32)
            key = f"{writer_id}-{i}"
            w.submit(key, {"hidden_states": hs}, {"num_tokens": str(50 + i), "request_id": f"req-{i}"})
            want[key] = hs
    f = Forwarder(parse_address(address), str(spool), writer_id, {}, keep_shards=True)
    f.close(timeout=60)
    assert f.error is None and f.stats["records_put"] == n, (f.error, f.stats)
    return want


def _location(tmp_path, address: str, writer_id: str, key: str) -> dict:
    store = parse_address(address).dataset  # what the connector puts in a response: no options
    return {"layertap": {"dataset": str(tmp_path), "writer_id": writer_id, "key": key, "store": store}}


@pytest.mark.parametrize("codec", ["none", "bp16-zstd", "exp-huf"])
def test_reads_through_the_node_are_the_records(store, tmp_path, codec):
    """open, fetch, follow and pull through ``node=`` give what the writer wrote, as reads over
    the network do; a record that is not there is missing, not unavailable."""
    tcp, node = store.address(f"t/node-{codec}"), store.node_address(f"t/node-{codec}")
    spool = tmp_path / "spool"
    want = _write_and_forward(tcp, spool, "wn", codec)
    with layertap.open(node, tensors="numpy") as ds:
        assert ds.keys() == list(want)
        for key, hs in want.items():
            assert np.array_equal(ds[key]["hidden_states"], hs)
        assert ds.verify().ok
    assert connect(parse_address(node)).address.node == f"127.0.0.1:{store.node_port}"
    record = fetch(_location(tmp_path, tcp, "wn", "wn-3"), timeout=10, store=node)
    assert np.array_equal(record["hidden_states"].numpy(), want["wn-3"]) and record.metadata["request_id"] == "req-3"
    with layertap.follow(node, timeout=0) as followed:
        assert [r.key for r in followed] == list(want)
    out = tmp_path / "pulled"  # another process, its own attachment to the node
    r = subprocess.run(
        [sys.executable, "-m", "layertap", "pull", node, str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "python")},
        timeout=120,
    )
    assert r.returncode == 0 and "6 records" in r.stdout, r.stdout + r.stderr
    assert shard_frames(out) == shard_frames(spool)
    # missing: None from the client, RecordMissingError from the dataset, a timeout from fetch
    client = connect(parse_address(node))
    assert client.get(record_name(f"t/node-{codec}", "nothing")) is None
    assert connect(parse_address(tcp)).store.remove(record_name(f"t/node-{codec}", "wn-0")) == 0
    with layertap.open(node) as ds, pytest.raises(RecordMissingError, match="not in the store"):
        ds["wn-0"]
    with pytest.raises(TimeoutError):
        fetch(_location(tmp_path, tcp, "wn", "wn-9"), timeout=0.05, store=node)


def test_fetch_store_must_name_the_responses_dataset(store, tmp_path):
    location = _location(tmp_path, store.address("t/a"), "w", "k")
    with pytest.raises(InvalidInputError, match="is in mooncake://.*/t/a, not mooncake://.*/t/b"):
        fetch(location, timeout=1, store=store.node_address("t/b"))
    del location["layertap"]["store"]
    with pytest.raises(InvalidInputError, match="not in Mooncake Store"):
        fetch(location, timeout=1, store=store.node_address("t/a"))


def test_a_node_that_is_not_there_is_one_line_naming_node(store):
    with unreachable_port() as port:
        address = f"mooncake://127.0.0.1:{store.port}/t/none?node=127.0.0.1:{port}"
        with pytest.raises(
            StoreUnavailableError, match=rf"no store node answers at node=127.0.0.1:{port} .*-port={port}"
        ):
            layertap.open(address)
    # a port that answers but is no store node of this host (here: the master's)
    address = f"mooncake://127.0.0.1:{store.port}/t/none?node=127.0.0.1:{store.port}"
    with pytest.raises(StoreUnavailableError, match="is not a store node on this host.*remove node="):
        layertap.open(address)


def test_a_node_of_another_master_is_refused_before_any_read(store, tmp_path):
    """A node whose process serves another master than the address's would hand the reader that
    store's objects under the dataset's names: refused, one line naming both masters and node=,
    before anything is read (the address's master here is not even running). The same master
    spelled another way (``localhost``) is the node's, and reads."""
    with unreachable_port() as other:
        address = f"mooncake://127.0.0.1:{other}/t/other?buffer=64MiB&node=127.0.0.1:{store.node_port}"
        with pytest.raises(
            InvalidInputError,
            match=rf"node=127.0.0.1:{store.node_port} is a store node of the master at 127.0.0.1:{store.port}, "
            rf"not of this address's 127.0.0.1:{other} .*-master_server_address=127.0.0.1:{other} "
            r".*remove node= to read over the network$",
        ):
            layertap.open(address)
    want = _write_and_forward(store.address("t/spelled"), tmp_path / "spool", "ws", "bp16-zstd", n=2)
    spelled = f"mooncake://localhost:{store.port}/t/spelled?buffer=64MiB&node=127.0.0.1:{store.node_port}"
    with layertap.open(spelled, tensors="numpy") as ds:
        assert ds.keys() == list(want)


def test_a_nodes_master_from_its_command_line(tmp_path):
    """gflags' spellings of the node's flags, its flag file, and what is not one master."""
    from layertap.mooncake.node_process import _flags, same_master

    assert _flags(["-port=7", "--master_server_address", "h:1", "-v"]) == {"port": "7", "master_server_address": "h:1"}
    flagfile = tmp_path / "flags"
    flagfile.write_text("# node\n--master_server_address=10.0.0.2:50051\n-port=9\n")
    assert _flags([f"--flagfile={flagfile}", "-port=8"]) == {"master_server_address": "10.0.0.2:50051", "port": "8"}
    assert _flags([f"--flagfile={tmp_path / 'absent'}", "-port=8"]) is None  # flags not known
    assert same_master("localhost:5", "127.0.0.1:5") and not same_master("127.0.0.1:5", "127.0.0.1:6")
    assert not same_master("127.0.0.1:5", "192.0.2.1:5")


def test_writers_refuse_node(store):
    from layertap.generate.errors import GenerateError
    from layertap.generate.store import store_output

    with pytest.raises(ConfigError, match="node= is for readers"):
        parse_options({"output_dir": "/tmp/x", "mooncake": store.node_address("t/w")})
    with pytest.raises(GenerateError, match="node= is for readers"), store_output(store.node_address("t/w"), None, {}):
        pass


def test_a_node_killed_while_attached_is_unavailable_not_missing(tmp_path):
    """SIGKILL of the store node under an attached reader: reads of records that are there,
    fetches waiting for one that is not, and existence checks fail with StoreUnavailableError
    (none hangs, none reports a record missing); the dataset's master still runs."""
    store = LoopbackStore(str(tmp_path))
    try:
        tcp, node = store.address("t/killed"), store.node_address("t/killed")
        want = _write_and_forward(tcp, tmp_path / "spool", "wk", "bp16-zstd", n=2)
        ds = layertap.open(node, tensors="numpy")
        assert np.array_equal(ds["wk-0"]["hidden_states"], want["wk-0"])
        outcome: list = []
        waiting = threading.Thread(
            target=lambda: outcome.append(_raised(fetch, _location(tmp_path, tcp, "wk", "wk-9"), 600, True, node))
        )
        waiting.start()
        store.kill_node()
        waiting.join(HANG)
        assert not waiting.is_alive(), "fetch hung with its node killed"
        assert isinstance(outcome[0], StoreUnavailableError) and "cannot look for record 'wk-9'" in str(outcome[0])
        assert f"node=127.0.0.1:{store.node_port}" in str(outcome[0])
        done: list = []
        reading = threading.Thread(target=lambda: done.append(_raised(ds.__getitem__, "wk-1")))
        reading.start()
        reading.join(HANG)
        assert not reading.is_alive(), "a read hung with its node killed"
        assert isinstance(done[0], StoreUnavailableError), done
        assert "does not answer" in str(done[0]) and f"node=127.0.0.1:{store.node_port}" in str(done[0])
        assert connect(parse_address(node)).exists(record_name("t/killed", "wk-1")) is None
        ds.close()
    finally:
        store.stop()


def _raised(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # the test asserts which
        return e
    return None
