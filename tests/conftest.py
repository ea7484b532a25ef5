"""Fixtures shared by the Python tests; plain helper functions are in helpers.py."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def dataset_dir(tmp_path):
    """A dataset directory path (not created)."""
    return tmp_path / "ds"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
