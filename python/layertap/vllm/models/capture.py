"""Reads the residual stream at chosen decoder-layer boundaries with forward hooks.

Layer id ``k < N`` is read by a pre-hook on decoder layer ``k`` (its input), id ``N`` by a hook on
the last layer (its output), appending in ascending id order (the order vLLM's EAGLE-3 interface
promises). Under torch.compile dynamo traces the hooks and turns the appends into graph outputs.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from layertap.vllm.errors import CaptureError, PluginError
from layertap.vllm.models.families import FUSED, PLAIN


class StreamCapture:
    def __init__(self, layers: Sequence[torch.nn.Module], stream: str):
        if stream not in (FUSED, PLAIN):
            raise PluginError(f"layertap plugin: unknown residual stream convention {stream!r}")
        self._layers = layers
        self._stream = stream
        self._handles: list[Any] = []
        self.layer_ids: tuple[int, ...] = ()
        self.tensors: list[torch.Tensor] = []

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def set_layers(self, layer_ids: Sequence[int]) -> None:
        ids = tuple(sorted({int(i) for i in layer_ids}))
        n = self.num_layers
        bad = [i for i in ids if not 0 <= i <= n]
        if bad:
            raise PluginError(
                f"layertap plugin: aux hidden-state layer ids {bad} out of range: this model has "
                f"{n} decoder layers, so ids go from 0 (the embeddings) to {n} (the last layer's output)"
            )
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for k in ids:
            if k < n:
                layer = self._layers[k]
                hidden_at, residual_at = _argument_positions(layer)
                hook = self._input_hook(hidden_at, residual_at)
                self._handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
            else:
                self._handles.append(self._layers[n - 1].register_forward_hook(self._output_hook))
        self.layer_ids = ids
        self.tensors = []

    def take(self) -> list[torch.Tensor]:
        """The tensors the forward pass just recorded, one ``[tokens, hidden]`` per id."""
        tensors, self.tensors = self.tensors, []
        if len(tensors) != len(self.layer_ids):
            raise CaptureError(
                f"layertap plugin: the forward pass recorded {len(tensors)} hidden states for layer ids "
                f"{list(self.layer_ids)}; the model did not run its decoder layers as the plugin expects"
            )
        return tensors

    def _input_hook(self, hidden_at: int, residual_at: int | None):
        fused = self._stream == FUSED

        def record_input(_module, args, kwargs):
            hidden = args[hidden_at] if hidden_at < len(args) else kwargs["hidden_states"]
            residual = None
            if fused and residual_at is not None:
                residual = args[residual_at] if residual_at < len(args) else kwargs.get("residual")
            if residual is None:
                # The layer's input itself (the first layer's: the embeddings). Copied, because
                # layers may update their input in place (vLLM's fused residual-add norms do).
                self.tensors.append(hidden.clone())
            else:
                self.tensors.append(hidden + residual)

        return record_input

    def _output_hook(self, _module, _args, output):
        if self._stream == FUSED:
            hidden, residual = output[0], output[1]
            self.tensors.append(hidden + residual)
        else:
            hidden = output[0] if isinstance(output, tuple) else output
            self.tensors.append(hidden.clone())


def _argument_positions(layer: torch.nn.Module) -> tuple[int, int | None]:
    names = [
        p.name
        for p in inspect.signature(layer.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if "hidden_states" not in names:
        raise TypeError(f"layertap plugin: {type(layer).__name__}.forward has no hidden_states argument ({names})")
    residual = names.index("residual") if "residual" in names else None
    return names.index("hidden_states"), residual
