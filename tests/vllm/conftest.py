"""Fixtures of the vLLM tests: a folder for vLLM's caches and sockets, the tiny model, the
transformers reference. Helpers that tests import are in vllm_support.py."""

from __future__ import annotations

import os
import tempfile

import pytest


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
    for folder in ("TMPDIR", "VLLM_CACHE_ROOT"):  # the others are flags, not folders
        os.makedirs(values[folder], exist_ok=True)
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


_inspected_here = False


@pytest.fixture(scope="module", autouse=True)
def _model_classes_inspected_in_this_process(request):
    """The modules with tests marked ``vllm`` inspect vLLM's model classes in this process, not in
    a child that imports vLLM for each architecture (``vllm_support.inspect_models_in_this_process``).
    Module-scoped and autouse, so that it comes before the module's own engine or server fixtures."""
    global _inspected_here
    if _inspected_here:
        return
    items = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    if not any(item.get_closest_marker("vllm") for item in items):
        return
    from vllm_support import inspect_models_in_this_process

    inspect_models_in_this_process()
    _inspected_here = True


@pytest.fixture(scope="module", autouse=True)
def _collections_of_the_modules_objects(_model_classes_inspected_in_this_process):
    """Each module's tests, its fixtures included, run inside
    ``vllm_support.collections_of_young_objects``: the garbage collections of vLLM's engines
    in this process (about twelve an engine) look at the objects made since the module began,
    not at everything the test process has gathered. ``running_llm`` and ``in_process_command``
    do it for their engines; this covers the rest (``layertap.generate`` called by a test or a
    module fixture, vLLM's own imports), whose collections grew with the worker: a 4 s in-process
    run of test_generate.py took 11.5 s after test_plugin_values.py in the same process.

    An engine's objects that vLLM freezes as it starts stay frozen (its unfreezing does nothing
    inside) until the module ends, then Python's collector takes them: test_plugin_values.py and
    test_generate.py's in-process tests (about twenty engines) peaked at 1.86 GB in 115 s; with
    a full collection after each engine instead, at 1.81 GB in 144 s."""
    from vllm_support import collections_of_young_objects

    with collections_of_young_objects():
        yield
    # No collection here: the module's garbage is collected when Python's own collector next
    # runs, as before this fixture. One here found a client socket to test_trainers.py's vllm
    # serve left unclosed in a reference cycle (which vLLM's collections in later modules had
    # kept frozen) and failed the module's last test with its ResourceWarning (a fresh-clone CI
    # run at f710646; the test now closes that client).


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A random 4-layer Llama (hidden 128) and its tokenizer, built locally."""
    from tiny_llama import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def reference(tiny_model):
    from vllm_support import Reference

    return Reference(tiny_model)


@pytest.fixture
def in_process_command(monkeypatch):
    """``layertap generate`` run in this process with its engine in this process too (3 s of
    start-up instead of 12); the variables the command sets for vLLM's logging stay out of other
    tests. vLLM's garbage collections look at the test's objects only
    (``vllm_support.collections_of_young_objects``)."""
    from vllm_support import collections_of_young_objects

    saved = dict(os.environ)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for var in ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM"):
        monkeypatch.delenv(var, raising=False)
    with collections_of_young_objects():
        yield
    os.environ.clear()
    os.environ.update(saved)
