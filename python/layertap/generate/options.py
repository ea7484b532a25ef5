"""The options of a ``layertap generate`` run, each defined once (issue 35, item 2) as a field of
``GenerateOptions``: the function's keyword arguments, the command line's flags
(``add_arguments``) and what the engines of a run of many get (``as_json``) come from it, so that
a flag, its default and its help cannot drift apart.

Every check of a value alone (or of two together) is made when the options are built, before
anything is read or started, in the same words from Python and from the command line
(``--max-tokens must be a positive integer, not 0``). What needs the model, the data or vLLM is
checked by ``run.check_options``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from typing import Any

from layertap._checks import flag, is_int, json_object, one_of, positive_int
from layertap._choices import CAPTURE_MODES, DEFAULT_CAPTURE
from layertap.generate.errors import GenerateError
from layertap.generate.progress import PROGRESS_MODES
from layertap.generate.render import LOSS_MASK_MODES
from layertap.mooncake.address import is_store_address
from layertap.vllm.window import REDUCTIONS
from layertap.vllm.window import check as check_window_request

#: ``LLM`` arguments that generate sets itself.
RESERVED_ENGINE_ARGS = ("model", "speculative_config", "kv_transfer_config")
#: Connector options that generate sets itself (``capture`` and ``layer_ids`` from ``--capture``
#: and ``--layers``).
RESERVED_CONNECTOR_ARGS = ("output_dir", "writer_id", "shard_metadata", "capture", "layer_ids")


def _option(default: Any, help: str, check: Callable[[str, Any], Any] | None = None, **cli: Any) -> Any:
    """A field of ``GenerateOptions``: ``check`` returns the value to keep (or raises
    GenerateError naming the flag); ``cli``: ``flag``, ``metavar``, ``choices``."""
    return field(default=default, metadata={"help": help, "check": check, **cli})


def _kit(check: Callable) -> Callable[[str, Any], Any]:
    return lambda name, value: check(name, value, GenerateError)


def _path(name: str, value: Any) -> str:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise GenerateError(f"{name} must be a {'model name or ' if name == 'model' else ''}path, not {value!r}")
    return os.fspath(value)


def _layers(name: str, value: Any) -> list[int]:
    """Layer ids as given (a list, or ``"2,16,29,32"``); their range is the model's to say."""
    if isinstance(value, str):
        try:
            value = [int(p) for p in value.replace(" ", "").split(",") if p]
        except ValueError:
            raise GenerateError(f"{name} must be comma-separated integers, got {value!r}") from None
    if not isinstance(value, (list, tuple)) or not value or not all(is_int(i) for i in value):
        raise GenerateError(f"{name} must be a non-empty list of integers, got {value!r}")
    if len(set(value)) != len(value):
        raise GenerateError(f"{name} {list(value)} repeat an id; give each once")
    return list(value)


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise GenerateError(f"{name} must be a positive number of seconds, not {value!r}")
    return float(value)


def _json_without(reserved: tuple[str, ...]) -> Callable[[str, Any], dict]:
    """A JSON option (a dict, JSON text or None) as a dict without the keys generate sets; the
    other keys are checked once vLLM is imported (``engine.check_engine_args``...)."""

    def check(name: str, value: Any) -> dict:
        value = json_object(name, value, GenerateError)
        given = [k for k in value if k in reserved]
        if given:
            raise GenerateError(f"{name} may not set {given[0]!r}: layertap generate sets it")
        return value

    return check


def _sampling_args(name: str, value: Any) -> dict:
    value = _json_without(())(name, value)
    if value.get("n", 1) != 1:
        raise GenerateError(f"{name}: n must be 1 (one record per row)")
    return value


