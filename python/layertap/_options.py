"""The writers' options (docs/API.md, "Writers"): ``WriterOptions``, one frozen schema with the
defaults written once and every value checked when it is made.

Both writers take it (or its fields as keyword arguments), and the vLLM connector maps its keys
onto it (``layertap.vllm.config``), so all three refuse the same values with the same messages,
each naming the option. The Rust binding takes the checked values as they are
(``WriterOptions.native_kwargs``); the Rust core checks them again only for its Rust callers.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from layertap._checks import choices_text, flag, is_int, one_of, positive_int
from layertap._choices import DURABILITY_MODES, IO_MODES, LOSSY_MODES, MAX_THREADS
from layertap._spec.format import CODECS, MAX_META_LEN, WRITER_ID_RULE, writer_id_problem
from layertap._spec.levels import MAX_LEVEL, MIN_LEVEL
from layertap.errors import InvalidInputError, OptionError

_U64 = 1 << 64
_I32 = 1 << 31


def _positive(name: str, value: object) -> int:
    return positive_int(name, value, OptionError, below=_U64)


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


def _shard_metadata(metadata: object) -> dict[str, str]:
    """The writer's ``metadata`` (stored in every shard header): strings, well under 1 MiB."""
    try:
        metadata = check_str_map(metadata)
        for k, v in metadata.items():
            check_utf8("metadata entry", k, v)
    except OptionError:
        raise
    except InvalidInputError as e:
        raise OptionError("metadata", str(e).removeprefix("metadata ")) from None
    # Measured as both writers store it in the shard header (compact JSON, non-ASCII as UTF-8),
    # escapes included: a raw estimate let through metadata ('"', '\\' and control characters
    # grow 2 to 6 times) whose header readers then refused. Half of what readers accept is the
    # metadata's; the other half is left to the writers' own entries. The Rust core checks the
    # same bound the same way (`writer::MAX_SHARD_METADATA_JSON`).
    limit = MAX_META_LEN // 2
    json_len = len(json.dumps(metadata, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
    if json_len > limit:
        raise OptionError(
            "metadata",
            f"is too large: {json_len} bytes as JSON (escapes included), more than {limit}; "
            "store large values in records instead",
        )
    return metadata


@dataclass(frozen=True)
class WriterOptions:
    """The options of ``ShardWriter`` (docs/API.md, "Writers"), checked
    when made: a bad value raises ``OptionError`` (an ``InvalidInputError``) naming the option.
    ``dataclasses.replace(options, field=value)`` makes a changed copy, checked again."""

    codec: str = "bp16-zstd"
    """``"none"``, ``"zstd"`` or ``"bp16-zstd"``."""
    level: int = 1
    """zstd level (ignored by ``"none"``)."""
    shard_size: int = 1 << 30
    """Bytes of frames a shard holds at most; the next record starts a new shard."""
    durability: str | int = "close"
    """``"none"``, ``"close"`` (fsync each shard when it closes) or N (also every N bytes)."""
    threads: int | None = None
    """Compression threads (Rust writer); None: ``min(4, cpu count)``."""
    max_inflight_bytes: int = 1 << 30
    """Raw bytes submitted but not yet written; ``submit`` waits past this."""
    batch_bytes: int = 8 << 20
    """Records are coalesced into writes of about this size."""
    writer_id: str | None = None
    """Shard names are ``f"{writer_id}-{n:06}.lts"``; None: a random id."""
    io: str = "auto"
    """``"auto"``, ``"uring"`` (io_uring or an error) or ``"pwrite"``."""
    direct: bool = False
    """Write record data with ``O_DIRECT`` where the file system allows it (Rust writer)."""
    metadata: Mapping[str, str] = field(default_factory=dict)
    """Stored in every shard's header (``"user"``)."""
    lossy: str | None = None
    """None (lossless, the default) or ``"fp8-e4m3"``: ``hidden_states`` stored as float8 with
    a scale per token, half the bytes, with the error in each record's metadata (docs/FP8.md)."""
    key_memory: int | None = None
    """How many of the most recent keys the writer remembers to refuse a key given again;
    None: every key of its lifetime (a long-running writer bounds its memory with it)."""

    def __post_init__(self) -> None:
        one_of("codec", self.codec, CODECS, OptionError)
        level = self.level
        if not is_int(level):
            raise OptionError("level", f"must be an integer, not {level!r}")
        if self.codec != "none" and not MIN_LEVEL <= level <= MAX_LEVEL:
            raise OptionError("level", f"must be a zstd level from {MIN_LEVEL} to {MAX_LEVEL}, not {level!r}")
        if not -_I32 <= level < _I32:
            raise OptionError("level", f"must be a 32-bit integer, not {level!r}")
        _positive("shard_size", self.shard_size)
        if self.durability not in DURABILITY_MODES:
            d = self.durability
            if not is_int(d) or not 0 < d < _U64:
                raise OptionError(
                    "durability", f"must be {choices_text(DURABILITY_MODES)} or a positive number of bytes, not {d!r}"
                )
        if self.threads is not None:
            t = self.threads
            if not is_int(t) or not 0 < t <= MAX_THREADS:
                raise OptionError("threads", f"must be None or an integer from 1 to {MAX_THREADS}, not {t!r}")
        _positive("max_inflight_bytes", self.max_inflight_bytes)
        _positive("batch_bytes", self.batch_bytes)
        if self.writer_id is not None and writer_id_problem(self.writer_id):
            raise OptionError("writer_id", f"must be None or {WRITER_ID_RULE}, not {self.writer_id!r}")
        if self.io == "io_uring":
            object.__setattr__(self, "io", "uring")
        else:
            one_of("io", self.io, IO_MODES, OptionError)
        if self.key_memory is not None:
            _positive("key_memory", self.key_memory)
        flag("direct", self.direct, OptionError)
        if self.lossy is not None and self.lossy not in LOSSY_MODES:
            raise OptionError("lossy", f"must be None or {choices_text(LOSSY_MODES)}, not {self.lossy!r}")
        # Read-only, so that no one changes a checked value behind the check.
        object.__setattr__(self, "metadata", MappingProxyType(_shard_metadata(self.metadata)))

    @classmethod
    def of(cls, options: WriterOptions | None, overrides: Mapping[str, Any]) -> WriterOptions:
        """``options`` (None: the defaults) with the fields in ``overrides`` changed: what a
        writer's ``options=`` and keyword arguments give together."""
        if options is None:
            return cls(**overrides)
        if not isinstance(options, cls):
            raise InvalidInputError(f"options must be a layertap.WriterOptions, not {type(options).__name__}")
        return dataclasses.replace(options, **overrides) if overrides else options

    def native_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``layertap._native.NativeShardWriter``."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["metadata"] = dict(self.metadata)
        return out


__all__ = ["WriterOptions"]
