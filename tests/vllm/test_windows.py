"""Capture windows and reductions (issue 25 item 1): per request, ``window: [start, end]`` and
``reduction: "last" | "mean"`` in ``kv_transfer_params``. Through a real engine in this process
(one module engine), with chunked prefill (64 tokens a step) and prefix caching on:
each record holds its window's rows, or one vector, equal to transformers' rows (or their mean)
in float32, its metadata says which positions; bad windows are refused with a reason; only the
stored rows are copied out of the cache (the statistics' bytes)."""

from __future__ import annotations

import pytest
import torch

import layertap
from layertap.vllm import fetch
from layertap.vllm.window import check, resolve
from vllm_support import STORED_LAYERS, VLLM_WARNINGS, engine_args, read_stats, running_llm

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

FETCH_TIMEOUT = 60
ROW_BYTES = len(STORED_LAYERS) * 128 * 4  # float32


def prompt_ids(n: int, start: int = 0) -> list[int]:
    return [3 + (start + 41 * i) % 490 for i in range(n)]


def test_window_requests_resolve_as_python_slices():
    assert check({}) == (None, None)
    assert check({"window": [3, None]}) == ((3, None, None), None)
    assert check({"reduction": "mean"}) == ((None, None, "mean"), None)
    assert resolve((None, None, "last"), 10) == ((0, 10, "last"), None)
    assert resolve((-4, None, None), 10) == ((6, 10, None), None)
    assert resolve((2, -3, "mean"), 10) == ((2, 7, "mean"), None)
    assert resolve((-50, 5, None), 10) == ((0, 5, None), None)  # clipped, as a slice is
    assert resolve((8, 100, None), 10) == ((8, 10, None), None)
    for bad, why in [
        ({"window": [1]}, "window must be [start, end]"),
        ({"window": "1:5"}, "window must be [start, end]"),
        ({"window": [1.0, 5]}, "window start must be an integer or null"),
        ({"window": [1, True]}, "window end must be an integer or null"),
        ({"reduction": "max"}, "reduction must be one of 'last', 'mean'"),
    ]:
        spec, problem = check(bad)
        assert spec is None and why in problem, (bad, problem)
    window, problem = resolve((5, 5, None), 10)
    assert window is None and "holds no token" in problem
    window, problem = resolve((12, None, "mean"), 10)
    assert window is None and "holds no token" in problem


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("hs-windows")
    stats = out.parent / "stats-windows.json"
    args = engine_args(
        tiny_model,
        out,
        connector={"stats_path": str(stats)},
        enable_prefix_caching=True,
        max_num_batched_tokens=64,  # prompts longer than this are prefilled in chunks
        max_num_seqs=8,
    )
    # In this process: an engine core of its own would import vLLM again (10 to 20 s of CPU).
    with running_llm(False, **args) as llm:
        yield llm, out, stats


def generate(llm, prompts: list[list[int]], kv_params: list[dict], max_tokens: int = 2) -> list:
    from vllm import SamplingParams

    params = [
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args={"kv_transfer_params": p})
        for p in kv_params
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # An engine in this process hands the requests of its last step to the connector at the next.
    llm.llm_engine.step()
    return outputs


def assert_window(out, reference, ids: list[int], lo: int, hi: int, reduction: str | None = None):
    """The request's record holds positions [lo, hi) of ``ids`` (its recorded tokens), or their
    reduction, as transformers computes them; its metadata and its response say so."""
    rows = 1 if reduction else hi - lo
    assert out.kv_transfer_params["layertap"]["num_tokens"] == rows
    record = fetch(out.kv_transfer_params, timeout=FETCH_TIMEOUT)
    full = reference.hidden_states(ids, STORED_LAYERS)
    want = {None: full[lo:hi], "last": full[hi - 1 : hi], "mean": full[lo:hi].mean(0, keepdim=True)}[reduction]
    assert record.hidden_states.shape == (rows, len(STORED_LAYERS), 128)
    torch.testing.assert_close(record.hidden_states, want, rtol=1e-5, atol=1e-5)
    assert record.token_ids.tolist() == (ids[hi - 1 : hi] if reduction else ids[lo:hi])
    assert record.metadata["num_tokens"] == str(rows)
    assert (record.metadata["window_start"], record.metadata["window_end"]) == (str(lo), str(hi))
    assert record.metadata.get("reduction") == reduction
    assert record.metadata["num_prompt_tokens"] == str(len(out.prompt_token_ids))
    return record


