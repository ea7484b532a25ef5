"""layertap: hidden states out of any layers of a vLLM model, into compact crash-safe shards.

- ``ShardWriter`` (the Rust core) writes shards with ``WriterOptions`` (docs/API.md);
- ``open`` reads a shard or a dataset directory, ``follow`` reads a dataset while it is
  written, ``recover`` completes a shard whose writer died;
- ``layertap.vllm`` holds the vLLM connector (imported only when vLLM loads it).

The pure-Python reference implementation (``layertap._py``: the Python reader and recovery, and
a reference writer for tests) is imported only when it is asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

from layertap._options import WriterOptions
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
from layertap._writer_protocol import RecordSink
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

#: What a caller of the removed pure-Python production writer is told.
PY_SHARD_WRITER_REMOVED = (
    "layertap.PyShardWriter was removed in 0.1.0: the Rust writer, layertap.ShardWriter (same "
    "constructor and methods), is the only writer; use it instead"
)


def __getattr__(name: str) -> Any:
    # layertap.generate, a callable package (layertap.generate(model, data, out, ...)), is imported
    # when first asked for: it costs a quarter of a second (numpy and the generate modules), which
    # every ``layertap inspect`` or ``verify`` child process paid before (issue 35, item 5).
    if name == "generate":
        return importlib.import_module("layertap.generate")
    # An ImportError rather than an AttributeError: ``from layertap import PyShardWriter`` turns
    # an AttributeError into its own message, which would not say what to do (PEP 562).
    if name == "PyShardWriter":
        raise ImportError(PY_SHARD_WRITER_REMOVED)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "generate"})  # listed before its first use imports it


__all__ = [
    "ShardWriter",
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
