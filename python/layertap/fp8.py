"""Opt-in lossy storage of hidden states as float8 e4m3 with a scale per token (docs/FP8.md).

Never on by default: a writer quantizes only when opened with ``lossy="fp8-e4m3"``. A quantized
record holds

- ``hidden_states``: ``F8_E4M3`` ``[tokens, layers, hidden]``, the values divided by their
  token's scale;
- ``hidden_states_scale``: ``F32`` ``[tokens]``, each token's largest magnitude over 448 (the
  largest e4m3 value), 1 for an all-zero token;

and the metadata ``lossy`` (``"fp8-e4m3"``), ``fp8_max_rel_err`` and ``fp8_mean_rel_err`` (the
largest and the mean of ``|dequantized - x| / |x|`` over the non-zero elements ``x`` of the
original hidden states) and ``fp8_rms_rel_err`` (``||dequantized - x|| / ||x||``). Readers hand
back the fp8 tensor and the scales as they are; :func:`dequantize` turns them back into floats.
"""

from __future__ import annotations

from typing import Any

from layertap._spec.record import HIDDEN_STATES
from layertap.errors import InvalidInputError

#: Name of the scales tensor beside ``hidden_states``.
SCALE_NAME = "hidden_states_scale"
E4M3_MAX = 448.0


def quantize(hidden_states) -> tuple[Any, Any, dict[str, str]]:
    """``(fp8 tensor, per-token F32 scales, error metadata)`` of a ``[tokens, ...]`` floating
    torch tensor."""
    import torch

    if not isinstance(hidden_states, torch.Tensor) or not hidden_states.is_floating_point():
        raise InvalidInputError("lossy='fp8-e4m3' needs hidden_states as a floating torch.Tensor")
    if hidden_states.dim() < 1:
        raise InvalidInputError("lossy='fp8-e4m3' needs hidden_states with a token axis")
    x = hidden_states.detach().to(torch.float32)
    amax = x.abs().reshape(x.shape[0], -1).amax(dim=1) if x.numel() else torch.zeros(x.shape[0])
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).to(torch.float32)
    shape = (-1,) + (1,) * (x.dim() - 1)
    q = (x / scale.reshape(shape)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    err = (q.to(torch.float32) * scale.reshape(shape) - x).abs()
    nonzero = x != 0
    rel = err[nonzero] / x.abs()[nonzero]
    norm = float(x.norm())
    meta = {
        "lossy": "fp8-e4m3",
        "fp8_max_rel_err": f"{float(rel.max()) if rel.numel() else 0.0:.6g}",
        "fp8_mean_rel_err": f"{float(rel.mean()) if rel.numel() else 0.0:.6g}",
        "fp8_rms_rel_err": f"{float(err.norm()) / norm if norm else 0.0:.6g}",
    }
    return q.contiguous(), scale, meta


def dequantize(record_or_tensor, scale=None, dtype=None):
    """The hidden states of a record written with ``lossy="fp8-e4m3"`` as floats: give the
    record (anything with ``hidden_states`` and ``hidden_states_scale``, as attributes or keys),
    or the fp8 tensor and its scales. ``dtype``: the result's torch dtype (bfloat16 if None)."""
    import torch

    if scale is None:
        rec = record_or_tensor  # a layertap Record or a mapping: both index tensors by name
        q, scale = rec[HIDDEN_STATES], rec[SCALE_NAME]
    else:
        q = record_or_tensor
    q, scale = torch.as_tensor(q), torch.as_tensor(scale)
    if q.dtype != torch.float8_e4m3fn:
        raise InvalidInputError(f"hidden_states is {q.dtype}, not torch.float8_e4m3fn: not an fp8 record")
    shape = (-1,) + (1,) * (q.dim() - 1)
    return (q.to(torch.float32) * scale.to(torch.float32).reshape(shape)).to(dtype or torch.bfloat16)
