"""The connector on a GPU machine (vLLM 0.26 + CUDA): ``python tests/vllm/gpu_check.py OUT_DIR``.

Not a pytest module (the GPU machine has no pytest); the CPU tests cover the same cases on vLLM
0.32. Two engines, each checked against transformers:

- a 4-layer tiny Llama in bfloat16 with CUDA graphs, layers [4, 0, 2]: a batch of prompts of
  different lengths, a prompt prefilled in chunks, shared prefixes, include_output_tokens, capture
  windows and reductions; each record read with ``layertap.vllm.fetch`` right after ``generate``
  returns;
- a 16-layer one recording 16 layers, as many as a block has tokens, so the cache's layer and
  token axes have the same size.

Prints one JSON line per engine (records, connector statistics) and exits non-zero on a mismatch.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_llama

import torch

from layertap.vllm import fetch
from tiny_llama import build_tiny_llama
from vllm_support import Reference, assert_hidden_states_match, connector_config, speculative_config


def prompt_ids(n: int, start: int) -> list[int]:
    return [3 + (start + 37 * i) % 490 for i in range(n)]


def diagnose(record, reference, ids: list[int], layers: list[int]) -> None:
    """Which reference (token, layer) each recorded row is closest to."""
    got = record.hidden_states.float()
    ref = reference.hidden_states(ids, layers, torch.float32)
    print(f"MISMATCH {record.key}: {len(ids)} tokens, shape {list(got.shape)}", flush=True)
    flat = ref.reshape(-1, ref.shape[-1])
    for t in range(min(len(ids), 20)):
        best = [int((flat - got[t, j]).abs().mean(-1).argmin()) for j in range(got.shape[1])]
        print(f"  token {t}: rows match (token, layer) {[divmod(b, ref.shape[1]) for b in best]}", flush=True)


def run_engine(name: str, model: str, out: Path, layers: list[int], writer: str, **llm_args) -> dict:
    from vllm import LLM, SamplingParams

    dataset = out / f"hs-{name}"
    stats_path = out / f"stats-{name}.json"
    if not torch.cuda.is_available():  # a dry run of this script on a CPU machine
        llm_args.update(kv_cache_memory_bytes=256 << 20, block_size=32, enforce_eager=True)
    else:
        llm_args.update(gpu_memory_utilization=0.2)
    llm = LLM(
        model=model,
        dtype="bfloat16",
        max_model_len=1024,
        seed=0,
        speculative_config=speculative_config(layers),
        kv_transfer_config=connector_config(dataset, writer=writer, stats_path=str(stats_path)),
        **llm_args,
    )
    reference = Reference(model)
    stored = sorted(layers)
    hidden = llm.llm_engine.model_config.get_hidden_size()

    def sampling(max_tokens: int, params: dict | None = None):
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            extra_args={"kv_transfer_params": params} if params else None,
        )

    checked = 0
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"

    def check(outputs, include_outputs: bool = False) -> None:
        nonlocal checked
        if in_process:
            # An in-process engine is stepped only by generate(); step it until the connector
            # has copied the last finished requests (it holds their blocks until then).
            scheduler = llm.llm_engine.engine_core.engine_core.scheduler
            while scheduler.has_requests():
                llm.llm_engine.step()
        for o in outputs:
            ids = list(o.prompt_token_ids) + (list(o.outputs[0].token_ids)[:-1] if include_outputs else [])
            record = fetch(o.kv_transfer_params, timeout=120)
            try:
                assert_hidden_states_match(record, reference, ids, layers=stored, hidden_size=hidden)
            except AssertionError:
                diagnose(record, reference, ids, stored)
                raise
            checked += 1

    t0 = time.perf_counter()
    lengths = [1, 7, 33, 100, 300]  # 300 > max_num_batched_tokens where set: chunked prefill
    check(llm.generate([{"prompt_token_ids": prompt_ids(n, n)} for n in lengths], sampling(4), use_tqdm=False))
    prefix = prompt_ids(64, 11)
    check(llm.generate([{"prompt_token_ids": prefix + prompt_ids(9, 1)}], sampling(3), use_tqdm=False))
    shared = llm.generate(
        [{"prompt_token_ids": prefix + prompt_ids(n, n)} for n in (5, 40)], sampling(3), use_tqdm=False
    )
    assert all(o.num_cached_tokens >= 64 for o in shared), [o.num_cached_tokens for o in shared]
    check(shared)
    check(
        llm.generate(
            [{"prompt_token_ids": prompt_ids(20, 2)}],
            sampling(6, {"include_output_tokens": True, "sample_id": f"{name}-with-outputs"}),
            use_tqdm=False,
        ),
        include_outputs=True,
    )
    # Capture windows and reductions (issue 25) across chunked prefill, beside the plain record
    # of the same prompt in the same batch: the window's rows are the plain record's rows, the
    # mean their float32 mean rounded once (computed on the GPU, in the copy stream).
    long = prompt_ids(300, 17)
    asks = [None, {"window": [40, 200]}, {"reduction": "last"}, {"window": [10, -10], "reduction": "mean"}]
    win = llm.generate([{"prompt_token_ids": long}] * len(asks), [sampling(2, a) for a in asks], use_tqdm=False)
    check(win[:1])
    plain = fetch(win[0].kv_transfer_params, timeout=120).hidden_states
    rows = [fetch(o.kv_transfer_params, timeout=120).hidden_states for o in win[1:]]
    assert torch.equal(rows[0], plain[40:200]), (rows[0].float() - plain[40:200].float()).abs().max()
    assert torch.equal(rows[1], plain[-1:])
    mean = plain[10:290].float().mean(0, keepdim=True)
    torch.testing.assert_close(rows[2].float(), mean, rtol=2**-7, atol=2**-7)
    checked += 3
    # A larger batch, for the connector's statistics.
    many = llm.generate([{"prompt_token_ids": prompt_ids(256, s)} for s in range(64)], sampling(16), use_tqdm=False)
    check(many[:4])
    elapsed = time.perf_counter() - t0
    llm.llm_engine.engine_core.shutdown()
    stats = json.loads(stats_path.read_text())
    import layertap

    with layertap.open(dataset) as ds:
        assert len(ds) == 5 + 1 + 2 + 1 + 4 + 64, len(ds)
        assert ds.verify().ok and all(s.complete for s in ds.shards)
    return {"engine": name, "layers": stored, "records_checked": checked, "seconds": round(elapsed, 2), "stats": stats}


def main() -> int:
    import vllm

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-check-output").resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(
        json.dumps({"vllm": vllm.__version__, "torch": torch.__version__, "cuda": torch.cuda.is_available()}),
        flush=True,
    )
    import layertap

    writer = "rust" if hasattr(layertap.ShardWriter, "submit") else "python"
    if os.environ.get("GPU_CHECK_ONLY") != "16":
        small = build_tiny_llama(out / "tiny-4", dtype="bfloat16")
        print(
            json.dumps(run_engine("cudagraphs", small, out, [4, 0, 2], writer, max_num_batched_tokens=128)), flush=True
        )
    deep = build_tiny_llama(out / "tiny-16", num_layers=16, dtype="bfloat16")
    print(
        json.dumps(run_engine("16-layers", deep, out, list(range(16)), writer, max_num_batched_tokens=128)), flush=True
    )
    print("GPU-CHECK-OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
