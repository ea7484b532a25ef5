"""The worker's hot path below vLLM (``layertap.vllm.transfer``) on a real cache tensor, a real
pool and real writers: each step's records go to the writer in one call, and a record the writer
refuses costs only that record."""

from __future__ import annotations

import pytest
import torch

import layertap
from helpers import writer_class
from layertap.vllm.engine import EngineFacts
from layertap.vllm.gather import HiddenStatesCache
from layertap.vllm.pool import HostPool
from layertap.vllm.stats import ConnectorStats
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


@pytest.mark.parametrize("kind", ["rust", "python"])
def test_records_hold_the_cache_rows_and_a_refused_one_costs_only_itself(tmp_path, kind):
    from layertap.vllm.transfer import HiddenStatesSaver

    # [blocks, tokens, layers, hidden] (vLLM 0.26's layout), every value distinct.
    kv = torch.arange(BLOCKS * BLOCK * LAYERS * HIDDEN, dtype=torch.float32).reshape(BLOCKS, BLOCK, LAYERS, HIDDEN)
    kv = kv.to(torch.bfloat16)  # the dtype the connector sees; records are compared with these
    cache = HiddenStatesCache(kv, LAYERS, HIDDEN, BLOCK)
    stats = ConnectorStats()
    writer = writer_class(kind)(str(tmp_path), codec="bp16-zstd")
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


@pytest.mark.parametrize("kind", ["rust", "python"])
def test_the_worker_opens_the_writer_the_options_ask_for(tmp_path, kind):
    """``open_writer`` hands the writer one ``WriterOptions``: the configured ones, the engine's
    writer id, the connector's shard metadata and its own defaults; the writer is a RecordSink."""
    from layertap.vllm.config import default_writer_threads, parse_options
    from layertap.vllm.worker import open_writer

    options = parse_options(
        {"output_dir": str(tmp_path), "writer": kind, "codec": "zstd", "shard_metadata": {"run": "7"}}
    )
    with open_writer(options, facts(), pool_bytes=1 << 20) as w:
        assert isinstance(w, layertap.RecordSink) and isinstance(w, writer_class(kind))
        assert w.writer_id == "w" and w.options.codec == "zstd" and w.options.max_inflight_bytes == 2 << 20
        assert w.options.threads == default_writer_threads()
        assert dict(w.options.metadata) == {
            "source": "layertap.vllm",
            "model": "tiny",
            "layer_ids": "[1, 2, 3]",
            "run": "7",
        }


def test_a_missing_extension_is_named_as_the_writer_option(tmp_path, monkeypatch):
    """Without the compiled extension, ``ShardWriter`` raises ImportError, which the worker turns
    into a configuration error that says to build it or use the Python writer."""
    import layertap.writer
    from layertap.vllm.config import ConfigError, parse_options
    from layertap.vllm.worker import open_writer

    def not_built():
        raise ImportError("layertap.ShardWriter needs the compiled extension layertap._native")

    monkeypatch.setattr(layertap.writer, "_native_class", not_built)
    with pytest.raises(ConfigError, match="writer: the Rust writer is not available .*use writer='python'") as info:
        open_writer(parse_options({"output_dir": str(tmp_path)}), facts(), pool_bytes=1 << 20)
    assert info.value.option == "writer" and isinstance(info.value.__cause__, ImportError)
