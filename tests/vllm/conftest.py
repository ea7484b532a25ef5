"""Fixtures of the vLLM tests: a folder for vLLM's caches and sockets, the tiny model, the
transformers reference. Helpers that tests import are in vllm_support.py."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest


def _reexport_root_conftest_helpers() -> None:
    # The other test files import helpers with ``from conftest import ...`` from tests/conftest.py.
    # pytest imports every conftest.py under the module name "conftest", the last one imported
    # winning, so this module must offer those helpers too (its fixtures and hooks stay there).
    root = Path(__file__).resolve().parents[1] / "conftest.py"
    spec = importlib.util.spec_from_file_location("_layertap_tests_conftest", root)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, value in vars(module).items():
        if name.startswith(("_", "pytest_")) or name in globals() or _is_fixture(value):
            continue
        globals()[name] = value


def _is_fixture(value) -> bool:
    return type(value).__name__ == "FixtureFunctionDefinition" or hasattr(value, "_pytestfixturefunction")


_reexport_root_conftest_helpers()


@pytest.fixture(scope="session", autouse=True)
def vllm_env(tmp_path_factory):
    """vLLM's IPC sockets, temporary files and caches go to a folder of the test session."""
    root = tmp_path_factory.mktemp("vllm-env")
    values = {
        "TMPDIR": str(root / "tmp"),
        "VLLM_CACHE_ROOT": str(root / "cache"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    for v in values.values():
        os.makedirs(v, exist_ok=True)
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    tempfile.tempdir = None  # re-read TMPDIR
    yield root
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    tempfile.tempdir = None


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A random 4-layer Llama (hidden 128) and its tokenizer, built locally."""
    from layertap._tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def reference(tiny_model):
    from vllm_support import Reference

    return Reference(tiny_model)
