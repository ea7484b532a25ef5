"""layertap: hidden states out of any layers of a vLLM model, into compact crash-safe shards.

- ``ShardWriter`` (Rust) and ``PyShardWriter`` (pure Python) write shards with
  ``WriterOptions`` (docs/API.md);
- ``open`` reads a shard or a dataset directory, ``follow`` reads a dataset while it is
  written, ``recover`` completes a shard whose writer died;
- ``layertap.vllm`` holds the vLLM connector (imported only when vLLM loads it).

The pure-Python reference implementation (``layertap._py``: ``PyShardWriter``, the Python
reader and recovery) is imported only when it is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from layertap import generate  # a callable package: layertap.generate(model, data, out, ...)
from layertap._options import WriterOptions
from layertap._sink import RecordSink
from layertap._types import (
    Completion,
    IndexEntry,
    Problem,
    ProblemKind,
    RecoverReport,
    ShardBackend,
    ShardInfo,
    VerifyReport,
)
from layertap._version import __version__ as __version__
from layertap.errors import (
    CodecError,
    CorruptRecordError,
    DiskFullError,
    DuplicateKeyError,
    FormatError,
    InvalidInputError,
    LayertapError,
    OptionError,
    RecordMissingError,
    RecordNotFoundError,
    ShardLockedError,
    StoreUnavailableError,
    WriterClosedError,
    WriterIOError,
)
from layertap.follow import Follow, follow
from layertap.reader import Dataset, Record, RecordIterator, open
from layertap.recover import recover
from layertap.writer import ShardWriter

if TYPE_CHECKING:
    from layertap._py.writer import PyShardWriter


def __getattr__(name: str) -> Any:
    # The reference writer is loaded on first use (PEP 562), so that the production path never
    # imports layertap._py.
    if name == "PyShardWriter":
        from layertap._py.writer import PyShardWriter

        return PyShardWriter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ShardWriter",
    "PyShardWriter",
    "WriterOptions",
    "OptionError",
    "RecordSink",
    "open",
    "follow",
    "recover",
    "generate",
    "Dataset",
    "Record",
    "RecordIterator",
    "Follow",
    "Completion",
    "IndexEntry",
    "Problem",
    "ProblemKind",
    "RecoverReport",
    "ShardBackend",
    "ShardInfo",
    "VerifyReport",
    "LayertapError",
    "InvalidInputError",
    "DuplicateKeyError",
    "FormatError",
    "CorruptRecordError",
    "CodecError",
    "RecordMissingError",
    "RecordNotFoundError",
    "StoreUnavailableError",
    "ShardLockedError",
    "WriterClosedError",
    "WriterIOError",
    "DiskFullError",
]