def _ray_address(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise GenerateError(f"{name} must be a Ray cluster's address (or 'auto'), not {value!r}")
    return value


def check_window(window: Any, reduction: Any) -> list | None:
    """``--window`` (a list of two integers or None, or ``START:END``) as the connector's
    ``[start, end]``; checks ``reduction`` too."""
    if isinstance(window, str):
        parts = window.split(":")
        try:
            if len(parts) != 2:
                raise ValueError
            window = [int(p) if p.strip() else None for p in parts]
        except ValueError:
            raise GenerateError(
                f"--window must be START:END (integers, either may be empty, negative counting from the end), got {window!r}"
            ) from None
    if isinstance(window, tuple):
        window = list(window)
    _, problem = check_window_request({"window": window, "reduction": reduction})
    if problem:
        raise GenerateError(f"--{problem}")
    if window is not None and _holds_no_token(*window):
        start, end = ("" if b is None else b for b in window)
        raise GenerateError(
            f"--window {start}:{end} holds no token of any row (as a Python slice, END must come after START): "
            "e.g. 0:64 for the first 64 positions, -64: for the last 64"
        )
    return window


def _holds_no_token(start: int | None, end: int | None) -> bool:
    """Whether the slice ``[start:end]`` is empty whatever the sequence's length."""
    if end == 0:
        return True
    return start is not None and end is not None and (start < 0) == (end < 0) and end <= start


@dataclass(frozen=True)
class GenerateOptions:
    """The options of a ``layertap generate`` run (docs/GENERATE.md, "Options"), checked when
    built: GenerateError naming the flag otherwise. The JSON options are kept as dicts, given as
    dicts or JSON text; ``window`` as ``[start, end]``, given so or as ``"START:END"``;
    ``layers`` as a list, given so or as ``"2,16,29,32"``. The fields:
    """

    model: str = _option(MISSING, "model name or path, as vLLM takes it", _path, flag="model", metavar="MODEL")
    data: str = _option(
        MISSING,
        "JSONL file, Parquet file, or Hugging Face datasets directory (save_to_disk) with input_ids, messages or "
        "prompt, and optionally loss_mask",
        _path,
        metavar="DATA",
    )
    out: str = _option(
        MISSING,
        "dataset directory (created; resumed when it holds an earlier run's dataset; a directory holding other "
        "files is refused unless --allow-other-files), or a dataset in Mooncake Store: "
        "mooncake://MASTER_HOST:PORT/PREFIX (docs/MOONCAKE.md)",
        _path,
        metavar="DIR",
    )
    _: dataclasses.KW_ONLY
    allow_other_files: bool = _option(
        False,
        "write into --out (or --also-dir) although it holds files that are not a layertap dataset's "
        "(they are left as they are; readers ignore them)",
        _kit(flag),
    )
    also_dir: str | None = _option(
        None,
        "with --out mooncake://...: keep the run's shards in DIR too (resumable; else a temporary spool)",
        _path,
        metavar="DIR",
    )
    layers: list[int] | None = _option(
        None,
        "comma-separated layer ids in vLLM numbering (N = the last layer's output before the final norm); "
        "default EAGLE-3's 2,N//2,N-3,N",
        _layers,
        metavar="IDS",
    )
    capture: str = _option(
        DEFAULT_CAPTURE,
        "how vLLM caches the hidden states: method (vLLM's extract_hidden_states) or in-model (layertap's "
        "model class, no speculative decoding: faster decode; docs/CONNECTOR.md)",
        choices=CAPTURE_MODES,
    )
    max_tokens: int = _option(1, "tokens to generate per row (1: prefill only)", _kit(positive_int), metavar="N")
    include_output_tokens: bool = _option(False, "record the generated tokens too (all but the last)", _kit(flag))
    window: list | None = _option(
        None,
        "record only positions [START, END) of each row's recorded tokens (either may be empty; negative "
        "counts from the end), e.g. 100: or -64: or -64:-1 (docs/CONNECTOR.md, 'Windows and reductions')",
        metavar="START:END",
    )
    reduction: str | None = _option(
        None,
        "store one vector per layer per row ([1, layers, hidden]): the window's last position, or the mean of "
        "its positions",
        choices=REDUCTIONS,
    )
    max_len: int | None = _option(
        None,
        "longest prompt in tokens; longer rows are skipped and listed (default: the model's context minus "
        "--max-tokens)",
        _kit(positive_int),
        metavar="N",
    )
    loss_mask: str = _option(
        "auto",
        "the loss mask stored with each record: auto (the data's loss_mask column, else for chats the "
        "assistant's turns when the chat template marks them with {% generation %}), assistant (those turns; "
        "refused without the markers), none (docs/GENERATE.md, 'Loss masks')",
        choices=LOSS_MASK_MODES,
    )
    limit: int | None = _option(None, "use only the first N rows", _kit(positive_int), metavar="N")
    engine_args: dict = _option(  # None or JSON text given: a dict kept
        None,
        "other vLLM LLM() arguments, e.g. '{\"tensor_parallel_size\": 2}'",
        _json_without(RESERVED_ENGINE_ARGS),
        metavar="JSON",
    )
    sampling_args: dict = _option(  # None or JSON text given: a dict kept
        None, "SamplingParams arguments, e.g. '{\"temperature\": 0}'", _sampling_args, metavar="JSON"
    )
    connector_args: dict = _option(  # None or JSON text given: a dict kept
        None,
        'connector options (docs/CONNECTOR.md), e.g. \'{"codec": "zstd"}\'; default Rust writer, bp16-zstd',
        _json_without(RESERVED_CONNECTOR_ARGS),
        metavar="JSON",
    )
    data_parallel_size: int | None = _option(
        None,
        "run N engines (each on its own tensor_parallel_size GPUs), each writing a part of --out; rows are dealt "
        "out among them (docs/SCALE.md)",
        _kit(positive_int),
        metavar="N",
    )
    ray_address: str | None = _option(
        None,
        "run the engines on the Ray cluster at ADDRESS ('auto': the one this machine belongs to); --out must be "
        "on a file system every node sees",
        _ray_address,
        flag="--ray",
        metavar="ADDRESS",
    )
    progress: str = _option(
        "auto",
        "bar (a terminal), lines (periodic lines), none; auto: bar on a terminal, else lines",
        choices=PROGRESS_MODES,
    )
    progress_interval: float = _option(10.0, "seconds between progress lines", _seconds, metavar="S")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, name, check = getattr(self, f.name), flag_of(f), f.metadata["check"]
            if value is None and f.default is None and f.type != "dict":
                continue  # an option left out (the JSON options are kept as dicts, empty ones too)
            if "choices" in f.metadata:
                value = one_of(name, value, f.metadata["choices"], GenerateError)
            if check is not None:
                value = check(name, value)
            object.__setattr__(self, f.name, value)
        object.__setattr__(self, "window", check_window(self.window, self.reduction))
        if self.also_dir is not None and not is_store_address(self.out):
            raise GenerateError("--also-dir goes with --out mooncake://...: a run to a directory writes there")

    def as_json(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> GenerateOptions:
        return dataclasses.replace(self, **changes)


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _number_or_text(text: str) -> int | float | str:
    """A number from the command line, else the text, which the option's check then refuses in
    the same words as a value from Python."""
    for number in (int, float):
        try:
            return number(text)
        except ValueError:
            pass
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """A flag per option (the model: positional). An option not given is left out of the
    namespace, so that ``from_namespace`` takes ``GenerateOptions``' own default."""
    for f in dataclasses.fields(GenerateOptions):
        meta = f.metadata
        name = flag_of(f)
        help = meta["help"].replace("%", "%%")
        if f.default not in (None, False, MISSING):
            help += f" (default: {f.default})"
        kw: dict[str, Any] = {"help": help}
        if "metavar" in meta:
            kw["metavar"] = meta["metavar"]
        if "choices" in meta:
            kw["metavar"] = "{" + ",".join(meta["choices"]) + "}"
        if not name.startswith("-"):
            parser.add_argument(name, **kw)
            continue
        kw.update(dest=f.name, default=argparse.SUPPRESS, required=f.default is MISSING)
        if f.type == "bool":
            kw["action"] = "store_true"
        elif f.type in ("int", "int | None", "float"):
            kw["type"] = _number_or_text
        parser.add_argument(name, **kw)


def from_namespace(args: argparse.Namespace) -> GenerateOptions:
    return GenerateOptions(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(GenerateOptions) if hasattr(args, f.name)}
    )


GenerateOptions.__doc__ = (GenerateOptions.__doc__ or "") + "".join(
    f"\n    ``{f.name}`` ({flag_of(f)}): {f.metadata['help']}." for f in dataclasses.fields(GenerateOptions)
)
