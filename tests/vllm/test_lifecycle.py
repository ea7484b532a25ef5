"""Requests that do not simply run to their end, on an engine in the test's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): preemption for lack of KV space, a host pool too small for
what finishes in one step, aborts, and the requests an in-process engine has not handed to the
connector when it shuts down."""

from __future__ import annotations

import pytest

import layertap
from layertap.vllm import fetch
from vllm_support import VLLM_WARNINGS, assert_hidden_states_match, engine_args, read_stats, running_llm, shutdown

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

#: 40 blocks of 32 tokens: one 512-token request fits, three 300-token ones too, eight do not.
PAGE_BYTES = 32 * (4 * 2 * 64 + 3 * 128) * 4  # per block: 4 attention layers (K, V) + 3 hidden-state rows
KV_CACHE_BYTES = 40 * PAGE_BYTES


def prompt_ids(n: int, start: int) -> list[int]:
    return [3 + (start + 13 * i) % 490 for i in range(n)]


def metric(llm, name: str) -> float:
    values = [m.value for m in llm.get_metrics() if m.name == name]
    assert values, f"no metric {name}"
    return sum(values)


def sampling(max_tokens: int, kv_params: dict | None = None):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        extra_args={"kv_transfer_params": kv_params} if kv_params else None,
    )


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("hs-lifecycle")
    stats = out.parent / "stats-lifecycle.json"
    args = engine_args(
        tiny_model,
        out,
        # A pool for little more than the largest request (512 tokens x 1568 bytes): requests that
        # finish together do not fit at once, and the connector must wait for the writer.
        connector={"stats_path": str(stats), "pool_bytes": 1 << 20},
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_num_seqs=8,
        enable_prefix_caching=False,
        disable_log_stats=False,
    )
    with running_llm(False, **args) as llm:
        yield llm, out, stats


def hand_over(llm) -> None:
    """One more engine step: an in-process engine is only stepped while it has unfinished
    requests, and hands the requests that finished in its last step to the connector at the
    next one."""
    llm.llm_engine.step()


def test_preempted_requests_are_saved_whole(engine, reference):
    llm, _, _ = engine
    prompts = [prompt_ids(200, start=s) for s in range(8)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling(100), use_tqdm=False)
    assert metric(llm, "vllm:num_preemptions") > 0
    hand_over(llm)
    for out in outputs:
        record = fetch(out.kv_transfer_params, timeout=30)
        assert_hidden_states_match(record, reference, list(out.prompt_token_ids))
    assert metric(llm, "vllm:kv_cache_usage_perc") == 0


def test_full_pool_waits_for_the_writer(engine, reference):
    """Three requests finishing in one step need more than the whole pool (3 x 300 x 1568 bytes):
    the connector gathers what fits, waits for the writer to free the pool, gathers the rest."""
    llm, _, _ = engine
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    stalls = get_kv_transfer_group().layertap_stats()["pool_stalls"]
    prompts = [prompt_ids(300, start=100 + s) for s in range(3)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling(2), use_tqdm=False)
    hand_over(llm)
    assert get_kv_transfer_group().layertap_stats()["pool_stalls"] > stalls
    for out in outputs:
        assert_hidden_states_match(fetch(out.kv_transfer_params, timeout=30), reference, list(out.prompt_token_ids))


def test_aborted_request_leaves_no_record_and_no_blocks(engine):
    llm, _out_dir, _ = engine
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    engine_api = llm.llm_engine
    engine_api.add_request(
        "to-abort", {"prompt_token_ids": prompt_ids(150, start=3)}, sampling(300, {"sample_id": "aborted"})
    )
    generated = 0
    while generated < 3:
        for out in engine_api.step():
            generated = len(out.outputs[0].token_ids)
    engine_api.abort_request(["to-abort"])
    while engine_api.has_unfinished_requests():
        engine_api.step()
    hand_over(llm)
    assert metric(llm, "vllm:kv_cache_usage_perc") == 0
    stats = get_kv_transfer_group().layertap_stats()
    assert stats["pool"]["in_use_bytes"] == 0 and stats["pool"]["live_regions"] == 0
    # The engine goes on: a later request is saved under the same sample id.
    [ok] = llm.generate(
        [{"prompt_token_ids": prompt_ids(10, start=1)}], sampling(2, {"sample_id": "aborted"}), use_tqdm=False
    )
    hand_over(llm)
    record = fetch(ok.kv_transfer_params, timeout=30)
    assert record.key == "aborted" and record.num_tokens == 10


def test_last_requests_are_written_at_shutdown(engine, reference):
    """Last test of the module: the engine is shut down right after generate returns."""
    llm, out_dir, stats_path = engine
    prompts = [prompt_ids(n, start=n) for n in (33, 70)]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], sampling(3, {"include_output_tokens": True}), use_tqdm=False
    )
    keys = [out.kv_transfer_params["layertap"]["key"] for out in outputs]
    shutdown(llm)
    with layertap.open(out_dir) as ds:
        assert "aborted" in ds and ds["aborted"].num_tokens == 10  # the later request, not the aborted one
        for key, out in zip(keys, outputs):
            ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)[:-1]
            assert_hidden_states_match(ds[key], reference, ids)
        assert ds.verify().ok and len(ds) == 8 + 3 + 1 + 2
    stats = read_stats(stats_path)
    assert stats["saved_at_shutdown"] == 2
    assert stats["records_written"] == 14 and stats["pool"]["in_use_bytes"] == 0
    assert stats["pool_stalls"] > 0 and stats["pool"]["high_water_bytes"] <= 1 << 20
