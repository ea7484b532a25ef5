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

from collections.abc import Mapping
from typing import Any

from layertap._spec.record import HIDDEN_STATES
from layertap.errors import InvalidInputError

#: The values of the writers' ``lossy`` option.
LOSSY_MODES = ("fp8-e4m3",)
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


def quantize_record(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None):
    """A record's tensors and metadata with ``hidden_states`` stored as fp8 and its scales
    added after it; a record without ``hidden_states`` is left as it is."""
    if not isinstance(tensors, Mapping) or HIDDEN_STATES not in tensors:
        return tensors, metadata
    if SCALE_NAME in tensors:
        raise InvalidInputError(f"lossy='fp8-e4m3' adds a tensor {SCALE_NAME!r}; the record has one already")
    q, scale, meta = quantize(tensors[HIDDEN_STATES])
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        out[name] = q if name == HIDDEN_STATES else t
        if name == HIDDEN_STATES:
            out[SCALE_NAME] = scale
    return out, _merged(metadata, meta)


def _merged(metadata: Mapping[str, str] | None, errors: dict[str, str]) -> dict[str, str]:
    merged = dict(metadata or {})
    if isinstance(merged.get("dtype"), str):
        merged["fp8_source_dtype"] = merged["dtype"]
    merged.update(errors)
    return merged


#: safetensors dtype names of the floating types quantized, as torch names them.
_FLOATS = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def quantize_buffer_record(record: tuple) -> tuple:
    """A ``submit_buffers`` record ``(key, [(name, buffer, dtype, shape)], metadata,
    num_tokens)`` with ``hidden_states`` stored as fp8 and its scales after it, as the Rust
    writer's compression threads make it (``PyShardWriter``'s reference of that path); a record
    without ``hidden_states``, or not of that form, is left for the writer's checks."""
    import numpy as np
    import torch

    if not isinstance(record, (tuple, list)) or len(record) != 4 or not isinstance(record[1], (list, tuple)):
        return record
    key, parts, metadata, num_tokens = record
    names = [p[0] if isinstance(p, (tuple, list)) and p else None for p in parts]
    if HIDDEN_STATES not in names:
        return record
    if SCALE_NAME in names:
        raise InvalidInputError(f"lossy='fp8-e4m3' adds a tensor {SCALE_NAME!r}; the record has one already")
    i = names.index(HIDDEN_STATES)
    _, buffer, dtype, shape = parts[i]
    if dtype not in _FLOATS:
        raise InvalidInputError(f"lossy='fp8-e4m3' needs hidden_states as BF16, F16 or F32, not {dtype}")
    raw = torch.from_numpy(np.frombuffer(buffer, dtype=np.uint8).copy())
    x = raw.view(getattr(torch, _FLOATS[dtype])).reshape(tuple(shape))
    q, scale, meta = quantize(x)
    out = list(parts)
    out[i] = (HIDDEN_STATES, q.view(torch.uint8).numpy(), "F8_E4M3", list(shape))
    out.insert(i + 1, (SCALE_NAME, scale.numpy(), "F32", [int(shape[0])]))
    return (key, out, _merged(metadata, meta), num_tokens)


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


def lossy_records(lossy: str | None, records):
    """``submit_many``'s records with :func:`quantize_record` applied when ``lossy`` is set
    (items that are not 2- or 3-tuples are left for the writer's own checks to refuse)."""
    if lossy is None:
        return records
    out = []
    for r in records:
        if isinstance(r, (tuple, list)) and len(r) in (2, 3):
            tensors, metadata = quantize_record(r[1], r[2] if len(r) == 3 else None)
            r = (r[0], tensors, metadata)
        out.append(r)
    return out
