# Type stubs of the Rust extension `layertap._native` (rust/python/src). Checked against the
# built module by tests/test_native_stubs.py: every name here exists there and the other way
# round, with the same parameters.

import os
from collections.abc import Mapping, Sequence
from typing import Any, final

FORMAT_VERSION: int
MAX_THREADS: int

@final
class WriterOptions:
    """The writer's options (rust/python/src/options.rs over the core's WriterConfig)."""

    FIELDS: tuple[str, ...]
    def __init__(
        self,
        *,
        codec: str = "bp16-zstd",
        level: int = 1,
        shard_size: int = 1 << 30,
        durability: str | int = "close",
        threads: int | None = None,
        max_inflight_bytes: int = 1 << 30,
        batch_bytes: int = 8 << 20,
        writer_id: str | None = None,
        io: str = "auto",
        direct: bool = False,
        metadata: Mapping[str, str] | None = None,
        lossy: str | None = None,
        key_memory: int | None = None,
    ) -> None: ...
    def replace(self, **changes: Any) -> WriterOptions: ...
    def as_dict(self) -> dict[str, Any]: ...
    @property
    def codec(self) -> str: ...
    @property
    def level(self) -> int: ...
    @property
    def shard_size(self) -> int: ...
    @property
    def durability(self) -> str | int: ...
    @property
    def threads(self) -> int | None: ...
    @property
    def max_inflight_bytes(self) -> int: ...
    @property
    def batch_bytes(self) -> int: ...
    @property
    def writer_id(self) -> str | None: ...
    @property
    def io(self) -> str: ...
    @property
    def direct(self) -> bool: ...
    @property
    def metadata(self) -> Mapping[str, str]: ...
    @property
    def lossy(self) -> str | None: ...
    @property
    def key_memory(self) -> int | None: ...

@final
class NativeShardWriter:
    def __init__(self, path: str | os.PathLike[str], options: WriterOptions) -> None: ...
    def submit(
        self,
        key: str,
        tensors: Sequence[tuple[str, Any, str, Sequence[int]]],
        metadata: dict[str, str] | None = None,
        num_tokens: int = 0,
    ) -> int: ...
    def submit_many(
        self,
        records: list[tuple[str, Sequence[tuple[str, Any, str, Sequence[int]]], dict[str, str] | None, int]],
    ) -> list[int]: ...
    def poll(self, timeout: float | None = 0.0) -> list[tuple[int, str, str, int, int, int]]: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...
    @property
    def stats(self) -> dict[str, Any]: ...
    @property
    def backend(self) -> str: ...
    @property
    def writer_id(self) -> str: ...
    @property
    def encoder_thread_ids(self) -> list[int]: ...
    @property
    def path(self) -> str: ...

@final
class NativeRegionSink:
    """The vLLM connector's path into a ``NativeShardWriter`` (rust/python/src/region.rs)."""

    def __init__(
        self,
        writer: NativeShardWriter,
        pool: Any,
        *,
        dtype: str,
        row_shape: Sequence[int],
        metadata: dict[str, str],
        block_size: int,
        tensor_block_size: int,
        row_steps: tuple[int, int] | None,
        layer_rows: Sequence[int],
    ) -> None: ...
    def fill(
        self,
        ids_offset: int,
        index_offset: int,
        token_ids: list[list[int]],
        num_tokens: Sequence[int],
        block_ids: list[list[int]],
    ) -> int: ...
    def submit(
        self,
        region: int,
        start: int,
        nbytes: int,
        hidden_offset: int,
        ids_offset: int,
        keys: Sequence[str],
        request_ids: Sequence[str],
        num_tokens: Sequence[int],
        num_prompt_tokens: Sequence[int],
        extras: dict[int, tuple[dict[str, str] | None, bytes | None]],
    ) -> list[tuple[int, str]]: ...
    def reap(self, timeout: float | None = 0.0) -> tuple[list[int], int]: ...
    @property
    def live_regions(self) -> int: ...

@final
class TensorBuffer:
    """Bytes of one decoded tensor: a private memory map of the shard or an owned buffer.
    Exposes ``__array_interface__`` (writable 1-D uint8)."""

    @property
    def __array_interface__(self) -> dict[str, Any]: ...
    def __len__(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def address(self) -> int: ...
    @property
    def mapped(self) -> bool: ...

@final
class NativeShardReader:
    def __init__(self, path: str | os.PathLike[str]) -> None: ...
    @property
    def path(self) -> str: ...
    @property
    def complete(self) -> bool: ...
    @property
    def meta_json(self) -> str: ...
    @property
    def shard_id(self) -> bytes: ...
    @property
    def header_len(self) -> int: ...
    @property
    def file_bytes(self) -> int: ...
    @property
    def data_end(self) -> int: ...
    @property
    def torn_tail_bytes(self) -> int: ...
    @property
    def index_unusable(self) -> bool: ...
    @property
    def lost_in_recovery(self) -> int: ...
    @property
    def being_written(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    @property
    def problems(self) -> list[tuple[str, int | None, str | None, str]]: ...
    def __len__(self) -> int: ...
    def entries(self) -> list[tuple[str, int, int, int, int, str, int]]: ...
    def read(
        self, i: int, verify: bool = True
    ) -> tuple[dict[str, str], list[tuple[str, str, tuple[int, ...], TensorBuffer]]]: ...
    def check(self, i: int) -> None: ...
    def close(self) -> None: ...

def recover(path: str | os.PathLike[str]) -> dict[str, Any]: ...
def is_being_written(path: str | os.PathLike[str]) -> bool: ...
def decode_record(
    stored: Any,
    *,
    key: str,
    codec: int,
    raw_len: int,
    payload_crc: int | None,
    path: str | os.PathLike[str],
    offset: int,
) -> tuple[dict[str, str], list[tuple[str, str, tuple[int, ...], TensorBuffer]]]: ...
def read_record(
    path: str | os.PathLike[str],
    payload_offset: int,
    *,
    key: str,
    codec: int,
    raw_len: int,
    stored_len: int,
    payload_crc: int | None,
    offset: int,
    fd: int | None = None,
) -> tuple[dict[str, str], list[tuple[str, str, tuple[int, ...], TensorBuffer]]]: ...
def batch_memory(nbytes: int) -> TensorBuffer: ...
def read_batch_into(
    reads: list[tuple[NativeShardReader, int, Any]],
    *,
    name: str,
    verify: bool = True,
    threads: int = 1,
) -> list[tuple[dict[str, str], list[tuple[str, str, tuple[int, ...], TensorBuffer | None]]] | Exception]: ...
def read_stored_into(
    reads: list[tuple[NativeShardReader, int, Any]],
    *,
    verify: bool = True,
    threads: int = 1,
) -> list[Exception | None]: ...
def exphuf_code_lengths(counts: bytes) -> bytes: ...
def exphuf_reversed_codes(lengths: bytes) -> bytes: ...
def exphuf_coded_heads(
    dtype: str, strides: list[int], modes: list[int], lengths: bytes, stream_lens: list[int]
) -> list[bytes]: ...
def exphuf_encode(raw: bytes, by: str = "column") -> bytes: ...
def exphuf_batch_heads(staged: Any, bases: list[int], lengths: list[int]) -> dict[str, Any]: ...
