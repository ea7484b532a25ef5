"""The Rust core's errors map one to one onto ``layertap.errors`` (rust/python/src/errors.rs):
every variant of ``layertap_core::Error`` to a class of its own, an option the core refuses to an
``OptionError`` naming it."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

from layertap import errors
from layertap.errors import CodecError, LayertapError, OptionError

ROOT = Path(__file__).resolve().parents[1]


def _variants() -> list[str]:
    text = (ROOT / "rust/core/src/error.rs").read_text(encoding="utf-8")
    body = text[text.index("pub enum Error {") : text.index("\n}\n", text.index("pub enum Error {"))]
    return re.findall(r"^    ([A-Z][A-Za-z]+)\b", body, flags=re.M)


def _mapped_class(variant: str) -> str | None:
    """The class the binding's arm for ``Error::variant`` builds (arms may share one)."""
    text = (ROOT / "rust/python/src/errors.rs").read_text(encoding="utf-8")
    at = re.search(rf"Error::{variant}\b", text)
    found = at and re.search(r'class\(py, "(\w+)"\)', text[at.end() :])
    return found.group(1) if found else None


def test_every_core_error_has_a_class_of_its_own():
    variants = _variants()
    assert {"InvalidInput", "InvalidOption", "Codec", "CorruptIndex"} <= set(variants)
    for variant in variants:
        name = _mapped_class(variant)
        assert name is not None, f"Error::{variant} is not mapped in rust/python/src/errors.rs"
        cls = getattr(errors, name)
        assert issubclass(cls, LayertapError) and cls is not LayertapError, (variant, cls)
    assert _mapped_class("InvalidOption") == "OptionError" and _mapped_class("Codec") == "CodecError"


@pytest.mark.parametrize(
    ("changes", "option", "problem"),
    [
        ({"threads": 0}, "threads", "must be None or an integer from 1 to 256, not 0"),
        ({"threads": 257}, "threads", "must be None or an integer from 1 to 256, not 257"),
        ({"shard_size": 0}, "shard_size", "must be a positive integer below 2**64, not 0"),
        ({"batch_bytes": 0}, "batch_bytes", "must be a positive integer below 2**64, not 0"),
        ({"level": 99}, "level", "must be a zstd level from -131072 to 22, not 99"),
        ({"key_memory": 0}, "key_memory", "must be a positive integer below 2**64, not 0"),
        ({"durability": 0}, "durability", "must be 'none', 'close' or a positive number of bytes, not 0"),
        (
            {"writer_id": "a/b"},
            "writer_id",
            "must be None or 1 to 64 characters from [A-Za-z0-9._-], not starting with '.', not 'a/b'",
        ),
        ({"codec": "lz4"}, "codec", "must be one of 'none', 'zstd', 'bp16-zstd', 'exp-huf', not 'lz4'"),
        ({"lossy": "int8"}, "lossy", "must be None or 'fp8-e4m3', not 'int8'"),
        ({"io": "mmap"}, "io", "must be one of 'auto', 'uring', 'pwrite', not 'mmap'"),
    ],
)
def test_an_option_the_core_refuses_is_an_option_error(changes, option, problem):
    """Values of the right type that the core's checks refuse (``WriterConfig::validate``, the
    option parsers: rust/core/src/options.rs has the words): an ``OptionError`` naming the
    option, worded as the binding's type checks word theirs."""
    native = pytest.importorskip("layertap._native")
    with pytest.raises(OptionError) as info:
        native.WriterOptions(**changes)
    assert (info.value.option, info.value.problem) == (option, problem)
    assert str(info.value) == f"{option} {problem}"


def test_the_native_writer_takes_only_checked_options(tmp_path):
    """No way around the checks: the native writer takes a ``WriterOptions``, not its fields."""
    native = pytest.importorskip("layertap._native")
    with pytest.raises(TypeError):
        native.NativeShardWriter(str(tmp_path / "ds"), {"codec": "zstd", "threads": 0})
    assert not (tmp_path / "ds").exists()


def test_codec_error_carries_its_details_across_processes():
    e = CodecError("codec zstd: Allocation error", "zstd", "Allocation error")
    back = pickle.loads(pickle.dumps(e))
    assert (type(back), str(back), back.codec, back.reason) == (CodecError, str(e), "zstd", "Allocation error")
