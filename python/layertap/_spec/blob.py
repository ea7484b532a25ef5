"""The safetensors blob a record decodes to (docs/FORMAT.md, "Record payload").

``build_header`` makes the one canonical header both writers of this repository produce (see
``rust/core/src/blob.rs``): compact JSON, ``__metadata__`` first with its entries sorted by name,
then the tensors in the order given, packed in that order, padded with spaces so that the data
starts at a multiple of 8. ``parse_header`` accepts any valid safetensors header.
"""

from __future__ import annotations

import json
import math
from typing import NamedTuple

from layertap._spec import json_text
from layertap._spec.dtypes import ITEMSIZE
from layertap._spec.format import FormatProblem, align8

MAX_HEADER_LEN = 100_000_000


class TensorInfo(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    """Absolute offset of the data in the blob (header included)."""
    end: int


def build_header(specs: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    """Header bytes (length prefix, JSON, padding) of a blob holding ``specs`` — ``(name,
    dtype, shape)`` — in order, with ``metadata`` as ``__metadata__``. Inputs are checked by the
    caller (``layertap._tensors.normalize``)."""
    doc: dict = {"__metadata__": {k: metadata[k] for k in sorted(metadata)}}
    offset = 0
    for name, dtype, shape in specs:
        end = offset + math.prod(shape) * ITEMSIZE[dtype]
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (align8(8 + len(text)) - 8 - len(text))
    return len(text).to_bytes(8, "little") + text


def parse_header(blob) -> tuple[dict[str, str], list[TensorInfo], int]:
    """Parses and checks the header of a blob: every tensor lies inside it, tensors are packed
    without gaps or overlaps and end at the end of the blob. Returns ``(metadata, tensors in
    data order, data_start)``. Raises FormatProblem."""
    if len(blob) < 8:
        raise FormatProblem("payload shorter than a safetensors header")
    n = int.from_bytes(blob[:8], "little")
    if n > MAX_HEADER_LEN or 8 + n > len(blob):
        raise FormatProblem(f"safetensors header length {n} does not fit the payload")
    data_start = 8 + n
    try:
        doc = json_text.parse(blob[8:data_start])
    except ValueError as e:  # UnicodeDecodeError is one
        raise FormatProblem(f"safetensors header: {e}") from None
    if not isinstance(doc, dict):
        raise FormatProblem("safetensors header is not a JSON object")
    metadata: dict[str, str] = {}
    tensors = []
    for name, v in doc.items():
        if name == "__metadata__":
            if not isinstance(v, dict):
                raise FormatProblem("__metadata__ is not an object")
            for k, s in v.items():
                if not isinstance(s, str):
                    raise FormatProblem(f"__metadata__[{k!r}] is not a string")
                metadata[k] = s
            continue
        tensors.append(_parse_tensor(name, v, data_start, len(blob)))
    tensors.sort(key=lambda t: (t.begin, t.end))  # an empty tensor before a non-empty one at the same place
    at = data_start
    for t in tensors:
        if t.begin != at:
            raise FormatProblem(f"tensor {t.name!r} does not start where the previous one ends")
        at = t.end
    if at != len(blob):
        raise FormatProblem(f"{len(blob) - at} bytes after the last tensor")
    return metadata, tensors, data_start


def _is_uint(x) -> bool:
    """A ``u64`` as FORMAT.md writes integers: an int (not a bool, not ``-0``, which reads as a
    float) in ``[0, 2**64)``."""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 64


def _parse_tensor(name: str, v, data_start: int, blob_len: int) -> TensorInfo:
    if not isinstance(v, dict):
        raise FormatProblem(f"tensor {name!r}: not an object")
    dtype = v.get("dtype")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise FormatProblem(f"tensor {name!r}: unknown dtype {dtype!r}")
    shape = v.get("shape")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise FormatProblem(f"tensor {name!r}: bad shape")
    offs = v.get("data_offsets")
    if not (isinstance(offs, list) and len(offs) == 2 and all(_is_uint(o) for o in offs) and offs[0] <= offs[1]):
        raise FormatProblem(f"tensor {name!r}: bad data_offsets")
    # The rule of rust/core/src/blob.rs (TensorSpec::byte_len): numpy and torch cannot make a
    # tensor, even an empty one, whose nonzero dimensions hold 2^63 bytes or more.
    if math.prod(d for d in shape if d) * ITEMSIZE[dtype] >= 1 << 63:
        raise FormatProblem(f"tensor {name!r}: shape {shape} is too large (2^63 bytes or more)")
    if math.prod(shape) * ITEMSIZE[dtype] != offs[1] - offs[0]:
        raise FormatProblem(f"tensor {name!r}: data length does not match dtype and shape")
    begin, end = data_start + offs[0], data_start + offs[1]
    if end > blob_len:
        raise FormatProblem(f"tensor {name!r}: data lies outside the payload")
    return TensorInfo(name, dtype, tuple(shape), begin, end)
