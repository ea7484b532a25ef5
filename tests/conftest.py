"""Fixtures shared by the Python tests; plain helper functions are in helpers.py."""

from __future__ import annotations

import os

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
