"""The engine half of tests/vllm/test_vision_language.py, run as a child process with torchvision
on PYTHONPATH (requirements-torchvision.txt, tests/vllm/torchvision_shim): a real vLLM engine
with layertap's connector and vLLM's ``extract_hidden_states`` method over the tiny Qwen2.5-VL,
given prompts with images. Writes, per prompt, the record key and the prompt's token ids as vLLM
expanded them to ``argv[3]`` (JSON).

    python vl_engine.py MODEL_DIR OUTPUT_DIR RESULT_JSON PROMPTS_JSON [LAYERS_JSON]

PROMPTS_JSON: a list of ``{"before": words, "after": words, "image": [width, height, seed] or
null}``; a prompt with an image gets ``layertap._tiny_vl.image_prompt``'s placeholder. LAYERS_JSON:
the layer ids to record (default ``vllm_support.LAYERS``).
"""

from __future__ import annotations

import json
import sys

from layertap._tiny_vl import image_prompt, random_image
from vllm_support import LAYERS, engine_args, running_llm, speculative_config


def main(model: str, output_dir: str, result_path: str, prompts_json: str, layers_json: str | None = None) -> None:
    from vllm import SamplingParams

    prompts = []
    for p in json.loads(prompts_json):
        if p["image"] is None:
            prompts.append({"prompt": f"{p['before']} {p['after']}"})
        else:
            width, height, seed = p["image"]
            image = random_image(width, height, seed=seed)
            prompts.append({"prompt": image_prompt(p["before"], p["after"]), "multi_modal_data": {"image": image}})
    args = engine_args(
        model,
        output_dir,
        speculative_config=speculative_config(LAYERS if layers_json is None else json.loads(layers_json)),
        limit_mm_per_prompt={"image": 1},
    )
    with running_llm(False, **args) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        # With the engine in this process, the last finished requests reach the connector at the
        # next step (../shared/VLLM-CPU.md): one more request lets them be written.
        llm.generate([{"prompt": "the"}], SamplingParams(max_tokens=1), use_tqdm=False)
    result = [
        {"key": out.kv_transfer_params["layertap"]["key"], "token_ids": list(out.prompt_token_ids)} for out in outputs
    ]
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:6])
