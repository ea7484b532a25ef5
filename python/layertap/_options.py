"""The writer's options (docs/API.md, "Writers"): ``WriterOptions`` is the Rust core's, defined
once there (``rust/core/src/writer/config.rs``, what each accepts in ``rust/core/src/options.rs``)
and exposed by the binding as a frozen class (``rust/python/src/options.rs``); the vLLM connector
maps its keys onto it (``layertap.vllm.config``). Without the compiled extension (a source
checkout not yet built) the name still imports, and making one says what to do."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from layertap.errors import InvalidInputError

NEEDS_EXTENSION = "layertap.WriterOptions needs the compiled extension layertap._native (build it with `make build`)"

if TYPE_CHECKING:
    from layertap._native import WriterOptions
else:
    try:
        from layertap._native import WriterOptions
    except ImportError:  # pragma: no cover - depends on how the package was installed

        class WriterOptions:
            def __init__(self, **_: Any) -> None:
                raise ImportError(NEEDS_EXTENSION)


def options_with(options: WriterOptions | None, overrides: Mapping[str, Any]) -> WriterOptions:
    """``options`` (None: the defaults) with the fields in ``overrides`` changed: what a writer's
    ``options=`` and keyword arguments give together."""
    if options is None:
        return WriterOptions(**overrides)
    if not isinstance(options, WriterOptions):
        raise InvalidInputError(f"options must be a layertap.WriterOptions, not {type(options).__name__}")
    return options.replace(**overrides) if overrides else options


__all__ = ["WriterOptions", "options_with"]
