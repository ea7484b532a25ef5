"""The JSON texts of a shard: its metadata and each record's safetensors header
(docs/FORMAT.md, "Conventions"). RFC 8259 JSON within limits that every reader shares, so that
the Python reader and the Rust core (``rust/core/src/json_text.rs``, serde_json underneath)
accept exactly the same texts and read the same values from them.

Python's ``json`` alone accepts more than serde_json does: ``NaN`` and ``Infinity``, numbers
beyond a double's range (as ``inf`` or exact integers), unpaired surrogate escapes, and nesting
up to the interpreter's recursion limit (beyond it, ``RecursionError``). The fuzzer found the
first of these as a shard that one reader opened and the other refused.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate

#: Arrays and objects nest at most this deep (``[[1]]`` is 2 deep).
MAX_DEPTH = 64

# A JSON string, escapes included; linear (the alternatives are disjoint). Removed before the
# brackets are counted, so that brackets inside strings do not count.
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def parse(data: bytes) -> object:
    """The value of the JSON text ``data``. Raises ValueError (UnicodeDecodeError for bytes that
    are not UTF-8) saying what is wrong."""
    text = bytes(data).decode("utf-8")
    _check_depth(text)
    value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float, parse_int=_integer)
    try:
        # Refuses strings holding an unpaired surrogate (``"\\ud800"``): they are not Unicode
        # text, and serde_json refuses them.
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a string holds an unpaired surrogate escape") from None
    return value


def _check_depth(text: str) -> None:
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    deepest = max(accumulate(1 if c in "[{" else -1 for c in brackets), default=0)
    if deepest > MAX_DEPTH:
        raise ValueError(f"arrays and objects nest {deepest} deep, more than {MAX_DEPTH}")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(s: str) -> float:
    f = float(s)
    if math.isinf(f):
        raise ValueError(f"number {_shown(s)} is beyond a double's range")
    return f


def _integer(s: str) -> int | float:
    if math.isinf(float(s)):
        raise ValueError(f"number {_shown(s)} is beyond a double's range")
    # serde_json reads -0 as the float -0.0 (no integer has a sign and is zero); so do we, so
    # that an integer field written -0 is refused by both readers.
    return -0.0 if s == "-0" else int(s)


def _shown(number: str) -> str:
    return number if len(number) <= 24 else f"{number[:20]}... ({len(number)} characters)"
