"""Records through Mooncake Store with real vLLM and a real store on loopback (docs/MOONCAKE.md):
``layertap generate --out mooncake://...`` drained by ``layertap pull`` into shards whose records
are byte for byte a run to disk's; a served engine whose records another process fetches from
the store, equal to transformers', and that keeps serving when the master is killed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from generate_support import TINY_ENGINE_ARGS, id_rows, write_jsonl
from serve_support import one_value, prompt_ids, start_server
from store_support import LoopbackStore, shard_frames, unreachable_port

import layertap
from layertap.reader import Record
from vllm_support import (
    VLLM_WARNINGS,
    assert_hidden_states_match,
    collections_of_young_objects,
    connector_config,
    pytest_env,
    read_stats,
    speculative_config,
)

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def store(tmp_path):
    s = LoopbackStore(str(tmp_path))
    try:
        yield s
    finally:
        s.stop()


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "python")}
    return subprocess.run(
        [sys.executable, "-m", "layertap", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_generate_into_the_store_then_pull(store, tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", id_rows(300, 3, 24))
    args = {"max_len": 64, "progress": "none", "engine_args": {**TINY_ENGINE_ARGS, "dtype": "float32"}}
    address = store.address("gen/run1")
    disk = tmp_path / "disk"
    with collections_of_young_objects(), pytest_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
        summary = layertap.generate(tiny_model, data, address, also_dir=disk, **args)
    assert summary["complete"] and summary["rows_written"] == 300 and summary["out"] == address
    pulled = tmp_path / "pulled"
    r = _cli("pull", address, str(pulled))
    assert r.returncode == 0 and "300 records" in r.stdout, r.stdout + r.stderr
    r = _cli("verify", str(pulled))
    assert r.returncode == 0, r.stdout + r.stderr
    assert _cli("verify", address).returncode == 0
    # the same frames, byte for byte, as the run wrote to disk
    frames = shard_frames(pulled)
    assert len(frames) == 300 and frames == shard_frames(disk)
    with layertap.open(address) as ds, layertap.open(str(pulled)) as back:
        assert ds.keys() == back.keys()
        assert torch.equal(ds["7"].hidden_states, back["7"].hidden_states)


def test_a_run_whose_puts_failed_keeps_its_spool_and_a_rerun_puts_them(store, tiny_model, tmp_path, monkeypatch):
    """The master is killed while a run (with a capture window) puts its records: the run is not
    complete, says so, and keeps its temporary spool (the only full copy); a rerun with that spool
    as --also-dir into a store that came back (a new master) generates nothing and puts every
    record, windowed as asked."""
    import tempfile
    import threading

    data = write_jsonl(tmp_path / "rows.jsonl", id_rows(300, 3, 24))
    args = {"max_len": 64, "progress": "none", "engine_args": {**TINY_ENGINE_ARGS, "dtype": "float32"}}
    spools = tmp_path / "tmp"
    spools.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spools))  # where the run's temporary spool goes
    stop = threading.Event()

    def kill_master_once_records_are_spooled():
        while not stop.is_set():
            shards = [f for d in spools.iterdir() for f in d.glob("*.lts")]
            if any(f.stat().st_size > 64 << 10 for f in shards):
                store.kill_master()
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_master_once_records_are_spooled)
    killer.start()
    try:
        with collections_of_young_objects(), pytest_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
            summary = layertap.generate(tiny_model, data, store.address("gen/cut"), window=[1, None], **args)
    finally:
        stop.set()
        killer.join()
    assert store.master.poll() is not None, "the run ended before the master was killed"
    assert summary["rows_written"] == 300 and not summary["complete"]
    # None: the store could not be reached to tell what it lacks
    assert summary["store_missing"] is None
    spool = summary["also_dir"]
    assert spool and os.path.dirname(spool) == str(spools)
    with layertap.open(spool) as ds:
        assert len(ds) == 300
    from layertap.generate.summary import summary_text

    assert f"the spool {spool} holds them and is kept" in summary_text(summary)

    (tmp_path / "again").mkdir()
    again = LoopbackStore(str(tmp_path / "again"))
    try:
        address = again.address("gen/cut")
        with collections_of_young_objects(), pytest_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
            s = layertap.generate(tiny_model, data, address, also_dir=spool, window=[1, None], **args)
        assert s["complete"] and s["rows_written"] == 0 and s["rows_done_before"] == 300 and s["store_missing"] == 0
        with layertap.open(address) as ds, layertap.open(spool) as local:
            assert ds.keys() == local.keys() and len(ds) == 300 and ds.verify().ok
            rec, row = ds["7"], local["7"]
            assert rec.metadata["window_start"] == "1" and rec.num_tokens == row.num_tokens
            assert torch.equal(rec.hidden_states, row.hidden_states)
    finally:
        again.stop()


def test_a_store_too_small_for_the_run_is_counted_and_fails_the_command(
    tiny_model, tmp_path, capfd, monkeypatch, in_process_command
):
    """The command into a store too small for the run (records of ~75 KiB each, 20 MiB of them,
    into 16 MiB): the later puts evict the first records, or fail. The summary counts every
    record the store no longer holds once the run is over (``store_missing``, the evicted among
    them in ``store_evicted``), the exit status is 1, the spool is kept, and nothing of
    Mooncake's own log is in the command's output."""
    import layertap.generate as generate_module
    from layertap.cli import main as layertap_cli

    # in_process_command: the engine in this process, and the variables the command sets for
    # vLLM's logging (VLLM_LOGGING_CONFIG_PATH) undone after it. Left set, they made a later
    # test's engine, in a child process of this worker, load layertap's logging handler
    # (test_config.py's test_no_cost_without_the_connector, when this file ran first).
    (tmp_path / "store").mkdir()
    # Leases of an hour: what the summary's check finds in the store is not evicted after it
    # (Mooncake's master evicts in a thread of its own, only objects whose lease has run out:
    # see LoopbackStore), so what this test reads back is what the summary counted.
    small = LoopbackStore(str(tmp_path / "store"), segment="16MB", lease_ttl="1h")
    settle = generate_module.settle_store_run

    def settle_once_evicted(*args):
        # The master's eviction thread may not have run yet when the command settles (it then
        # rightly counts nothing evicted): the step waits for the master to have evicted a
        # record (a handshake on its count), then runs as it is.
        small.wait_evicted(1)
        return settle(*args)

    monkeypatch.setattr(generate_module, "settle_store_run", settle_once_evicted)
    try:
        address = small.address("gen/small")
        data = write_jsonl(tmp_path / "rows.jsonl", id_rows(300, 40, 60))
        engine_args = json.dumps({**TINY_ENGINE_ARGS, "dtype": "float32"})
        args = ["generate", tiny_model, "--data", data, "--out", address, "--max-len", "64", "--json"]
        args += ["--progress", "none", "--engine-args", engine_args, "--connector-args", '{"codec": "none"}']
        status = layertap_cli(args)
        out, err = capfd.readouterr()
        summary = json.loads(out)
        with layertap.open(address) as ds:
            report = ds.verify()
        evicted = small.evicted_keys()
    finally:
        small.stop()
    assert status == 1 and not summary["complete"], err[-3000:]
    gone = [p.key for p in report.problems if p.kind == "missing_record" and p.key]
    assert summary["rows_written"] == 300 and summary["store_missing"] == 300 - report.records_ok
    # Every record verify finds gone is counted as evicted (and only those); the master evicted
    # them at least (its count also takes other objects of the run, such as an index chunk:
    # a fresh-clone CI run saw 108 evicted keys for 97 records gone).
    assert summary["store_evicted"] == len(gone) > 0 and summary["store_refused"] == 0
    assert evicted >= len(gone)
    with layertap.open(summary["also_dir"]) as spool:
        assert len(spool) == 300  # the only full copy, kept
    glog = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]|Logging before InitGoogleLogging", re.M)
    assert not glog.search(out + err), err[-3000:]


def test_unreachable_master_is_one_line_before_the_engine_starts(tiny_model, tmp_path):
    """The command, in a process of its own, stops with status 2 and one line, vLLM never
    imported (so no engine started), nothing written."""
    data = write_jsonl(tmp_path / "rows.jsonl", id_rows(3, 3, 5))
    child = (
        "import sys\nfrom layertap.cli import main\nstatus = main(sys.argv[1:])\n"
        "print('vllm imported' if sys.modules.get('vllm') is not None else 'vllm not imported')\nsys.exit(status)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "python")}
    with unreachable_port() as port:
        args = ["generate", tiny_model, "--data", data, "--out", f"mooncake://127.0.0.1:{port}/x"]
        r = subprocess.run(
            [sys.executable, "-c", child, *args], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path
        )
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert f"cannot reach the Mooncake master at 127.0.0.1:{port}" in r.stderr and "mooncake_master" in r.stderr
    assert r.stdout.strip().splitlines()[-1] == "vllm not imported"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl"]


FETCH = """
import json, sys, torch
from layertap.vllm import fetch
got = []
for params in json.loads(sys.argv[1]):
    r = fetch(params, timeout=60)
    got.append({"key": r.key, "tensors": dict(r.tensors), "metadata": r.metadata, "shard": r.shard})
