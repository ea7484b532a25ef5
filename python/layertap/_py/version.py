"""The installed package's version, for the ``"writer"`` member of shard metadata."""

from __future__ import annotations


def package_version() -> str:
    """``layertap``'s version from its installed metadata, ``"0+unknown"`` in a bare source tree."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("layertap")
    except PackageNotFoundError:
        return "0+unknown"
