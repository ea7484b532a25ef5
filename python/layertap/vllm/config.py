"""The connector's options (``kv_connector_extra_config``) and their validation.

Both halves parse them (``parse_options``), so a bad configuration stops the engine at start-up
whichever half is built first. The writer's options go to ``layertap.WriterOptions``
(``WRITER_KEYS``), which checks them as for the writers themselves. Nothing here imports vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from layertap._checks import one_of, optional_positive_int
from layertap._choices import CAPTURE_MODES
from layertap._options import WriterOptions
from layertap._spec.format import key_problem
from layertap.errors import InvalidInputError, OptionError
from layertap.vllm.threads import default_writer_threads

#: The default host buffer pool holds this many full steps (``max_num_batched_tokens`` tokens of
#: hidden states each), so that the writer can fall behind for a few steps without stalling the
#: engine: on an H200 a Llama-3.2-1B prefill step hands over ~200 MB every ~40 ms (or, if more,
#: a burst: every running request, ``max_num_seqs``, finishing in one step at the longest
#: length, ``max_model_len``, as a batch of decodes does) ...
DEFAULT_POOL_STEPS = 4
#: ... but no less than this, and no less than twice the largest possible request ...
DEFAULT_MIN_POOL_BYTES = 256 << 20
#: ... and, unless the largest request needs more, no more than this (pinned memory is taken
#: from the host for the engine's lifetime). A burst the pool cannot hold waits in the KV cache
#: (its blocks held) and is gathered as the writer hands regions back.
DEFAULT_MAX_POOL_BYTES = 4 << 30
#: Keys remembered to refuse a repeat (``key_memory``): the most recent 2^18, about 30 MB for
#: keys of 40 characters, so that the memory of an engine serving for weeks stays bounded.
DEFAULT_KEY_MEMORY = 1 << 18


def default_pool_bytes(largest_request: int, full_step: int, max_num_seqs: int = 1) -> int:
    """The pool size when ``pool_bytes`` is not given (see the constants above)."""
    wanted = max(DEFAULT_POOL_STEPS * full_step, max_num_seqs * largest_request)
    return max(2 * largest_request, min(DEFAULT_MAX_POOL_BYTES, max(DEFAULT_MIN_POOL_BYTES, wanted)))


#: Values of the ``compress_on`` option: by the writer's threads, or on the GPU before the copy to
#: the host as exp-huf blocks (``gpu_compress.py``; docs/CONNECTOR.md, "Compression on the GPU").
COMPRESS_ON = ("host", "gpu")
#: Values of the ``save`` option (docs/CONNECTOR.md): ``"all"`` (the default: clients that send
#: nothing get records), or only requests that ask (``"save": true`` or a ``sample_id``), so that
#: a shared endpoint writes nothing for clients that never opted in.
SAVE = ("all", "requested")


class ConfigError(InvalidInputError):
    """A ``kv_connector_extra_config`` option (or vLLM's configuration) is refused; ``option`` names it."""

    def __init__(self, option: str, message: str):
        super().__init__(f"layertap connector: {option}: {message}")
        self.option = option
        self._message = message

    def __reduce__(self):  # pickles with both arguments (vLLM sends errors between processes)
        return type(self), (self.option, self._message)


#: The connector's keys for writer options, and the ``layertap.WriterOptions`` field each sets.
WRITER_KEYS: dict[str, str] = {
    "codec": "codec",
    "level": "level",
    "shard_size": "shard_size",
    "durability": "durability",
    "writer_threads": "threads",
    "max_inflight_bytes": "max_inflight_bytes",
    "batch_bytes": "batch_bytes",
    "io": "io",
    "direct": "direct",
    "writer_id": "writer_id",
    "shard_metadata": "metadata",
    "key_memory": "key_memory",
    "lossy": "lossy",
}
_KEY_OF_FIELD = {f: k for k, f in WRITER_KEYS.items()}
#: ``WriterOptions`` fields the connector does not offer, and why (a new writer field must be
#: offered or explained here).
WRITER_ONLY_FIELDS: dict[str, str] = {}


@dataclass(frozen=True)
class ConnectorOptions:
    """The validated ``kv_connector_extra_config`` (docs/CONNECTOR.md lists each option)."""

    output_dir: str
    """Dataset directory, absolute; with ``mooncake``, the spool records are written to first."""
    writer: str = "rust"
    pool_bytes: int | None = None
    """Size of the host buffer pool; None: ``default_pool_bytes``."""
    stats_path: str | None = None
    writer_options: WriterOptions = field(default_factory=WriterOptions)
    """The writer options given, the others at the writers' defaults (``writer_options_for``)."""
    given: frozenset[str] = frozenset()
    """The ``WriterOptions`` fields the configuration set."""
    capture: str = "method"
    layer_ids: tuple[int, ...] | None = None
    """As given (``capture="in-model"`` only; the method's are the speculative configuration's)."""
    compress_on: str = "host"
    mooncake: str | None = None
    mooncake_keep_shards: bool = False
    save: str = "all"

    @property
    def key_memory(self) -> int:
        return self.writer_options.key_memory or DEFAULT_KEY_MEMORY

    @property
    def writer_id(self) -> str | None:
        """The configured writer id; None: derived from vLLM's engine id."""
        return self.writer_options.writer_id


def writer_options_for(options: ConnectorOptions, writer_id: str, pool_bytes: int, shard_meta: Mapping[str, str]):
    """The options the worker opens its writer with: the configured ones, its writer id and shard
    metadata, and defaults of its own (twice the pool in flight: everything in flight lives in
    the pool, so ``submit`` never waits)."""
    changes: dict[str, Any] = {
        "writer_id": writer_id,
        "metadata": {**shard_meta, **options.writer_options.metadata},
    }
    if "threads" not in options.given:
        changes["threads"] = default_writer_threads()
    if "max_inflight_bytes" not in options.given:
        changes["max_inflight_bytes"] = 2 * pool_bytes
    if "key_memory" not in options.given:
        changes["key_memory"] = DEFAULT_KEY_MEMORY
    return options.writer_options.replace(**changes)


def _path(option: str, value: Any) -> str:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ConfigError(option, f"must be a non-empty path, not {value!r}")
    return os.path.abspath(os.fspath(value))


#: What a configuration that still names the removed pure-Python writer is told.
PYTHON_WRITER_REMOVED = "writer='python' was removed in 0.1.0: the Rust writer is the only writer; drop the option"


def _writer(value: Any) -> str:
    if value == "python":
        raise ConfigError("writer", PYTHON_WRITER_REMOVED)
    return one_of("writer", value, ("rust",), ConfigError)


def _capture(value: Any) -> str:
    return one_of("capture", value, CAPTURE_MODES, ConfigError)


def _gpu_compression_problem(extra_config: Mapping[str, Any], values: dict) -> ConfigError | None:
    codec = extra_config.get("codec")
    if codec is not None and codec != "exp-huf":
        return ConfigError(
            "codec",
            f'{codec!r} with compress_on="gpu": the GPU encodes exp-huf; leave codec out or give "exp-huf"',
        )
    if extra_config.get("lossy") is not None:
        return ConfigError(
            "lossy", 'not with compress_on="gpu" (the GPU encodes the values as they are); leave one of them out'
        )
    return None


def _layer_ids(value: Any) -> tuple[int, ...]:
    if (
        not isinstance(value, (list, tuple))
        or not value
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    ):
        raise ConfigError("layer_ids", f"must be a non-empty list of layer ids (integers), not {value!r}")
    if len(set(value)) != len(value):
        raise ConfigError("layer_ids", f"{list(value)} repeats a layer; give each id once")
    negative = [i for i in value if i < 0]
    if negative:
        raise ConfigError(
            "layer_ids", f"{negative} are negative: ids go from 0 (the embeddings) to the number of layers"
        )
    return tuple(value)


def in_model_layer_ids(extra_config: Any) -> tuple[int, ...] | None:
    """The layer ids a ``kv_connector_extra_config`` asks the model to cache itself
    (``capture="in-model"``), or None. Reads only those two keys, so that the model classes can
    read any connector's configuration when the model is built."""
    if not isinstance(extra_config, Mapping) or extra_config.get("capture") is None:
        return None
    if _capture(extra_config["capture"]) != "in-model":
        return None
    if extra_config.get("layer_ids") is None:
        raise ConfigError(
            "layer_ids", 'required with capture="in-model": the layer ids to record, e.g. [2, 16, 29, 32]'
        )
    return _layer_ids(extra_config["layer_ids"])


def refuse_speculation(spec: Any) -> None:
    """``capture="in-model"`` runs without speculative decoding: refuses a ``speculative_config``."""
    if spec is not None:
        raise ConfigError(
            "capture",
            f'"in-model" runs without speculative decoding, but speculative_config (method '
            f'{getattr(spec, "method", None)!r}) is set; remove it, or use capture="method"',
        )


def _store_address(value: Any) -> str:
    from layertap.mooncake.address import parse_address, refuse_node

    if not isinstance(value, str):
        raise ConfigError("mooncake", f"must be an address mooncake://MASTER_HOST:PORT/PREFIX, not {value!r}")
    try:
        refuse_node(parse_address(value), value)
    except InvalidInputError as e:
        raise ConfigError("mooncake", str(e)) from None
    return value


def _keep_shards(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError("mooncake_keep_shards", f"must be true or false, not {value!r}")
    return value


_CONNECTOR_PARSERS = {
    "output_dir": lambda v: _path("output_dir", v),
    "writer": _writer,
    "pool_bytes": lambda v: optional_positive_int("pool_bytes", v, ConfigError),
    "stats_path": lambda v: None if v is None else _path("stats_path", v),
    "capture": lambda v: "method" if v is None else _capture(v),
    "layer_ids": lambda v: None if v is None else _layer_ids(v),
    "compress_on": lambda v: "host" if v is None else one_of("compress_on", v, COMPRESS_ON, ConfigError),
    "mooncake": lambda v: None if v is None else _store_address(v),
    "mooncake_keep_shards": lambda v: False if v is None else _keep_shards(v),
    "save": lambda v: "all" if v is None else one_of("save", v, SAVE, ConfigError),
}

#: Every option ``kv_connector_extra_config`` may hold.
OPTION_NAMES: tuple[str, ...] = (*_CONNECTOR_PARSERS, *WRITER_KEYS)


def parse_options(extra_config: Mapping[str, Any] | None) -> ConnectorOptions:
    """Validates ``kv_connector_extra_config``; raises ``ConfigError`` naming the first bad option."""
    if extra_config is None:
        extra_config = {}
    if not isinstance(extra_config, Mapping):
        raise ConfigError("kv_connector_extra_config", f"must be a JSON object, not {extra_config!r}")
    unknown = sorted(set(extra_config) - set(OPTION_NAMES), key=str)
    for name in unknown:
        if name in WRITER_ONLY_FIELDS:
            raise ConfigError(name, WRITER_ONLY_FIELDS[name])
    if unknown:
        raise ConfigError(str(unknown[0]), f"unknown option; the options are: {', '.join(OPTION_NAMES)}")
    if "output_dir" not in extra_config:
        raise ConfigError("output_dir", "required: the dataset directory to write shards into")
    values = {k: parse(extra_config[k]) for k, parse in _CONNECTOR_PARSERS.items() if k in extra_config}
    if values.get("capture") == "in-model":
        in_model_layer_ids(extra_config)  # layer_ids is required
    elif values.get("layer_ids") is not None:
        raise ConfigError(
            "layer_ids",
            'only with capture="in-model"; with vLLM\'s extract_hidden_states method the layer ids are '
            "the speculative_config's eagle_aux_hidden_state_layer_ids",
        )
    # null means the default, as if the key were not there.
    given = {WRITER_KEYS[k]: v for k, v in extra_config.items() if k in WRITER_KEYS and v is not None}
    if values.get("compress_on") == "gpu":
        problem = _gpu_compression_problem(extra_config, values)
        if problem is not None:
            raise problem
        given["codec"] = "exp-huf"
    try:
        writer_options = WriterOptions(**given)
    except OptionError as e:
        raise ConfigError(_KEY_OF_FIELD[e.option], e.problem) from None
    return ConnectorOptions(**values, writer_options=writer_options, given=frozenset(given))


def sample_id_problem(sample_id: Any) -> str | None:
    """Why a client's ``sample_id`` cannot be a record key (docs/FORMAT.md, "Keys"), or None."""
    problem = key_problem(sample_id)
    return None if problem is None else f"sample_id: {problem.replace('record key', 'key', 1)}"
