"""The package's version, from its installed metadata ("0+unknown" in a source tree without it)."""

from __future__ import annotations

try:
    from importlib.metadata import version as _version

    __version__ = _version("layertap")
except Exception:  # pragma: no cover - running from a source tree without metadata
    __version__ = "0+unknown"

__all__ = ["__version__"]
