"""The one resolver of backends: which implementation (the Rust core or the Python reference) a
reader or a recovery uses, from the choice its caller was given (``"auto"``, ``"rust"``
or ``"python"``, ``layertap._choices``).

Callers hand in how to load each implementation, so that the reference is imported only when it
is chosen (the production path never loads ``layertap._py``) and this module imports neither.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from layertap._checks import ErrorClass, error_for, one_of
from layertap._choices import READER_BACKENDS
from layertap.errors import InvalidInputError

T = TypeVar("T")


def resolve_backend(
    name: str,
    backend: str,
    *,
    rust: Callable[[], T],
    python: Callable[[], T],
    choices: Iterable[str] = READER_BACKENDS,
    error: ErrorClass = InvalidInputError,
    unavailable: ErrorClass = ImportError,
) -> T:
    """What ``rust()`` or ``python()`` gives, as ``backend`` (the value of option ``name``, one of
    ``choices``, else ``error``) asks: ``"auto"`` is Rust unless loading it raises ImportError
    (the extension is not built). Asked for ``"rust"`` without the extension, raises
    ``unavailable`` (from the ImportError), which says to build it or choose ``"python"``."""
    one_of(name, backend, choices, error)
    if backend == "python":
        return python()
    try:
        return rust()
    except ImportError as e:
        if backend == "auto":
            return python()
        raise error_for(
            unavailable,
            name,
            f"'rust' is not available: the native extension is not built ({e}); "
            f"build it (make build) or use {name}='python'",
        ) from e


__all__ = ["resolve_backend"]
