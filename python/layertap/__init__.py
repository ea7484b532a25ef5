"""layertap: hidden states out of any layers of a vLLM model, into compact crash-safe shards.

- ``ShardWriter`` (Rust) and ``PyShardWriter`` (pure Python) write shards (docs/API.md);
- ``open`` reads a shard or a dataset directory, ``recover`` completes a shard whose writer died;
- ``layertap.vllm`` holds the vLLM connector (imported only when vLLM loads it).
"""

from __future__ import annotations

from layertap._types import (
    Completion,
    IndexEntry,
    Problem,
    RecoverReport,
    ShardInfo,
    VerifyReport,
)
from layertap._py.writer import PyShardWriter
from layertap.errors import (
    CorruptRecordError,
    DuplicateKeyError,
    FormatError,
    InvalidInputError,
    LayertapError,
    RecordNotFoundError,
    ShardLockedError,
    WriterClosedError,
    WriterIOError,
)
from layertap.reader import Dataset, Record, open
from layertap.recover import recover
from layertap.writer import ShardWriter
from layertap import generate  # a callable package: layertap.generate(model, data, out, ...)

try:
    from importlib.metadata import version as _version

    __version__ = _version("layertap")
except Exception:  # pragma: no cover - running from a source tree without metadata
    __version__ = "0+unknown"

__all__ = [
    "ShardWriter",
    "PyShardWriter",
    "open",
    "recover",
    "generate",
    "Dataset",
    "Record",
    "Completion",
    "IndexEntry",
    "Problem",
    "RecoverReport",
    "ShardInfo",
    "VerifyReport",
    "LayertapError",
    "InvalidInputError",
    "DuplicateKeyError",
    "FormatError",
    "CorruptRecordError",
    "RecordNotFoundError",
    "ShardLockedError",
    "WriterClosedError",
    "WriterIOError",
]
