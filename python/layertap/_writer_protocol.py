"""``RecordSink``: what a record producer (the vLLM connector) needs of a writer. Both
``ShardWriter`` implements it (docs/API.md, "Writers")."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from layertap._types import Completion

#: One tensor in buffer form: ``(name, buffer, dtype, shape)``; ``buffer`` supports the buffer
#: protocol (C-contiguous), ``dtype`` is a safetensors name (``"BF16"``, ``"I64"``...).
BufferTensor = tuple[str, Any, str, Sequence[int]]
#: One record in buffer form: ``(key, [tensor, ...], metadata or None, num_tokens)``.
BufferRecord = tuple[str, list[BufferTensor], Mapping[str, str] | None, int]


@runtime_checkable
class RecordSink(Protocol):
    """A writer that takes records as byte buffers and reports them done in order."""

    def submit_buffers(self, records: list[BufferRecord]) -> list[int]:
        """Queues records given as buffers (no torch or numpy conversion); returns their
        sequence numbers. All or none: bad input refuses every record before any is queued."""
        ...

    def poll(self, timeout: float | None = 0.0) -> list[Completion]:
        """The records written since the last call, in sequence order."""
        ...

    def close(self) -> None:
        """Writes everything and completes the shards."""
        ...

    @property
    def backend(self) -> str: ...

    @property
    def stats(self) -> dict: ...


__all__ = ["BufferRecord", "BufferTensor", "RecordSink"]