def test_windows_across_chunked_prefill(engine, reference):
    """300-token prompts, prefilled 64 tokens a step: windows and reductions that span several
    chunks, one batch with a plain request beside them."""
    llm, _, _ = engine
    prompt = prompt_ids(300, start=7)
    asks = [
        ({"window": [40, 200]}, (40, 200, None)),
        ({"window": [-70, None]}, (230, 300, None)),
        ({"reduction": "last"}, (0, 300, "last")),
        ({"window": [10, -10], "reduction": "mean"}, (10, 290, "mean")),
        ({"window": [63, 65], "reduction": "mean"}, (63, 65, "mean")),  # the first chunk's end
        ({}, (0, 300, None)),
    ]
    outputs = generate(llm, [prompt] * len(asks), [p for p, _ in asks])
    for out, (params, (lo, hi, reduction)) in zip(outputs, asks):
        if not params:
            record = fetch(out.kv_transfer_params, timeout=FETCH_TIMEOUT)
            assert record.num_tokens == 300 and "window_start" not in record.metadata
            continue
        assert_window(out, reference, prompt, lo, hi, reduction)


def test_windows_over_a_prefix_cache_hit(engine, reference):
    """The second requests find the first's 96-token prefix in the cache: windows inside it, across
    its end and a mean over all of it."""
    llm, _, _ = engine
    prefix = prompt_ids(96, start=13)
    [first] = generate(llm, [prefix + prompt_ids(20, start=1)], [{"window": [90, None]}])
    assert_window(first, reference, prefix + prompt_ids(20, start=1), 90, 116)
    prompts = [prefix + prompt_ids(n, start=n) for n in (5, 40, 40)]
    asks = [
        ({"window": [5, 90]}, (5, 90, None)),
        ({"window": [80, 120], "reduction": "mean"}, (80, 120, "mean")),
        ({"reduction": "mean"}, (0, 136, "mean")),
    ]
    outputs = generate(llm, prompts, [p for p, _ in asks])
    assert all(out.num_cached_tokens >= 96 for out in outputs), [o.num_cached_tokens for o in outputs]
    for out, ids, (_, (lo, hi, reduction)) in zip(outputs, prompts, asks):
        assert_window(out, reference, ids, lo, hi, reduction)


def test_a_window_over_the_response_tokens(engine, reference):
    """RL rollouts: with include_output_tokens, a window that starts at the prompt's end holds
    the response (every generated token but the last); its loss mask is cut to the window."""
    llm, _, _ = engine
    prompt = prompt_ids(30, start=3)
    kv = {"include_output_tokens": True, "window": [30, None], "loss_mask": [0] * 10 + [1] * 20}
    last = {"include_output_tokens": True, "window": [30, None], "reduction": "last"}
    out, out_last = generate(llm, [prompt, prompt], [kv, last], max_tokens=8)
    ids = prompt + list(out.outputs[0].token_ids)[:-1]
    record = assert_window(out, reference, ids, 30, 37)
    assert record.tensors["loss_mask"].tolist() == [1] * 7
    assert list(out_last.outputs[0].token_ids) == list(out.outputs[0].token_ids)  # greedy
    assert_window(out_last, reference, ids, 30, 37, "last")


def test_bad_windows_are_refused_with_a_reason(engine):
    llm, _, _ = engine
    asks = [
        ({"window": [20, 30]}, "holds no token"),
        ({"window": [5, 5], "reduction": "mean"}, "holds no token"),
        ({"window": "0:5"}, "window must be [start, end]"),
        ({"reduction": "sum"}, "reduction must be one of"),
        ({"reduction": "last", "loss_mask": [1] * 10}, "send one or the other"),
        ({"window": [0, 4], "record_metadata": {"window_start": "3"}}, "may not set 'window_start'"),
    ]
    outputs = generate(llm, [prompt_ids(10, start=i) for i in range(len(asks))], [p for p, _ in asks])
    for out, (params, why) in zip(outputs, asks):
        answer = out.kv_transfer_params["layertap"]
        assert answer["reason"] == "invalid_request" and why in answer["error"], (params, answer)


def test_only_the_stored_rows_are_copied(engine):
    """Last test of the module: the engine's statistics count the bytes handed to the writer,
    which are the stored rows only (a 300-token request with a reduction costs one row)."""
    from vllm_support import shutdown

    llm, out_dir, stats_path = engine
    with layertap.open(out_dir) as ds:
        before = len(ds.keys())
    [out] = generate(llm, [prompt_ids(300, start=99)], [{"reduction": "mean"}])
    fetch(out.kv_transfer_params, timeout=FETCH_TIMEOUT)
    shutdown(llm)
    stats = read_stats(stats_path)
    with layertap.open(out_dir) as ds:
        assert ds.verify().ok
        records = list(ds)
    assert len(records) == before + 1
    rows = sum(r.num_tokens for r in records)
    assert stats["tokens"] == rows
    assert stats["bytes_submitted"] == rows * (ROW_BYTES + 8)
    assert stats["records_failed"] == 0
