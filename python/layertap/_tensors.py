"""Conversions between what callers hand the writers (torch tensors, numpy arrays, raw buffers)
and what the format stores (bytes, a safetensors dtype name, a shape), and back.

Writers never copy: a tensor becomes a ``memoryview`` over its own memory, which keeps the tensor
alive for as long as the writer holds it.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from layertap._checks import check_str_map, one_of
from layertap._choices import TENSOR_KINDS
from layertap._install import INSTALL_DOC
from layertap._spec.dtypes import ITEMSIZE, NUMPY_DTYPES, TORCH_NAMES, numpy_dtype
from layertap._spec.record import TOKEN_IDS
from layertap.errors import InvalidInputError

if sys.byteorder != "little":  # pragma: no cover - the format is little-endian
    raise ImportError("layertap supports little-endian machines only")

# torch is imported only when a torch tensor or dtype is met (or TORCH_DTYPES is asked for), so
# that importing layertap (the readers, the command line) does not pay torch's seconds of start-up,
# and works where torch is not installed.
_NAMES_OF_NUMPY = {v: k for k, v in NUMPY_DTYPES.items()}
_NAMES_OF_TORCH_NAMES = {v: k for k, v in TORCH_NAMES.items()}
_torch_maps: tuple[dict, dict] | None = None


def _torch_dtypes() -> tuple[dict, dict]:
    """``(safetensors name -> torch dtype, torch dtype -> name)``; imports torch."""
    global _torch_maps
    if _torch_maps is None:
        import torch

        to_torch_dtype = {name: getattr(torch, t) for name, t in TORCH_NAMES.items()}
        _torch_maps = (to_torch_dtype, {v: k for k, v in to_torch_dtype.items()})
    return _torch_maps


def __getattr__(name: str):
    # TORCH_DTYPES (safetensors dtype name -> torch dtype) is made on first use (PEP 562).
    if name == "TORCH_DTYPES":
        return _torch_dtypes()[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _torch_available() -> bool:
    """Whether torch can be imported (without importing it when it is not loaded yet)."""
    if "torch" in sys.modules:
        return sys.modules["torch"] is not None
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def dtype_name(dtype: Any) -> str:
    """The safetensors name of a torch dtype, numpy dtype (bfloat16 from ml_dtypes included) or
    name (``"BF16"``, ``"bfloat16"``, ``"torch.bfloat16"``)."""
    torch = sys.modules.get("torch")  # not loaded: no value is a torch dtype
    if torch is not None and isinstance(dtype, torch.dtype):
        names = _torch_dtypes()[1]
        if dtype in names:
            return names[dtype]
    elif isinstance(dtype, str):
        if dtype in ITEMSIZE:
            return dtype
        if dtype.removeprefix("torch.") in _NAMES_OF_TORCH_NAMES:
            return _NAMES_OF_TORCH_NAMES[dtype.removeprefix("torch.")]
        if _torch_available():  # torch's other names: "half", "long", ...
            import torch

            as_torch = getattr(torch, dtype, None)
            names = _torch_dtypes()[1]
            if isinstance(as_torch, torch.dtype) and as_torch in names:
                return names[as_torch]
    else:
        try:
            np_dtype = np.dtype(dtype)
        except TypeError:
            np_dtype = None
        if np_dtype is not None and np_dtype.name == "bfloat16" and np_dtype.itemsize == 2:
            return "BF16"  # ml_dtypes.bfloat16
        if np_dtype is not None and np_dtype.newbyteorder("<") in _NAMES_OF_NUMPY:
            if np_dtype.byteorder == ">":
                raise InvalidInputError(f"dtype {dtype!r} is big-endian; the format is little-endian")
            return _NAMES_OF_NUMPY[np_dtype.newbyteorder("<")]
    raise InvalidInputError(f"unknown or unsupported dtype {dtype!r}; supported: {', '.join(ITEMSIZE)}")


def _from_torch(name: str, t) -> tuple[memoryview, str, tuple[int, ...]]:
    import torch  # loaded already: t is a tensor

    if t.device.type != "cpu":
        raise InvalidInputError(f"tensor {name!r} is on {t.device}; copy it to the CPU first")
    if not t.is_contiguous():
        raise InvalidInputError(f"tensor {name!r} is not contiguous; call .contiguous() first")
    # A uint8 view of the tensor's own memory; numpy keeps a reference to the tensor.
    flat = t.detach().reshape(-1).view(torch.uint8).numpy()
    return memoryview(flat), dtype_name(t.dtype), tuple(t.shape)


def _from_numpy(name: str, a: np.ndarray) -> tuple[memoryview, str, tuple[int, ...]]:
    if not a.flags.c_contiguous:
        raise InvalidInputError(f"array {name!r} is not C-contiguous; use numpy.ascontiguousarray")
    return memoryview(a.reshape(-1).view(np.uint8)), dtype_name(a.dtype), tuple(a.shape)


def _from_buffer(name: str, spec: tuple) -> tuple[memoryview, str, tuple[int, ...]]:
    if len(spec) != 3:
        raise InvalidInputError(f"tensor {name!r}: expected (buffer, dtype, shape), got {len(spec)} items")
    buffer, dtype, shape = spec
    try:
        view = memoryview(buffer)
    except TypeError:
        raise InvalidInputError(
            f"tensor {name!r}: {type(buffer).__name__} does not support the buffer protocol"
        ) from None
    if not view.c_contiguous:
        raise InvalidInputError(f"tensor {name!r}: buffer is not C-contiguous")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    try:
        shape = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise InvalidInputError(f"tensor {name!r}: shape {shape!r} is not a sequence of integers") from None
    if any(d < 0 for d in shape):
        raise InvalidInputError(f"tensor {name!r}: shape {shape} has a negative dimension")
    dtype = dtype_name(dtype)
    want = math.prod(shape) * ITEMSIZE[dtype]
    if view.nbytes != want:
        raise InvalidInputError(
            f"tensor {name!r}: buffer holds {view.nbytes} bytes but {dtype} {list(shape)} needs {want}"
        )
    return view, dtype, shape


def normalize(tensors: Mapping[str, Any]) -> tuple[list[tuple[str, memoryview, str, tuple[int, ...]]], int]:
    """Turns a writer's ``tensors`` argument into ``[(name, bytes view, dtype, shape)]`` in the
    given order, and the record's token count (the length of ``token_ids``, else 0)."""
    if not isinstance(tensors, Mapping):
        raise InvalidInputError(f"tensors must be a mapping of name to tensor, not {type(tensors).__name__}")
    if not tensors:
        raise InvalidInputError("a record needs at least one tensor")
    out = []
    for name, value in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise InvalidInputError(f"tensor name {name!r} is not allowed")
        torch = sys.modules.get("torch")  # not loaded: no value is a tensor
        if torch is not None and isinstance(value, torch.Tensor):
            view, dtype, shape = _from_torch(name, value)
        elif isinstance(value, np.ndarray):
            view, dtype, shape = _from_numpy(name, value)
        elif isinstance(value, tuple):
            view, dtype, shape = _from_buffer(name, value)
        else:
            raise InvalidInputError(
                f"tensor {name!r}: expected a torch.Tensor, numpy.ndarray or (buffer, dtype, shape), "
                f"got {type(value).__name__}"
            )
        out.append((name, view, dtype, shape))  # empty tensors too: a zero-token record
    num_tokens = next((shape[0] for name, _, _, shape in out if name == TOKEN_IDS and shape), 0)
    if num_tokens >= 1 << 32:
        raise InvalidInputError(f"token_ids has {num_tokens} tokens; at most 2**32 - 1 fit a record")
    return out, num_tokens


