"""The plugin's parts that need no vLLM engine: the switches (``LAYERTAP_EAGLE3``,
``LAYERTAP_IN_MODEL``), the entry point, and the hooks that read the residual stream (on toy
decoder layers). The plugin against real vLLM engines and transformers is tested in
tests/vllm/test_plugin_values.py and tests/vllm/test_in_model.py."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

from layertap.vllm.models import (
    ENV_VAR,
    FAMILIES,
    IN_MODEL_ENV_VAR,
    IN_MODEL_FAMILIES,
    architectures_from_env,
    in_model_architectures_from_env,
)
from layertap.vllm.models.capture import StreamCapture
from layertap.vllm.models.families import FUSED, PLAIN


def test_every_family_has_a_tiny_model_to_test_it_with(monkeypatch):
    # The tiny models are the vLLM tests' (tests/vllm/tiny_families.py; the hybrids', with their
    # real layer patterns, tiny_hybrid.py).
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "vllm"))
    from tiny_families import ARCHITECTURES
    from tiny_hybrid import ARCHITECTURES as HYBRID_ARCHITECTURES

    assert not set(ARCHITECTURES) & set(HYBRID_ARCHITECTURES)
    assert sorted(ARCHITECTURES + HYBRID_ARCHITECTURES) == sorted(IN_MODEL_FAMILIES)
    assert set(FAMILIES) <= set(IN_MODEL_FAMILIES)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", []),
        ("0", []),
        (" 0 ", []),
        ("1", list(FAMILIES)),
        ("Gemma2ForCausalLM", ["Gemma2ForCausalLM"]),
        ("Gemma2ForCausalLM, GPT2LMHeadModel,", ["Gemma2ForCausalLM", "GPT2LMHeadModel"]),
    ],
)
def test_the_variable_names_the_architectures(value, expected):
    assert architectures_from_env(value) == expected


def test_an_unknown_architecture_is_refused_by_name():
    with pytest.raises(
        ValueError, match=r"LAYERTAP_EAGLE3='LlamaForCausalLM': unknown architecture\(s\) \['LlamaForCausalLM'\]"
    ):
        architectures_from_env("LlamaForCausalLM")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", []),
        ("0", []),
        ("1", list(IN_MODEL_FAMILIES)),
        ("LlamaForCausalLM,Gemma2ForCausalLM", ["LlamaForCausalLM", "Gemma2ForCausalLM"]),
    ],
)
def test_the_in_model_variable_names_the_architectures(value, expected):
    assert in_model_architectures_from_env(value) == expected


def test_an_architecture_without_in_model_capture_is_refused_by_name():
    with pytest.raises(
        ValueError, match=r"LAYERTAP_IN_MODEL='GraniteForCausalLM': unknown architecture\(s\) \['GraniteForCausalLM'\]"
    ):
        in_model_architectures_from_env("GraniteForCausalLM")


def test_vllm_finds_the_entry_point():
    [entry] = [e for e in entry_points(group="vllm.general_plugins") if e.name == "layertap"]
    assert entry.value == "layertap_vllm_plugin:register"


def test_the_entry_point_imports_nothing_of_layertap_unless_asked():
    """vLLM calls the entry point in every process of every engine once layertap is installed."""
    code = (
        "import sys, layertap_vllm_plugin; layertap_vllm_plugin.register(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'layertap'))"
    )
    for var in (ENV_VAR, IN_MODEL_ENV_VAR):
        for value in (None, "", "0"):
            env = {k: v for k, v in os.environ.items() if k not in (ENV_VAR, IN_MODEL_ENV_VAR)}
            if value is not None:
                env[var] = value
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            assert out.stdout.strip() == "[]", (var, value, out.stdout, out.stderr)


# Toy decoder layers in vLLM's two conventions. Each adds a branch that depends on its input.


class FusedLayer(torch.nn.Module):
    """``(hidden_states, residual)`` in and out, the stream being their sum; the residual-adds are
    done in place, as vLLM's fused residual-add norms do on CUDA, so the first layer updates the
    embeddings tensor it was given."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
        else:
            residual.add_(hidden_states)
        residual.add_(torch.tanh(residual) * self.scale)  # the attention branch
        return torch.sin(residual) * self.scale, residual  # the MLP branch, not yet added


class PlainLayer(torch.nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, hidden_states):
        return hidden_states + torch.tanh(hidden_states) * self.scale


def run_fused(layers, x):
    hidden, residual = x, None
    for layer in layers:
        hidden, residual = layer(None, hidden, residual)
    return hidden + residual


def fused_streams(layers, x):
    """The residual stream before each layer and after the last, computed without hooks."""
    streams, hidden, residual = [x.clone()], x, None
    for layer in layers:
        hidden, residual = layer(None, hidden, residual)
        streams.append(hidden + residual)
    return streams


@pytest.mark.parametrize("ids", [[0, 1, 2, 3], [3, 0], [1], [2, 3]])
def test_fused_layers_give_the_sum_at_each_boundary(ids):
    layers = torch.nn.ModuleList([FusedLayer(0.5), FusedLayer(0.25), FusedLayer(2.0)])
    x = torch.randn(5, 8)
    embeddings = x.clone()
    expected = fused_streams(layers, x.clone())
    capture = StreamCapture(layers, FUSED)
    capture.set_layers(ids)
    run_fused(layers, x)
    assert not torch.equal(x, embeddings)  # the first layer updated its input in place ...
    got = capture.take()
    assert len(got) == len(ids)
    for k, tensor in zip(sorted(ids), got):
        assert torch.equal(tensor, expected[k]), k  # ... but the embeddings were copied first


def test_plain_layers_give_their_input_and_the_last_output():
    layers = torch.nn.ModuleList([PlainLayer(0.5), PlainLayer(1.5)])
    capture = StreamCapture(layers, PLAIN)
    capture.set_layers([2, 0, 1])
    x = torch.randn(3, 4)
    h1 = layers[0](x)
    h2 = layers[1](h1)
    got = capture.take()
    for tensor, want in zip(got, [x, h1, h2]):
        assert torch.equal(tensor, want)


def test_set_layers_replaces_the_hooks_and_each_pass_is_taken_once():
    layers = torch.nn.ModuleList([PlainLayer(0.5), PlainLayer(1.5)])
    capture = StreamCapture(layers, PLAIN)
    capture.set_layers([0, 1])
    capture.set_layers([2])
    x = torch.randn(3, 4)
    layers[1](layers[0](x))
    assert len(capture.take()) == 1
    with pytest.raises(RuntimeError, match=r"recorded 0 hidden states for layer ids \[2\]"):
        capture.take()


def test_a_layer_id_out_of_range_is_refused():
    capture = StreamCapture(torch.nn.ModuleList([PlainLayer(1.0)] * 4), PLAIN)
    with pytest.raises(ValueError, match=r"ids \[5\] out of range: this model has 4 decoder layers, so ids go from 0"):
        capture.set_layers([0, 5])
    with pytest.raises(ValueError, match=r"ids \[-1\] out of range"):
        capture.set_layers([-1])
