"""The zstd levels writers accept (the library's own range; negative levels are zstd's fast
modes), apart from ``codecs`` so that checking a writer's options does not import the Python
reference's payload decoding (the production path decodes in the Rust core)."""

from __future__ import annotations

import zstandard

MIN_LEVEL, MAX_LEVEL = -(1 << 17), zstandard.MAX_COMPRESSION_LEVEL

__all__ = ["MAX_LEVEL", "MIN_LEVEL"]
