"""vLLM model classes with the EAGLE-3 interface, made on demand from vLLM's own. They live in
this module under the architecture's name (``__getattr__`` builds them), so that they pickle by
reference. Importing this module imports vLLM.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch
from vllm.model_executor.models.interfaces import SupportsEagle3, supports_eagle3

from layertap.vllm.errors import PluginError
from layertap.vllm.models.capture import StreamCapture
from layertap.vllm.models.families import FAMILIES, Family


class StreamCaptureOwner:
    """A model of a known ``_layertap_family`` reading its stream with one ``StreamCapture``."""

    _layertap_family: Family

    def _layertap_capture(self) -> StreamCapture:
        capture = self.__dict__.get("_layertap_stream_capture")
        if capture is None:
            layers = functools.reduce(getattr, self._layertap_family.layers.split("."), self)
            capture = StreamCapture(layers, self._layertap_family.stream)
            # Plain attribute (nn.Module.__setattr__ would too: it is no Module or Parameter).
            self.__dict__["_layertap_stream_capture"] = capture
        return capture


class AuxHiddenStatesMixin(StreamCaptureOwner):
    """``SupportsEagle3``: vLLM calls ``set_aux_hidden_state_layers`` once the model is loaded, then
    expects ``forward`` to return ``(hidden_states, [one tensor per layer id, ascending])``."""

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        from vllm.distributed import get_pp_group

        if get_pp_group().world_size > 1:
            raise PluginError(
                f"layertap plugin: {type(self).__name__} with pipeline parallelism is not supported "
                "(its aux hidden states would have to cross the pipeline stages)"
            )
        self._layertap_capture().set_layers(layers)

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        # vLLM's default for the models that implement the interface themselves.
        n = self._layertap_capture().num_layers
        return (2, n // 2, n - 3)

    def _forward_with_aux(self, base_forward: Any, args: tuple, kwargs: dict) -> Any:
        capture = self.__dict__.get("_layertap_stream_capture")
        if capture is None or not capture.layer_ids:
            return base_forward(self, *args, **kwargs)
        capture.tensors = []
        hidden_states = base_forward(self, *args, **kwargs)
        if not isinstance(hidden_states, torch.Tensor):
            # IntermediateTensors of a pipeline stage: refused in set_aux_hidden_state_layers.
            raise TypeError(f"layertap plugin: unexpected model output {type(hidden_states).__name__}")
        return hidden_states, capture.take()


@functools.cache
def with_aux_hidden_states(arch: str) -> type:
    """vLLM's class for ``arch`` with ``SupportsEagle3`` added, unless it has it already."""
    family = FAMILIES.get(arch)
    if family is None:
        raise AttributeError(f"layertap plugin: no model class for architecture {arch!r}")
    base = getattr(importlib.import_module(f"vllm.model_executor.models.{family.module}"), family.class_name)
    if supports_eagle3(base):
        return base
    return aux_hidden_states_class(base, family, arch)


def aux_hidden_states_class(base: type, family: Family, name: str) -> type:
    base_forward = base.forward

    # The base's signature stays visible (functools.wraps): vLLM inspects the model's forward
    # for the keyword arguments it may pass.
    @functools.wraps(base_forward)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self._forward_with_aux(base_forward, args, kwargs)

    namespace = {
        "forward": forward,
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"vLLM's {base.__module__}.{base.__qualname__} with the EAGLE-3 interface (layertap plugin).",
        "_layertap_family": family,
    }
    return type(name, (AuxHiddenStatesMixin, base, SupportsEagle3), namespace)


def __getattr__(name: str) -> type:
    # Pickle finds the classes by module and name.
    if name in FAMILIES:
        return with_aux_hidden_states(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
