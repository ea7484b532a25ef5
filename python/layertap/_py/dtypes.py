"""Element sizes and torch names of the safetensors dtypes, without importing torch (so that the
command line and the readers start fast). ``layertap._tensors`` holds the torch mapping."""

from __future__ import annotations

#: Bytes per element of each safetensors dtype.
ITEMSIZE: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}

#: The name torch gives each dtype (``torch.<name>``).
TORCH_NAMES: dict[str, str] = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8",
    "U16": "uint16", "I16": "int16", "F16": "float16", "BF16": "bfloat16",
    "U32": "uint32", "I32": "int32", "F32": "float32",
    "U64": "uint64", "I64": "int64", "F64": "float64",
}

#: Dtypes whose elements the byte-plane transform of codec ``bp16-zstd`` splits.
TWO_BYTE = frozenset(name for name, size in ITEMSIZE.items() if size == 2)
