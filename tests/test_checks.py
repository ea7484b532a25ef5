"""The registry of choices and limits (``layertap._choices``), the kit of checks
(``layertap._checks``) and the resolver of backends (``layertap._backends``)."""

from __future__ import annotations

import pytest

from layertap import _choices
from layertap._backends import resolve_backend
from layertap._checks import error_for, flag, json_object, one_of, optional_positive_int, positive_int
from layertap.errors import InvalidInputError, OptionError
from layertap.generate.errors import GenerateError


def test_an_error_class_that_names_the_option_is_given_the_name():
    e = error_for(OptionError, "codec", "must be one of 'a', not 'b'")
    assert (type(e), e.option, e.problem) == (OptionError, "codec", "must be one of 'a', not 'b'")
    assert str(e) == "codec must be one of 'a', not 'b'"
    e = error_for(GenerateError, "--limit", "must be a positive integer, not 0")
    assert type(e) is GenerateError and str(e) == "--limit must be a positive integer, not 0"


@pytest.mark.parametrize(
    ("check", "message"),
    [
        (
            lambda: one_of("io", "mmap", ("auto", "uring", "pwrite")),
            "io must be one of 'auto', 'uring', 'pwrite', not 'mmap'",
        ),
        (lambda: positive_int("n", 0), "n must be a positive integer, not 0"),
        (lambda: positive_int("n", True), "n must be a positive integer, not True"),
        (lambda: positive_int("n", 1 << 64, below=1 << 64), r"n must be a positive integer below 2\*\*64, not"),
        (lambda: optional_positive_int("n", -1), "n must be a positive integer, not -1"),
        (lambda: flag("direct", 1), "direct must be True or False, not 1"),
        (lambda: flag("include_output_tokens", "yes", json_words=True), "must be true or false, not 'yes'"),
        (lambda: json_object("--engine-args", "{x"), "--engine-args is not JSON: "),
        (lambda: json_object("--engine-args", "[1]"), r"--engine-args must be a JSON object, not \[1\]"),
    ],
)
def test_each_check_says_what_the_value_must_be_and_what_it_is(check, message):
    with pytest.raises(InvalidInputError, match=message):
        check()


def test_checks_give_back_what_they_accept():
    assert one_of("io", "pwrite", ("auto", "uring", "pwrite")) == "pwrite"
    assert positive_int("n", 3) == 3 and optional_positive_int("n", None) is None
    assert (
        json_object("x", None) == {}
        and json_object("x", '{"a": 1}') == {"a": 1}
        and json_object("x", {"b": 2}) == {"b": 2}
    )


def test_the_resolver_falls_back_only_for_auto():
    def no_extension():
        raise ImportError("no _native here")

    assert resolve_backend("backend", "auto", rust=lambda: "rust", python=lambda: "python") == "rust"
    assert resolve_backend("backend", "auto", rust=no_extension, python=lambda: "python") == "python"
    assert resolve_backend("backend", "python", rust=no_extension, python=lambda: "python") == "python"
    with pytest.raises(ImportError, match=r"backend 'rust' is not available: .*\(no _native here\).*backend='python'"):
        resolve_backend("backend", "rust", rust=no_extension, python=lambda: "python")
    with pytest.raises(OptionError, match="backend 'rust' is not available") as info:
        resolve_backend("backend", "rust", rust=no_extension, python=str, unavailable=OptionError)
    assert info.value.option == "backend" and isinstance(info.value.__cause__, ImportError)
    with pytest.raises(InvalidInputError, match="backend must be one of 'auto', 'rust', 'python', not 'c'"):
        resolve_backend("backend", "c", rust=str, python=str, choices=_choices.READER_BACKENDS)


def test_the_limits_are_the_rust_cores():
    native = pytest.importorskip("layertap._native")
    assert native.MAX_THREADS == _choices.MAX_THREADS


def test_the_connector_offers_the_registrys_capture_modes():
    from layertap.vllm import config

    assert config.CAPTURE_MODES == _choices.CAPTURE_MODES
