"""The writers' options (docs/API.md, "Writers"), checked in one place for ``ShardWriter`` and
``PyShardWriter``, so both refuse the same values with the same messages, each naming the
option."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from layertap._py.codecs import CODEC_NONE, check_level, codec_id
from layertap._py.format import MAX_META_LEN, writer_id_problem
from layertap.errors import InvalidInputError

_U64 = 1 << 64
MAX_THREADS = 256


def positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < _U64:
        raise InvalidInputError(f"{name} must be a positive integer below 2**64, not {value!r}")
    return value


def check_durability(value: object) -> str | int:
    if value in ("none", "close"):
        return value  # type: ignore[return-value]
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < _U64:
        return value
    raise InvalidInputError(f"durability must be 'none', 'close' or a positive number of bytes, not {value!r}")


def check_utf8(what: str, *texts: str) -> None:
    """Python strings may hold lone surrogates, which have no UTF-8 form."""
    for t in texts:
        try:
            t.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidInputError(f"{what} {t!r} is not valid UTF-8 (it holds a lone surrogate)") from None


def check_str_map(metadata: object) -> dict[str, str]:
    """A copy of ``metadata`` (None: empty) once it is checked to be a mapping of str to str:
    what record and shard metadata both must be."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidInputError(f"metadata must be a mapping of str to str, not {type(metadata).__name__}")
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidInputError(f"metadata entry {k!r}: {v!r}: keys and values must be str")
    return dict(metadata)


def check_shard_metadata(metadata: object) -> dict[str, str]:
    """The writer's ``metadata`` (stored in every shard header): strings, well under 1 MiB."""
    metadata = check_str_map(metadata)
    for k, v in metadata.items():
        check_utf8("metadata entry", k, v)
    if sum(len(k.encode()) + len(v.encode()) + 8 for k, v in metadata.items()) > MAX_META_LEN // 2:
        raise InvalidInputError("writer metadata is too large: shard metadata is limited to 1 MiB")
    return metadata


def check_writer_options(
    *,
    codec: Any,
    level: Any,
    shard_size: Any,
    durability: Any,
    threads: Any,
    max_inflight_bytes: Any,
    batch_bytes: Any,
    writer_id: Any,
    io: Any,
    direct: Any,
    metadata: Any,
) -> dict[str, Any]:
    """Checks every option; returns them normalised (durability, metadata as a dict)."""
    if codec_id(codec) != CODEC_NONE:
        check_level(level)
    elif not isinstance(level, int) or isinstance(level, bool):
        raise InvalidInputError(f"level must be an integer, not {level!r}")
    positive_int("shard_size", shard_size)
    durability = check_durability(durability)
    if threads is not None and positive_int("threads", threads) > MAX_THREADS:
        raise InvalidInputError(f"threads must be 1 to {MAX_THREADS}, not {threads!r}")
    positive_int("max_inflight_bytes", max_inflight_bytes)
    positive_int("batch_bytes", batch_bytes)
    if writer_id is not None:
        if not isinstance(writer_id, str):
            raise InvalidInputError(f"writer_id must be a str, not {type(writer_id).__name__}")
        problem = writer_id_problem(writer_id)
        if problem:
            raise InvalidInputError(problem)
    if io not in ("auto", "uring", "pwrite"):
        raise InvalidInputError(f"io must be 'auto', 'uring' or 'pwrite', not {io!r}")
    if not isinstance(direct, bool):
        raise InvalidInputError(f"direct must be True or False, not {direct!r}")
    return dict(
        codec=codec,
        level=level,
        shard_size=shard_size,
        durability=durability,
        threads=threads,
        max_inflight_bytes=max_inflight_bytes,
        batch_bytes=batch_bytes,
        writer_id=writer_id,
        io=io,
        direct=direct,
        metadata=check_shard_metadata(metadata),
    )