#: A record in normalized form, what both writers take internally (and the vLLM connector
#: builds directly): ``(key, [(name, bytes view, dtype name, shape)], metadata, num_tokens)``.
Prepared = tuple[str, list[tuple[str, memoryview, str, Any]], dict[str, str], int]


def prepare_record(record: Any) -> Prepared:
    """One item of ``submit_many``, checked and normalized (the key itself is checked by the writer)."""
    if not isinstance(record, (tuple, list)) or len(record) not in (2, 3):
        raise InvalidInputError(
            f"each record must be a tuple (key, tensors) or (key, tensors, metadata), got {record!r:.80}"
        )
    key, tensors, metadata = (*record, None) if len(record) == 2 else record
    if not isinstance(key, str):
        raise InvalidInputError(f"record key must be a str, not {type(key).__name__}")
    parts, num_tokens = normalize(tensors)
    return key, parts, check_metadata(metadata), num_tokens


def check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """A record's caller-given metadata, checked: a mapping of strings, without the reserved ``key``."""
    metadata = check_str_map(metadata)
    if "key" in metadata:
        raise InvalidInputError("metadata may not set 'key'; it is the record key")
    return metadata


def to_torch(buffer: Any, dtype: str, shape: tuple[int, ...] | list[int]):
    """A ``torch.Tensor`` over ``buffer`` (no copy when it is writable, else one copy)."""
    import torch

    view = memoryview(buffer)
    if view.nbytes == 0:  # torch.frombuffer refuses empty buffers; other writers' files may hold them
        return torch.empty(tuple(shape), dtype=_torch_dtypes()[0][dtype])
    if view.readonly:
        view = memoryview(bytearray(view))
    flat = torch.frombuffer(view, dtype=_torch_dtypes()[0][dtype])
    return flat.reshape(tuple(shape))


def to_numpy(buffer: Any, dtype: str, shape: tuple[int, ...] | list[int]) -> np.ndarray:
    """A ``numpy.ndarray`` over ``buffer`` (no copy when it is writable, else one copy); BF16
    as ``ml_dtypes.bfloat16``."""
    view = memoryview(buffer)
    if view.readonly:
        view = memoryview(bytearray(view))
    return np.frombuffer(view, dtype=numpy_dtype(dtype)).reshape(tuple(shape))


def tensor_maker(tensors: str = "auto"):
    """The function that turns a record's ``(buffer, dtype, shape)`` into what readers hand
    back: ``"torch"`` tensors, ``"numpy"`` arrays, or ``"auto"``: torch where it can be
    imported, else numpy."""
    one_of("tensors", tensors, TENSOR_KINDS)
    if tensors == "auto":
        return to_torch if _torch_available() else to_numpy
    if tensors == "torch":
        if not _torch_available():
            raise ImportError(
                f"tensors='torch' needs torch (the build for this machine: {INSTALL_DOC}); or use tensors='numpy'"
            )
        return to_torch
    return to_numpy