torch.save(got, sys.argv[2])
"""


def _fetch_elsewhere(params: list[dict], path) -> list[Record]:
    """The records, fetched by another process (one for all: each started one imports torch)."""
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "python")}
    subprocess.run([sys.executable, "-c", FETCH, json.dumps(params), str(path)], check=True, env=env, timeout=120)
    return [
        Record(g["key"], g["tensors"], g["metadata"], g["shard"], 0, len(g["tensors"]["token_ids"]))
        for g in torch.load(path)
    ]


#: Seconds into the server's stop after which a worker that has not written its statistics
#: prints every thread's Python stack into server.log (``_stop``). vLLM's server kills the engine
#: and its worker 30 s into the stop: once in fresh-clone CI (2026-12-06) the worker's shutdown
#: stalled before its writer's close, and the log did not say where.
STALL_DUMP_AFTER = 25.0


def _worker_pid(server) -> int | None:
    """The pid of the server's (one) worker, as its log lines name it, if it still runs."""
    found = re.search(r"\(Worker pid=(\d+)\)", server.log_path.read_text(errors="replace"))
    if found is None:
        return None
    pid = int(found.group(1))
    try:
        with open(f"/proc/{pid}/comm") as f:
            return pid if f.read().strip() == "VLLM::Worker" else None  # not a pid taken since
    except OSError:
        return None


