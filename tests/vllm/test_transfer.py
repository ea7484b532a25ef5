"""The worker's hot path below vLLM (``layertap.vllm.hidden_states_saver``) on a real cache tensor, a real
pool and real writers: each step's records go to the writer in one call, and a record the writer
refuses costs only that record."""

from __future__ import annotations

import os

import pytest
import torch

import layertap
from helpers import BUSY_WRITER, busy_record, writer_class
from layertap.vllm.engine_facts import EngineFacts
from layertap.vllm.gather import HiddenStatesCache
from layertap.vllm.pool import HostPool
from layertap.vllm.stats import WorkerStats
from vllm_support import VLLM_WARNINGS

pytestmark = VLLM_WARNINGS  # the saver's module imports vLLM (in the tests, under these filters)

LAYERS, HIDDEN, BLOCK, BLOCKS = 3, 8, 4, 16


def facts() -> EngineFacts:
    return EngineFacts(
        layer_ids=(1, 2, 3),
        requested_layer_ids=(1, 2, 3),
        num_model_layers=4,
        hidden_size=HIDDEN,
        model="tiny",
        max_model_len=32,
        max_num_batched_tokens=64,
        group_id=1,
        block_size=BLOCK,
        engine_id="e",
        writer_id="w",
        tensor_parallel_size=1,
    )


def saves(*requests: tuple[str, list[int], int]):
    """The scheduler's hand-over of ``(key, blocks, tokens)`` requests (token ids from 100 x the
    first block on)."""
    from layertap.vllm.metadata import StepSaves

    out = StepSaves()
    for key, blocks, tokens in requests:
        ids = list(range(100 * blocks[0], 100 * blocks[0] + tokens))
        out.add(key, f"req-{key}", ids, tokens, tokens, blocks)
    return out


