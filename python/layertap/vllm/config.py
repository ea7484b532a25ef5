"""The connector's options (``kv_connector_extra_config``) and their validation.

Both halves of the connector (scheduler and worker) parse the options with ``parse_options``, so a
bad configuration stops the engine at start-up whichever half is built first, with a message that
names the option. Nothing here imports vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from layertap._py.codecs import check_level, codec_id
from layertap._py.format import key_problem, writer_id_problem
from layertap.errors import InvalidInputError

#: The default host buffer pool holds this many full steps (``max_num_batched_tokens`` tokens of
#: hidden states each), so that the writer can fall behind for a few steps without stalling the
#: engine: on an H200 a Llama-3.2-1B prefill step hands over ~200 MB every ~40 ms.
DEFAULT_POOL_STEPS = 4
#: ... but no less than this, and no less than twice the largest possible request ...
DEFAULT_MIN_POOL_BYTES = 256 << 20
#: ... and, unless the largest request needs more, no more than this (pinned memory is taken
#: from the host for the engine's lifetime).
DEFAULT_MAX_POOL_BYTES = 4 << 30


def default_pool_bytes(largest_request: int, full_step: int) -> int:
    """The pool size when ``pool_bytes`` is not given, from the pool bytes of the longest
    possible request and of one full step (see the constants above)."""
    steps = min(DEFAULT_MAX_POOL_BYTES, max(DEFAULT_MIN_POOL_BYTES, DEFAULT_POOL_STEPS * full_step))
    return max(2 * largest_request, steps)


def default_writer_threads() -> int:
    """Compression threads when ``writer_threads`` is not given: half the CPUs this process may
    run on (the engine needs the others), at least 4 where there are 4, at most 16. The
    writer's own default (4) falls behind a 1B model's prefill on an H200 (benches/RESULTS.md);
    idle compression threads cost nothing."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return min(16, max(min(4, cpus), cpus // 2))


class ConfigError(InvalidInputError):
    """A ``kv_connector_extra_config`` option (or the vLLM configuration around the connector) is
    not acceptable; ``option`` names it."""

    def __init__(self, option: str, message: str):
        super().__init__(f"layertap connector: {option}: {message}")
        self.option = option


@dataclass(frozen=True)
class ConnectorOptions:
    """The validated ``kv_connector_extra_config`` (docs/CONNECTOR.md lists each option)."""

    output_dir: str
    """Dataset directory, absolute (created if missing)."""
    writer: str = "rust"
    """``"rust"`` (``layertap.ShardWriter``) or ``"python"`` (``layertap.PyShardWriter``)."""
    codec: str = "bp16-zstd"
    level: int = 1
    shard_size: int = 1 << 30
    durability: str | int = "close"
    pool_bytes: int | None = None
    """Size of the host buffer pool; None: ``default_pool_bytes``."""
    writer_threads: int | None = None
    """Compression threads of the Rust writer; None: ``default_writer_threads()``."""
    max_inflight_bytes: int | None = None
    """The writer's bound on bytes in flight; None: twice the pool (``submit`` never waits)."""
    io: str = "auto"
    direct: bool = False
    """Write record data with ``O_DIRECT`` where the file system allows it (Rust writer only)."""
    writer_id: str | None = None
    """None: derived from vLLM's engine id (one per engine, so data-parallel ranks differ)."""
    stats_path: str | None = None
    """Where to write the connector's statistics as JSON at shutdown; None: only logged."""
    shard_metadata: dict[str, str] = field(default_factory=dict)
    """Stored in every shard's header (``"user"``)."""


def _int(option: str, value: Any, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(option, f"expected an integer >= {minimum}, got {value!r}")
    return value


def _choice(option: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(option, f"expected one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def _path(option: str, value: Any) -> str:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ConfigError(option, f"expected a non-empty path, got {value!r}")
    return os.path.abspath(os.fspath(value))


def _output_dir(value: Any) -> str:
    return _path("output_dir", value)


def _writer(value: Any) -> str:
    return _choice("writer", value, ("rust", "python"))


def _codec(value: Any) -> str:
    try:
        codec_id(value)
    except InvalidInputError as e:
        raise ConfigError("codec", str(e)) from None
    return value


def _level(value: Any) -> int:
    try:
        return check_level(value)
    except InvalidInputError as e:
        raise ConfigError("level", str(e)) from None


def _durability(value: Any) -> str | int:
    if value in ("none", "close"):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ConfigError("durability", f"expected 'none', 'close' or a positive number of bytes, got {value!r}")


def _optional_int(option: str):
    def check(value: Any) -> int | None:
        return None if value is None else _int(option, value)

    return check


def _io(value: Any) -> str:
    return _choice("io", value, ("auto", "uring", "pwrite"))


def _direct(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError("direct", f"expected true or false, got {value!r}")
    return value


def _writer_id(value: Any) -> str | None:
    if value is not None and writer_id_problem(value):
        raise ConfigError("writer_id", writer_id_problem(value))
    return value


def _stats_path(value: Any) -> str | None:
    return None if value is None else _path("stats_path", value)


def _shard_metadata(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ConfigError("shard_metadata", f"expected a mapping of str to str, got {value!r}")
    return dict(value)


_PARSERS = {
    "output_dir": _output_dir,
    "writer": _writer,
    "codec": _codec,
    "level": _level,
    "shard_size": lambda v: _int("shard_size", v),
    "durability": _durability,
    "pool_bytes": _optional_int("pool_bytes"),
    "writer_threads": _optional_int("writer_threads"),
    "max_inflight_bytes": _optional_int("max_inflight_bytes"),
    "io": _io,
    "direct": _direct,
    "writer_id": _writer_id,
    "stats_path": _stats_path,
    "shard_metadata": _shard_metadata,
}

#: Every option ``kv_connector_extra_config`` may hold.
OPTION_NAMES: tuple[str, ...] = tuple(_PARSERS)


def parse_options(extra_config: Mapping[str, Any] | None) -> ConnectorOptions:
    """Validates ``kv_connector_extra_config``; raises ``ConfigError`` naming the first bad or
    unknown option."""
    if extra_config is None:
        extra_config = {}
    if not isinstance(extra_config, Mapping):
        raise ConfigError("kv_connector_extra_config", f"expected a JSON object, got {extra_config!r}")
    unknown = sorted(set(extra_config) - set(_PARSERS), key=str)
    if unknown:
        raise ConfigError(
            str(unknown[0]), f"unknown option; the options are: {', '.join(OPTION_NAMES)}"
        )
    if "output_dir" not in extra_config:
        raise ConfigError("output_dir", "required: the dataset directory to write shards into")
    values = {name: _PARSERS[name](value) for name, value in extra_config.items()}
    if values.get("writer", "rust") == "python" and values.get("io") == "uring":
        raise ConfigError("io", "'uring' needs writer='rust'; the Python writer writes with pwrite")
    if values.get("writer", "rust") == "python" and values.get("direct"):
        raise ConfigError("direct", "true needs writer='rust'; the Python writer writes through the page cache")
    return ConnectorOptions(**values)


def sample_id_problem(sample_id: Any) -> str | None:
    """Why a client's ``sample_id`` cannot be a record key (docs/FORMAT.md, "Keys"), or None."""
    problem = key_problem(sample_id)
    return None if problem is None else f"sample_id: {problem.replace('record key', 'key', 1)}"