def _stop(server, stats) -> int:
    """``server.stop()``; where the worker has not written ``stats`` ``STALL_DUMP_AFTER`` s into
    it, the worker is sent SIGABRT first: with PYTHONFAULTHANDLER set (the test sets it before
    the start), Python prints every thread's stack, whatever thread holds the GIL, then aborts."""
    stopped = threading.Event()

    def dump_if_stalled() -> None:
        if stopped.wait(STALL_DUMP_AFTER) or stats.exists():
            return
        pid = _worker_pid(server)
        if pid is not None:
            os.kill(pid, signal.SIGABRT)

    watch = threading.Thread(target=dump_if_stalled, name="stall-dump")
    watch.start()
    try:
        return server.stop()
    finally:
        stopped.set()
        watch.join()


@pytest.mark.slow
@pytest.mark.timeout(600)  # a store, a server start (up to 240 s), requests, a clean stop
def test_served_engine_through_the_store(store, tiny_model, reference, tmp_path, monkeypatch):
    spool, stats = tmp_path / "spool", tmp_path / "stats.json"
    monkeypatch.setenv("PYTHONFAULTHANDLER", "1")  # a stalled stop prints the stacks (_stop)
    address = store.address("serve")
    connector = connector_config(
        spool, stats_path=str(stats), writer_id="serve-mc", mooncake=address, mooncake_keep_shards=True
    )
    server = start_server(tiny_model, connector, speculative_config(), tmp_path, max_model_len=256)
    try:
        prompts = [prompt_ids(17, 1), prompt_ids(33, 2)]
        params = [
            server.complete(prompt, 2, {"sample_id": f"mc-{i}"})["kv_transfer_params"]
            for i, prompt in enumerate(prompts)
        ]
        assert [p["layertap"]["store"] for p in params] == [address.split("?")[0]] * 2, params
        records = _fetch_elsewhere(params, tmp_path / "records.pt")
        for i, (record, prompt) in enumerate(zip(records, prompts, strict=True)):
            assert record.key == f"mc-{i}" and record.shard == f"{address.split('?')[0]}#serve-mc"
            assert_hidden_states_match(record, reference, prompt)
        # The master goes away: the engine keeps serving, the records stay in the spool and are
        # counted as failed.
        store.kill_master()
        for i in range(2, 4):
            resp = server.complete(prompt_ids(20, i), 2, {"sample_id": f"mc-{i}"})
            assert resp["choices"][0]["text"] is not None
        deadline = time.monotonic() + 60
        while True:  # the failures reach /metrics as the engine steps: a request it saves nothing of steps it
            server.complete(prompt_ids(5, 9), 1, {"sample_id": "../not-saved"})
            samples = server.metrics()
            failed = samples.get("layertap_store_records_failed_total")
            if failed and one_value(samples, "layertap_store_records_failed_total") == 2:
                break
            assert time.monotonic() < deadline, samples.get("layertap_store_records_failed_total")
            time.sleep(0.5)
        assert one_value(samples, "layertap_store_records_put_total") == 2
    finally:
        assert _stop(server, stats) == 0, server.log_tail()
    mooncake = read_stats(stats)["mooncake"]
    assert mooncake["records_put"] == 2 and mooncake["records_failed"] == 2, mooncake
    r = _cli("verify", str(spool))
    assert r.returncode == 0 and "4 records ok" in r.stdout, r.stdout + r.stderr
