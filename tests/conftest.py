"""Fixtures shared by the Python tests; plain helper functions are in helpers.py."""

from __future__ import annotations

import os
import sys

# OpenMP threads that wait for work sleep rather than spin, in this process and every child the
# tests start (they inherit it). torch's libgomp reads the policy once, as it loads, so it is
# set before anything imports torch. vLLM's engines run torch with two OpenMP threads pinned to
# the same two cores in every process (make test's two workers, each worker's engine
# processes); spinning, a waiting thread held the core the other process's thread needed:
# test_hybrid_values.py run twice at once took 38 s of user CPU and 40 s each, 17.8 s and
# 17.5 s alone; passive, 16.5 s and 19 s each at once. Same threads, same work: what a test
# computes is unchanged. A policy set by the caller is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest

#: Seconds the suite's longest files took (their tests' ``--durations`` summed, in a whole
#: fresh-clone run on the 2-core machine beside other work, 2026-12-06; only their order
#: matters). A file not listed counts ``SECONDS_A_TEST`` a test (that run's mean over the others).
LONGEST_FILES = {
    "vllm/test_generate_start_stop.py": 158,
    "vllm/test_trainers.py": 92,
    "vllm/test_generate_resume.py": 74,
    "vllm/test_generate_parallel.py": 68,
    "vllm/test_serve.py": 59,
    "vllm/test_values.py": 56,
    "vllm/test_in_model.py": 54,
    "vllm/test_plugin_values.py": 53,
    "vllm/test_generate.py": 53,
    "vllm/test_mooncake.py": 50,
    "vllm/test_generate_checked_first.py": 47,
    "test_torn_shards.py": 45,
    "vllm/test_generate_prepared_data.py": 42,
    "vllm/test_tensor_parallel.py": 36,
    "mooncake/test_store.py": 34,
    "vllm/test_generate_disk_full.py": 34,
    "test_triton_exphuf_decoder.py": 32,
    "test_writers.py": 30,
    "mooncake/test_faults.py": 29,
    "vllm/test_vision_language.py": 28,
    "trainers/test_modelopt.py": 25,
    "trainers/test_speculators.py": 24,
    "test_cli.py": 24,
    "test_triton_torch_decode.py": 23,
    "test_triton_exphuf_encoder.py": 23,
    "vllm/test_config.py": 22,
    "test_doctor.py": 21,
    "test_fuzz_readers.py": 18,
    "test_dataset.py": 17,
    "test_inspect_stats.py": 16,
    "trainers/test_specforge.py": 14,
    "vllm/test_vllm_interface.py": 14,
    "test_lost_in_recovery.py": 12,
    "test_crash.py": 11,
    "trainers/test_export.py": 11,
    "test_makefile.py": 10,
    "vllm/test_hybrid_values.py": 10,
    "test_writer_gil.py": 9,
}
SECONDS_A_TEST = 0.4


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first, each file's tests together and in their order. pytest-xdist's
    workers (``make test``: ``--dist loadfile --no-loadscope-reorder``) take whole files in this
    order as each runs out of work, so the last files to start are the shortest and the workers
    finish together; xdist's own order, most tests first, left a 20-second file or a 3-minute
    one to the end by chance (simulated with the measured durations: a worker finished 23 s
    after the other in the median run of random +-40% durations, 50 s in one of ten; in this
    order 3 s and 6 s)."""
    counts: dict[str, int] = {}
    for item in items:
        counts[_file_of(item)] = counts.get(_file_of(item), 0) + 1

    def seconds(file: str) -> float:
        return LONGEST_FILES.get(file, SECONDS_A_TEST * counts[file])

    items.sort(key=lambda item: -seconds(_file_of(item)))  # stable: a file's tests keep their order


def _file_of(item: pytest.Item) -> str:
    """The test file, relative to tests/ (``vllm/test_serve.py``)."""
    return os.path.relpath(item.path, os.path.dirname(__file__)).replace(os.sep, "/")


@pytest.fixture
def dataset_dir(tmp_path):
    """A dataset directory path (not created)."""
    return tmp_path / "ds"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def seed() -> int:
    """The seed of a test's random choices: ``LAYERTAP_TEST_SEED`` when set (to repeat a failed
    run's choices, or to try others), else 0. Printed, so that a failing test's report shows it
    (pytest prints the captured output of a failing test's setup)."""
    value = int(os.environ.get("LAYERTAP_TEST_SEED") or 0)
    print(f"random seed {value} (LAYERTAP_TEST_SEED={value} repeats this test's choices)")
    return value


@pytest.fixture(autouse=True)
def _global_generators_seeded(seed):
    """Every test starts from the same state of the global generators of numpy (the legacy
    one) and torch (when imported), from ``seed``: a test that draws from them without a
    generator of its own (``torch.randn(5, 8)``) draws the same values in every run, whatever
    ran before it, and its report shows the seed. Not ``random``'s: what picks names or ports
    with it would pick the same ones in every test process."""
    np.random.seed(seed)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)
