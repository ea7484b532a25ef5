"""Fixtures shared by the Python tests; plain helper functions are in helpers.py."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest


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