def test_records_hold_the_cache_rows_and_a_refused_one_costs_only_itself(tmp_path):
    from layertap.vllm.hidden_states_saver import HiddenStatesSaver

    # [blocks, tokens, layers, hidden] (vLLM 0.26's layout), every value distinct.
    kv = torch.arange(BLOCKS * BLOCK * LAYERS * HIDDEN, dtype=torch.float32).reshape(BLOCKS, BLOCK, LAYERS, HIDDEN)
    kv = kv.to(torch.bfloat16)  # the dtype the connector sees; records are compared with these
    cache = HiddenStatesCache(kv, LAYERS, HIDDEN, BLOCK)
    stats = WorkerStats()
    writer = writer_class()(str(tmp_path), codec="bp16-zstd")
    saver = HiddenStatesSaver(cache, writer, HostPool(1 << 20, pin=False), facts(), stats, str(tmp_path))

    saver.start(saves(("a", [3, 5], 6), ("b", [0], 4), ("c", [7, 8, 9], 9)))
    assert sorted(saver.collect()) == ["req-a", "req-b", "req-c"]  # on the CPU: copied at once
    # The next step repeats "b" (a writer-level duplicate the scheduler would have caught):
    # the batch is refused as a whole, then written one by one without it.
    saver.start(saves(("d", [10], 2), ("b", [1], 3), ("e", [11, 12], 5)))
    assert sorted(saver.collect()) == ["req-b", "req-d", "req-e"]
    saver.close()
    assert stats.records_failed == 1 and stats.records_submitted == 5 and stats.records_written == 5
    assert stats.tokens == 6 + 4 + 9 + 2 + 5

    expected = {"a": ([3, 5], 6), "b": ([0], 4), "c": ([7, 8, 9], 9), "d": ([10], 2), "e": ([11, 12], 5)}
    with layertap.open(str(tmp_path)) as ds:
        assert sorted(ds.keys()) == sorted(expected) and ds.verify().ok
        for key, (blocks, tokens) in expected.items():
            rec = ds[key]
            rows = torch.stack([kv[blocks[t // BLOCK], t % BLOCK] for t in range(tokens)])
            assert torch.equal(rec.hidden_states, rows), key
            assert rec.token_ids.tolist() == list(range(100 * blocks[0], 100 * blocks[0] + tokens))
            assert rec.metadata["request_id"] == f"req-{key}" and rec.metadata["num_tokens"] == str(tokens)


def test_the_worker_opens_the_writer_the_options_ask_for(tmp_path):
    """``open_writer`` hands the writer one ``WriterOptions``: the configured ones, the engine's
    writer id, the connector's shard metadata and its own defaults; the writer is a RecordSink."""
    from layertap.vllm.config import DEFAULT_KEY_MEMORY, parse_options
    from layertap.vllm.threads import default_writer_threads
    from layertap.vllm.worker_side import open_writer

    options = parse_options({"output_dir": str(tmp_path), "codec": "zstd", "shard_metadata": {"run": "7"}})
    with open_writer(options, facts(), pool_bytes=1 << 20) as w:
        assert isinstance(w, layertap.RecordSink) and isinstance(w, writer_class())
        assert w.writer_id == "w" and w.options.codec == "zstd" and w.options.max_inflight_bytes == 2 << 20
        assert w.options.threads == default_writer_threads()
        assert w.options.key_memory == DEFAULT_KEY_MEMORY  # bounded: a server runs for weeks
        assert dict(w.options.metadata) == {
            "source": "layertap.vllm",
            "model": "tiny",
            "layer_ids": "[1, 2, 3]",
            "run": "7",
        }


def test_a_missing_extension_is_named_as_the_writer_option(tmp_path, monkeypatch):
    """Without the compiled extension, ``ShardWriter`` raises ImportError, which the worker turns
    into a configuration error that says to build it."""
    import layertap.writer
    from layertap.vllm.config import ConfigError, parse_options
    from layertap.vllm.worker_side import open_writer

    def not_built():
        raise ImportError("layertap.ShardWriter needs the compiled extension layertap._native")

    monkeypatch.setattr(layertap.writer, "_native_class", not_built)
    with pytest.raises(
        ConfigError,
        match=r"writer: the Rust writer is not available: the native extension is not built .*build it \(make build\)$",
    ) as info:
        open_writer(parse_options({"output_dir": str(tmp_path)}), facts(), pool_bytes=1 << 20)
    assert info.value.option == "writer" and isinstance(info.value.__cause__, ImportError)


def test_a_burst_larger_than_the_pool_waits_in_the_cache_without_stalling(tmp_path):
    """Six requests finish in one step, the pool holds two: with an engine that keeps stepping
    (``wait_when_full=False``) the step gathers what fits and returns at once; the others are
    not reported done (their KV blocks stay held, and intact) and are gathered at later steps as
    the writer hands regions back. Nothing waits on the engine thread."""
    import time

    from layertap.vllm.hidden_states_saver import HiddenStatesSaver, region_bytes

    kv = torch.arange(BLOCKS * BLOCK * LAYERS * HIDDEN, dtype=torch.float32).reshape(BLOCKS, BLOCK, LAYERS, HIDDEN)
    kv = kv.to(torch.bfloat16)
    original = kv.clone()
    cache = HiddenStatesCache(kv, LAYERS, HIDDEN, BLOCK)
    stats = WorkerStats()
    pool = HostPool(2 * region_bytes(2 * BLOCK, cache), pin=False)  # two requests of two blocks
    writer = writer_class()(str(tmp_path), codec="bp16-zstd")
    saver = HiddenStatesSaver(cache, writer, pool, facts(), stats, str(tmp_path), wait_when_full=False)
    burst = [(key, [2 * i, 2 * i + 1], 2 * BLOCK) for i, key in enumerate("abcdef")]

    saver.start(saves(*burst))
    done = saver.collect()
    assert 0 < len(done) < 6 and saver.pending == 6 - len(done)
    assert stats.pool_stalls == 0 and stats.pool_deferrals >= 1
    deadline = time.monotonic() + 30
    while len(done) < 6:
        # vLLM reuses the blocks of requests reported done: the waiting ones must not care.
        for req_id in done:
            i = "abcdef".index(req_id.removeprefix("req-"))
            kv[2 * i : 2 * i + 2] = -1
        assert time.monotonic() < deadline, f"only {sorted(done)} gathered"
        time.sleep(0.01)
        step_done = saver.collect()  # a later engine step, with nothing new finished
        assert not step_done & done
        done |= step_done
    saver.close()
    assert stats.pool_stalls == 0 and stats.records_written == 6 and pool.in_use == 0
    with layertap.open(str(tmp_path)) as ds:
        assert sorted(ds.keys()) == list("abcdef") and ds.verify().ok
        for key, blocks, tokens in burst:
            rows = torch.stack([original[blocks[t // BLOCK], t % BLOCK] for t in range(tokens)])
            assert torch.equal(ds[key].hidden_states, rows), key


def test_the_default_pool_holds_a_burst_within_its_limits():
    """Without ``pool_bytes``: four full steps, or every running request at the longest length
    if more (a batch of decodes finishing together), within 256 MiB to 4 GiB, and always twice
    the largest request."""
    from layertap.vllm.config import DEFAULT_MAX_POOL_BYTES, DEFAULT_MIN_POOL_BYTES, default_pool_bytes

    mib = 1 << 20
    assert default_pool_bytes(largest_request=3 * mib, full_step=100 * mib, max_num_seqs=256) == 768 * mib
    assert default_pool_bytes(largest_request=3 * mib, full_step=200 * mib, max_num_seqs=64) == 800 * mib
    assert default_pool_bytes(largest_request=1 * mib, full_step=1 * mib, max_num_seqs=8) == DEFAULT_MIN_POOL_BYTES
    assert default_pool_bytes(largest_request=400 * mib, full_step=mib, max_num_seqs=256) == DEFAULT_MAX_POOL_BYTES
    assert default_pool_bytes(largest_request=3 << 30, full_step=mib, max_num_seqs=256) == 6 << 30


def test_the_native_sink_never_writes_into_a_region_the_writer_reads(tmp_path):
    """``NativeRegionSink`` refuses to fill or lease bytes that overlap a region still leased to
    the writer, or that lie outside the pool: the pool memory the writer reads is never written
    through it, whatever the caller asks."""
    pytest.importorskip("layertap._native")
    from layertap.errors import InvalidInputError
    from layertap.vllm.region_sinks import NativeSink

    # A busy record before the sink's: the region stays leased while the test asks to write
    # into it (CI once saw a region given back between a check of the lease and the refused call).
    writer = writer_class()(str(tmp_path), **BUSY_WRITER)
    writer.submit("busy", busy_record())
    kv = torch.zeros(BLOCKS, BLOCK, LAYERS, HIDDEN, dtype=torch.bfloat16)
    cache = HiddenStatesCache(kv, LAYERS, HIDDEN, BLOCK)
    pool = HostPool(1 << 16, pin=False)
    sink = NativeSink(writer, pool, cache, facts())
    region = pool.try_alloc(4096)
    step = saves(("a", [0], 4))
    rows = 4 * LAYERS * HIDDEN * 2
    sink.fill(step, rows, 2048)
    assert sink.submit(region, rows, step) == []
    native = sink._native
    assert native.live_regions == 1, "the busy record was already written"
    with pytest.raises(InvalidInputError, match="overlap a region the writer still reads"):
        sink.fill(step, 0, 2048)
    with pytest.raises(InvalidInputError, match="outside the pool"):
        sink.fill(step, (1 << 16) - 8, 0)
    writer.close()
    released, written = sink.reap()
    assert released == [region.id] and written == 2 and native.live_regions == 0


def test_compression_threads_yield_the_cpu_to_the_engine(tmp_path):
    """The worker lowers the priority of its writer's compression threads (Linux ``nice``, per
    thread), so that they use the CPUs vLLM leaves idle; the engine thread keeps its own, and so
    do the threads of another writer in the process (CI once saw four ``layertap-zstd-`` threads
    where the test's writer had two: a search by name lowered both writers' threads)."""
    from layertap.vllm.threads import lower_encoder_priority

    def nice_of(tids: list[int]) -> list[int]:
        return [os.getpriority(os.PRIO_PROCESS, tid) for tid in tids]

    def comm(tid: int) -> str:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()

    mine = os.getpriority(os.PRIO_PROCESS, 0)
    Writer = writer_class()
    with Writer(str(tmp_path / "a"), threads=2) as ours, Writer(str(tmp_path / "b"), threads=3) as other:
        tids, others = ours.encoder_thread_ids, other.encoder_thread_ids
        assert len(tids) == 2 and len(others) == 3 and not set(tids) & set(others)
        assert all(comm(tid).startswith("layertap-zstd-") for tid in tids + others)
        before, others_before = nice_of(tids), nice_of(others)
        assert lower_encoder_priority(tids, 3) == 2
        assert nice_of(tids) == [min(19, b + 3) for b in before]
        assert nice_of(others) == others_before
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine
    assert lower_encoder_priority([]) == 0


def test_the_gpu_paths_thread_has_a_name_the_os_shows():
    """The GPU path's compressing thread names itself where ``/proc`` (and so top, py-spy and
    benches/gpu/threads.py) shows it: a thread started from Python keeps the process's name,
    and on the H200 its CPU time was counted as the engine's."""
    import threading

    from layertap.vllm.threads import GPU_COMPRESS_THREAD, name_this_thread

    seen = {}

    def named():
        seen["named"] = name_this_thread(GPU_COMPRESS_THREAD)
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            seen["comm"] = f.read().strip()

    thread = threading.Thread(target=named)
    thread.start()
    thread.join()
    assert seen == {"named": True, "comm": "layertap-gpu"}
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        assert f.read().strip() != "layertap-gpu"  # only the calling thread is renamed
    assert len(GPU_COMPRESS_THREAD) <= 15  # what Linux keeps of a thread's name


def test_the_sink_and_write_indices_fill_the_indices_of_the_layout_vector(tmp_path):
    """``NativeSink`` (the Rust layout, through ``NativeRegionSink.fill``) writes the token ids
    and the indices of tests/vectors/layout.json into the pool, and Python's ``write_indices``
    (which the capture windows gather with) the same indices, for every cache layout there."""
    import json

    import numpy as np

    from helpers import VECTORS
    from layertap.vllm.metadata import StepSaves
    from layertap.vllm.region_sinks import NativeSink

    for case in json.loads((VECTORS / "layout.json").read_text(encoding="utf-8"))["cases"]:
        shape, strides = case["kv_shape"], case["kv_strides"]
        storage = torch.zeros(1 + sum((n - 1) * s for n, s in zip(shape, strides)), dtype=torch.bfloat16)
        kv = torch.as_strided(storage, shape, strides)
        cache = HiddenStatesCache(kv, case["num_layers"], case["hidden_size"], case["block_size"])
        writer = writer_class()(str(tmp_path / case["name"]), codec="none")
        pool = HostPool(1 << 16, pin=False)
        sink = NativeSink(writer, pool, cache, facts())
        step = StepSaves()
        for i, r in enumerate(case["requests"]):
            n = r["num_tokens"]
            step.add(f"k{i}", f"r{i}", [1000 * i + t for t in range(n + 2)], n, n, r["block_ids"])
        total = len(case["indices"])
        sink.fill(step, 1024, 8192)
        buf = pool.buffer.numpy()
        ids = buf[1024 : 1024 + total * 8].view(np.int64).tolist()
        assert ids == [1000 * i + t for i, r in enumerate(case["requests"]) for t in range(r["num_tokens"])]
        index = buf[8192 : 8192 + total * case["index_width"] * 8].view(np.int64).reshape(total, -1)
        assert index.tolist() == case["indices"], case["name"]
        python = np.zeros_like(index)
        cache.write_indices([(r["block_ids"], r["num_tokens"]) for r in case["requests"]], python)
        assert python.tolist() == case["indices"], case["name"]
        writer.close()
