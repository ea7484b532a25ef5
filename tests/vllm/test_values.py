"""Recorded hidden states equal transformers' at the requested layers, through real vLLM engines
(engine core in its own process, as vLLM runs by default; its worker in that process too, as
vLLM runs one GPU: ``WORKER_IN_THE_ENGINE_PROCESS``), in bfloat16.

Each record is read with ``layertap.vllm.fetch`` right after ``generate`` returns: the engine
must write finished requests without being asked (it keeps stepping while the connector holds
their blocks)."""

from __future__ import annotations

import pytest
import torch

import layertap
from layertap.vllm import fetch
from vllm_support import (
    STORED_LAYERS,
    VLLM_WARNINGS,
    WORKER_IN_THE_ENGINE_PROCESS,
    assert_hidden_states_match,
    engine_args,
    read_stats,
    running_llm,
)

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

FETCH_TIMEOUT = 60


class Engine:
    """A running LLM and every request given to it."""

    def __init__(self, llm, output_dir, stats_path):
        self.llm = llm
        self.output_dir = output_dir
        self.stats_path = stats_path
        self.expected: dict[str, list[int]] = {}
        """Record key -> the token ids its record must hold."""

    def generate(self, prompts: list[list[int]], max_tokens: int = 4, kv_params: list[dict] | None = None):
        from vllm import SamplingParams

        params = [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=0.0,
                ignore_eos=True,
                extra_args={"kv_transfer_params": p} if p else None,
            )
            for p in (kv_params or [None] * len(prompts))
        ]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for out, p in zip(outputs, kv_params or [{}] * len(prompts)):
            loc = out.kv_transfer_params["layertap"]
            ids = list(out.prompt_token_ids)
            if (p or {}).get("include_output_tokens"):
                ids += list(out.outputs[0].token_ids)[:-1]
            self.expected[loc["key"]] = ids
        return outputs


def burst_pool(dtype: str) -> int:
    """A pool that holds the largest request (512 tokens) but not two of the decode burst's
    (307 tokens each, ``test_a_decode_burst_larger_than_the_pool``): requests reach an engine in
    its own process one by one, so the burst's requests may end over a few steps; any two of
    them ending in one step must wait in the KV cache."""
    from types import SimpleNamespace

    from layertap.vllm.hidden_states_saver import region_bytes

    layers = len(STORED_LAYERS)
    cache = SimpleNamespace(row_bytes=layers * 128 * (4 if dtype == "float32" else 2), index_width=layers)
    largest, two = region_bytes(512, cache), 2 * region_bytes(8 + 299, cache)
    assert largest < two
    return (largest + two) // 2


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("hs")
    stats = out.parent / "stats.json"
    args = engine_args(
        tiny_model,
        out,
        dtype="bfloat16",
        connector={"stats_path": str(stats), "codec": "bp16-zstd", "pool_bytes": burst_pool("bfloat16")},
        enable_prefix_caching=True,
        max_num_batched_tokens=64,  # prompts longer than this are prefilled in chunks
        max_num_seqs=8,
        distributed_executor_backend=WORKER_IN_THE_ENGINE_PROCESS,
    )
    with running_llm(True, **args) as llm:
        yield Engine(llm, out, stats)


def prompt_ids(n: int, start: int = 0) -> list[int]:
    """``n`` varied token ids of the tiny vocabulary (3.., past the special tokens)."""
    return [3 + (start + 37 * i) % 490 for i in range(n)]


def test_one_request(engine, reference, tiny_model):
    [out] = engine.generate([prompt_ids(20)])
    loc = out.kv_transfer_params["layertap"]
    assert loc["dataset"] == str(engine.output_dir)
    # vLLM suffixes the caller's request id to make its own; the key is vLLM's.
    assert loc["key"].startswith(f"{out.request_id}-")
    assert loc["num_tokens"] == 20
    record = fetch(out.kv_transfer_params, timeout=FETCH_TIMEOUT)
    assert record.key == loc["key"] == record.metadata["request_id"] == loc["request_id"]
    assert record.metadata["model"] == tiny_model
    assert record.metadata["num_prompt_tokens"] == "20"
    assert_hidden_states_match(record, reference, list(out.prompt_token_ids))


def test_batch_of_different_lengths(engine, reference):
    lengths = [1, 7, 33, 64, 100]
    outputs = engine.generate([prompt_ids(n, start=n) for n in lengths], max_tokens=3)
    for n, out in zip(lengths, outputs):
        record = fetch(out.kv_transfer_params, timeout=FETCH_TIMEOUT)
        assert record.num_tokens == n
        assert_hidden_states_match(record, reference, list(out.prompt_token_ids))


