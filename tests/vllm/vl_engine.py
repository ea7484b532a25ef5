"""The engine half of tests/vllm/test_vision_language.py, run as one child process with torchvision
on PYTHONPATH (requirements-torchvision.txt, tests/vllm/torchvision_shim): real vLLM engines with
layertap's connector and vLLM's ``extract_hidden_states`` method over the tiny vision-language
models, one after the other, given prompts with images; and which of vLLM's Qwen-VL classes have
the EAGLE-3 interface (their modules import only here). One process for all of it, which also
inspects the model classes itself: each child that imports vLLM costs 10 to 20 s of CPU.

    python vl_engine.py JOBS_JSON RESULT_JSON

JOBS_JSON: a list of ``{"model": dir, "output_dir": dir, "prompts": [...], "layers": [ids] or
null}``, each prompt ``{"before": words, "after": words, "image": [width, height, seed] or null}``
(a prompt with an image gets ``layertap._tiny_vl.image_prompt``'s placeholder; layers null:
``vllm_support.LAYERS``). Writes ``{"runs": [[{key, token_ids}] per prompt] per job, "eagle3":
{class name: bool}}`` to RESULT_JSON.
"""

from __future__ import annotations

import json
import sys

from tiny_vl import image_prompt, random_image
from vllm_support import LAYERS, engine_args, inspect_models_in_this_process, running_llm, speculative_config


def run(model: str, output_dir: str, prompts: list[dict], layers: list[int] | None) -> list[dict]:
    from vllm import SamplingParams

    inputs = []
    for p in prompts:
        if p["image"] is None:
            inputs.append({"prompt": f"{p['before']} {p['after']}"})
        else:
            width, height, seed = p["image"]
            image = random_image(width, height, seed=seed)
            inputs.append({"prompt": image_prompt(p["before"], p["after"]), "multi_modal_data": {"image": image}})
    args = engine_args(
        model,
        output_dir,
        speculative_config=speculative_config(LAYERS if layers is None else layers),
        limit_mm_per_prompt={"image": 1},
    )
    with running_llm(False, **args) as llm:
        outputs = llm.generate(inputs, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        # With the engine in this process, the last finished requests reach the connector at the
        # next step (../shared/VLLM-CPU.md): one more request lets them be written.
        llm.generate([{"prompt": "the"}], SamplingParams(max_tokens=1), use_tqdm=False)
    return [
        {"key": out.kv_transfer_params["layertap"]["key"], "token_ids": list(out.prompt_token_ids)} for out in outputs
    ]


def eagle3_interfaces() -> dict[str, bool]:
    from vllm.model_executor.models import qwen2_5_vl, qwen2_vl, qwen3_vl
    from vllm.model_executor.models.interfaces import supports_eagle3

    classes = [
        qwen2_vl.Qwen2VLForConditionalGeneration,
        qwen2_5_vl.Qwen2_5_VLForConditionalGeneration,
        qwen3_vl.Qwen3VLForConditionalGeneration,
    ]
    return {cls.__name__: bool(supports_eagle3(cls)) for cls in classes}


def main(jobs_path: str, result_path: str) -> None:
    with open(jobs_path) as f:
        jobs = json.load(f)
    inspect_models_in_this_process()  # not a child importing vLLM per architecture
    result = {
        "eagle3": eagle3_interfaces(),
        "runs": [run(j["model"], j["output_dir"], j["prompts"], j.get("layers")) for j in jobs],
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
