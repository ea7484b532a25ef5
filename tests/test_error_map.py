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


def _native_writer(path, **changes):
    native = pytest.importorskip("layertap._native")
    kwargs = {
        "codec": "zstd",
        "level": 1,
        "shard_size": 1 << 20,
        "durability": "close",
        "threads": 1,
        "max_inflight_bytes": 1 << 20,
        "batch_bytes": 1 << 20,
        "writer_id": None,
        "io": "auto",
        "direct": False,
        "metadata": {},
        "lossy": None,
        "key_memory": None,
    }
    return native.NativeShardWriter(str(path), **{**kwargs, **changes})


@pytest.mark.parametrize(
    ("changes", "option", "problem"),
    [
        ({"threads": 0}, "threads", "must be an integer from 1 to 256, not 0"),
        ({"threads": 257}, "threads", "must be an integer from 1 to 256, not 257"),
        ({"shard_size": 0}, "shard_size", "must be a positive integer, not 0"),
        ({"batch_bytes": 0}, "batch_bytes", "must be a positive integer, not 0"),
        ({"level": 99}, "level", "must be a zstd level from"),
        ({"key_memory": 0}, "key_memory", "must be a positive integer"),
        ({"writer_id": "a/b"}, "writer_id", "must be None or 1 to 64 characters"),
        ({"codec": "lz4"}, "codec", "must be one of 'none', 'zstd', 'bp16-zstd', 'exp-huf', not \"lz4\""),
        ({"lossy": "int8"}, "lossy", "must be one of 'fp8-e4m3' or None, not \"int8\""),
        ({"io": "mmap"}, "io", "must be one of 'auto', 'uring', 'pwrite', not \"mmap\""),
    ],
)
def test_an_option_the_core_refuses_is_an_option_error(tmp_path, changes, option, problem):
    """What the Python checks (``WriterOptions``) would refuse first, given to the native writer
    directly: the core names the option, as ``OptionError`` does."""
    with pytest.raises(OptionError) as info:
        _native_writer(tmp_path, **changes)
    assert info.value.option == option and info.value.problem.startswith(problem), info.value
    assert str(info.value) == f"{option} {info.value.problem}"
    assert not list(tmp_path.iterdir())


def test_codec_error_carries_its_details_across_processes():
    e = CodecError("codec zstd: Allocation error", "zstd", "Allocation error")
    back = pickle.loads(pickle.dumps(e))
    assert (type(back), str(back), back.codec, back.reason) == (CodecError, str(e), "zstd", "Allocation error")
