"""The small kit of checks every option of layertap goes through, so that one kind of mistake
reads the same wherever it is made: ``f"{name} must be {what}, not {value!r}"``.

Each check takes the name of what it checks and the error class to raise: a class whose
constructor takes ``(option, problem)`` (``OptionError``, the connector's ``ConfigError``) is
given both, so that it carries the option's name; any other (``InvalidInputError``,
``GenerateError``) the one line ``f"{name} {problem}"``. The choices and limits themselves live
in ``layertap._choices``.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from layertap.errors import InvalidInputError

T = TypeVar("T")
ErrorClass = type[Exception]


@functools.cache
def _names_option(error: ErrorClass) -> bool:
    try:
        return "option" in inspect.signature(error.__init__).parameters
    except (TypeError, ValueError):  # a constructor without a signature: one message
        return False


def error_for(error: ErrorClass, name: str, problem: str) -> Exception:
    """The ``error`` saying that ``name`` ``problem`` (``"must be ..., not ..."``)."""
    return error(name, problem) if _names_option(error) else error(f"{name} {problem}")


def is_int(value: object) -> bool:
    """An integer, and not a bool (``True`` is no count of anything)."""
    return isinstance(value, int) and not isinstance(value, bool)


def one_of(name: str, value: T, choices: Iterable[object], error: ErrorClass = InvalidInputError) -> T:
    """``value``, once it is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise error_for(error, name, f"must be one of {', '.join(map(repr, choices))}, not {value!r}")
    return value


def positive_int(name: str, value: Any, error: ErrorClass = InvalidInputError, *, below: int | None = None) -> int:
    """``value``, once it is an integer of at least 1 (and below ``below``, if given)."""
    if not is_int(value) or value < 1 or (below is not None and value >= below):
        what = "a positive integer" + ("" if below is None else f" below {_power(below)}")
        raise error_for(error, name, f"must be {what}, not {value!r}")
    return value


def optional_positive_int(name: str, value: Any, error: ErrorClass = InvalidInputError) -> int | None:
    """``value``: None, or an integer of at least 1."""
    return None if value is None else positive_int(name, value, error)


def flag(name: str, value: Any, error: ErrorClass = InvalidInputError, *, json_words: bool = False) -> bool:
    """``value``, once it is a bool (said ``true or false`` where the value came as JSON)."""
    if not isinstance(value, bool):
        words = "true or false" if json_words else "True or False"
        raise error_for(error, name, f"must be {words}, not {value!r}")
    return value


def json_object(name: str, value: Any, error: ErrorClass = InvalidInputError) -> dict:
    """A copy of ``value``, a mapping or the text of a JSON object; None: empty."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise error_for(error, name, f"is not JSON: {e}") from None
    if not isinstance(value, Mapping):
        raise error_for(error, name, f"must be a JSON object, not {value!r:.80}")
    return dict(value)


def _power(n: int) -> str:
    """``2**64`` for a power of two that large, else the number."""
    return f"2**{n.bit_length() - 1}" if n > 1 << 16 and n & (n - 1) == 0 else str(n)


def check_str_map(metadata: object) -> dict[str, str]:
    """A copy of ``metadata`` (None: empty) once it is checked to be a mapping of str to str:
    what record metadata must be."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidInputError(f"metadata must be a mapping of str to str, not {type(metadata).__name__}")
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidInputError(f"metadata entry {k!r}: {v!r}: keys and values must be str")
    return dict(metadata)


__all__ = [
    "check_str_map",
    "error_for",
    "flag",
    "is_int",
    "json_object",
    "one_of",
    "optional_positive_int",
    "positive_int",
]
