"""``python -m layertap.demo`` (``make demo``): vLLM with the layertap connector, end to end.

Builds a tiny random Llama locally (nothing is downloaded), serves a handful of prompts with vLLM
and the connector recording three layers, reads one record back through the online API, and
prints ``layertap inspect`` of the dataset. Runs on a CPU in about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from layertap._tiny_model import build_tiny_llama, prompt

LAYERS = [2, 0, 4]  # asked in any order; the records store them ascending


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m layertap.demo", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--output", default="demo-output", help="folder for the model and the dataset (default: %(default)s)"
    )
    p.add_argument(
        "--writer",
        choices=("auto", "rust", "python"),
        default="auto",
        help="shard writer; auto: the Rust one when the extension is built (default: %(default)s)",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--prompts", type=int, default=6, help="number of prompts (default: %(default)s)")
    return p.parse_args(argv)


def _writer(choice: str) -> str:
    if choice != "auto":
        return choice
    import layertap

    return "rust" if hasattr(layertap.ShardWriter, "submit") else "python"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    out = os.path.abspath(args.output)
    dataset = os.path.join(out, "hidden-states")
    shutil.rmtree(dataset, ignore_errors=True)
    writer = _writer(args.writer)
    # vLLM's IPC sockets, temporary files and caches stay in the demo folder.
    for var, sub in (("TMPDIR", "tmp"), ("VLLM_CACHE_ROOT", "vllm-cache")):
        os.environ.setdefault(var, os.path.join(out, sub))
        os.makedirs(os.environ[var], exist_ok=True)
    tempfile.tempdir = None
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    stats_path = os.path.join(out, "connector-stats.json")
    model = build_tiny_llama(os.path.join(out, "tiny-llama"))
    print(f"model: random 4-layer Llama in {model}; writer: {writer}; dataset: {dataset}", flush=True)

    from vllm import LLM, SamplingParams

    from layertap.cli import main as layertap_cli
    from layertap.vllm import fetch

    llm = LLM(
        model=model,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=512,
        block_size=32,
        kv_cache_memory_bytes=64 << 20,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}},
        },
        kv_transfer_config={
            "kv_connector": "LayertapConnector",
            "kv_connector_module_path": "layertap.vllm",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "output_dir": dataset,
                "writer": writer,
                "stats_path": stats_path,
            },
        },
    )
    prompts = [prompt(8 + 11 * i, offset=i) for i in range(args.prompts)]
    # Every other request also records its generated tokens.
    params = [
        SamplingParams(
            max_tokens=8,
            temperature=0.0,
            extra_args={"kv_transfer_params": {"sample_id": f"demo-{i}", "include_output_tokens": i % 2 == 1}},
        )
        for i in range(len(prompts))
    ]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    print(f"\ngenerated {len(outputs)} completions in {time.perf_counter() - t0:.2f} s:")
    for o in outputs:
        loc = o.kv_transfer_params["layertap"]
        print(
            f"  {loc['key']}: {len(o.prompt_token_ids)} prompt tokens -> {loc['num_tokens']} tokens recorded; "
            f"text: {o.outputs[0].text[:40]!r}"
        )
    record = fetch(outputs[-1].kv_transfer_params, timeout=60)
    print(f"\nfetched online: {record}\n  layer_ids {record.layer_ids}, metadata {record.metadata}\n")
    llm.llm_engine.engine_core.shutdown()  # the connector closes its writer: shards complete
    del llm
    with open(stats_path) as f:
        stats = json.load(f)
    hook = stats["hook"]
    print(
        f"connector: {stats['records_written']} records, {stats['tokens']} tokens in {stats['gathers']} gathers; "
        f"engine-thread time per step p50 {hook['p50_us']:.0f} us, p99 {hook['p99_us']:.0f} us "
        f"(all statistics: {stats_path})\n",
        flush=True,
    )
    return layertap_cli(["inspect", dataset])


if __name__ == "__main__":
    sys.exit(main())
