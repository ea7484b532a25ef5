"""The safetensors dtypes a record may hold: element sizes, and the names torch and numpy give
them, without importing torch (so that the command line and the readers start fast, and work
where torch is not installed). ``layertap._tensors`` turns buffers into tensors and arrays."""

from __future__ import annotations

import numpy as np

#: Bytes per element of each safetensors dtype.
ITEMSIZE: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
    "F8_E4M3": 1,
}  # fmt: skip

#: The name torch gives each dtype (``torch.<name>``); numpy (with ml_dtypes for bfloat16) uses
#: the same names.
TORCH_NAMES: dict[str, str] = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8",
    "U16": "uint16", "I16": "int16", "F16": "float16", "BF16": "bfloat16",
    "U32": "uint32", "I32": "int32", "F32": "float32",
    "U64": "uint64", "I64": "int64", "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
}  # fmt: skip

#: Dtypes whose elements the byte-plane transform of codec ``bp16-zstd`` splits.
TWO_BYTE = frozenset(name for name, size in ITEMSIZE.items() if size == 2)

#: numpy's little-endian dtype of each safetensors dtype numpy has itself (not BF16, F8_E4M3).
NUMPY_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(torch_name).newbyteorder("<")
    for name, torch_name in TORCH_NAMES.items()
    if name not in ("BF16", "F8_E4M3")
}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of safetensors dtype ``name``; BF16 and F8_E4M3 are ``ml_dtypes``' (imported
    only then)."""
    if name in ("BF16", "F8_E4M3"):
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16 if name == "BF16" else ml_dtypes.float8_e4m3fn)
    return NUMPY_DTYPES[name]