def test_chunked_prefill(engine, reference):
    # 300 prompt tokens with at most 64 tokens per step: five prefill chunks.
    [out] = engine.generate([prompt_ids(300, start=5)], max_tokens=2)
    record = fetch(out.kv_transfer_params, timeout=FETCH_TIMEOUT)
    assert_hidden_states_match(record, reference, list(out.prompt_token_ids))


def test_prefix_caching_with_shared_prefixes(engine, reference):
    prefix = prompt_ids(96, start=11)  # three full blocks of 32
    [first] = engine.generate([prefix + prompt_ids(10, start=1)])
    outputs = engine.generate([prefix + prompt_ids(n, start=n) for n in (5, 40)])
    assert all(out.num_cached_tokens >= 96 for out in outputs), [o.num_cached_tokens for o in outputs]
    for out in [first, *outputs]:
        record = fetch(out.kv_transfer_params, timeout=FETCH_TIMEOUT)
        assert_hidden_states_match(record, reference, list(out.prompt_token_ids))


def test_include_output_tokens_and_sample_id(engine, reference):
    sample_id = "sample #1"
    [out] = engine.generate(
        [prompt_ids(12, start=3)], max_tokens=6, kv_params=[{"include_output_tokens": True, "sample_id": sample_id}]
    )
    generated = list(out.outputs[0].token_ids)
    assert len(generated) == 6
    loc = out.kv_transfer_params["layertap"]
    assert loc["key"] == sample_id
    assert loc["num_tokens"] == 12 + 5
    record = fetch(out.kv_transfer_params, timeout=FETCH_TIMEOUT)
    assert record.key == sample_id
    assert record.metadata["request_id"].startswith(f"{out.request_id}-")
    assert record.metadata["num_prompt_tokens"] == "12"
    # Prompt and every output but the last (which was never fed back into the model).
    assert_hidden_states_match(record, reference, list(out.prompt_token_ids) + generated[:-1])


def test_a_decode_burst_larger_than_the_pool(engine, reference):
    """Eight requests prefilled in one step decode together and finish in the same step with
    more hidden states than the whole pool (8 x 307 tokens): the engine does not wait for the
    writer; what does not fit waits in the KV cache, its blocks held, and is gathered at the
    next steps (the last test checks that the connector deferred and never stalled)."""
    prompts = [prompt_ids(8, start=600 + 11 * i) for i in range(8)]
    outputs = engine.generate(prompts, max_tokens=300, kv_params=[{"include_output_tokens": True}] * 8)
    for out in outputs:
        record = fetch(out.kv_transfer_params, timeout=FETCH_TIMEOUT)
        assert record.num_tokens == 8 + 299
        assert_hidden_states_match(record, reference, list(out.prompt_token_ids) + list(out.outputs[0].token_ids)[:-1])


def test_every_request_has_exactly_one_record(engine, reference):
    """Last test of the module: shuts the engine down, then reads the whole dataset."""
    from vllm_support import shutdown

    shutdown(engine.llm)
    # The sockets of vLLM's output thread are its own to close: shutdown waits for the thread
    # before destroying the context (else libzmq can abort the process, closing one socket from
    # two threads).
    client = engine.llm.llm_engine.engine_core
    assert not client.output_queue_thread.is_alive()
    assert client.ctx.closed
    with layertap.open(engine.output_dir) as ds:
        assert sorted(ds.keys()) == sorted(engine.expected)
        assert ds.verify().ok
        assert all(s.complete for s in ds.shards)
        for rec in ds:
            assert rec.token_ids.tolist() == engine.expected[rec.key]
            assert rec.layer_ids == STORED_LAYERS
            assert rec.hidden_states.dtype == torch.bfloat16
    stats = read_stats(engine.stats_path)
    assert stats["records_written"] == stats["records_submitted"] == len(engine.expected)
    assert stats["records_failed"] == 0
    assert stats["writer"]["backend"] in ("io_uring", "pwrite")
    # Every region came back to the pool; the hook ran every step and was timed.
    assert stats["pool"]["in_use_bytes"] == 0 and stats["pool"]["live_regions"] == 0
    assert stats["hook"]["steps"] > 0 and stats["hook"]["p99_us"] >= stats["hook"]["p50_us"] > 0
    assert stats["gathers"] >= 1
    # The hook's parts are timed.
    parts = stats["hook_parts_s"]
    assert set(parts) == {"launch", "submit", "reap"} and all(v > 0 for v in parts.values())
    # The decode burst waited in the KV cache, not on the engine thread.
    assert stats["pool_deferrals"] > 0 and stats["pool_stalls"] == 0
