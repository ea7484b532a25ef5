"""Fixtures of the trainer-integration tests; helpers are in trainers_support.py."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def verifier(tmp_path_factory) -> str:
    """The tiny verifier (4 layers, hidden 128) with a random final-norm weight, float32."""
    from trainers_support import build_verifier

    return build_verifier(tmp_path_factory.mktemp("verifier"))


@pytest.fixture(scope="session")
def truth(verifier):
    from trainers_support import Truth

    return Truth(verifier)


@pytest.fixture(scope="session")
def rows():
    from trainers_support import prepared_rows

    return prepared_rows(12)


@pytest.fixture(scope="session")
def hs_dataset(tmp_path_factory, rows, truth) -> str:
    """A bf16 layertap dataset of ``rows`` keyed by row index, layers [1, 2, 3, 4]."""
    from trainers_support import write_dataset

    path = tmp_path_factory.mktemp("hs") / "ds"
    write_dataset(path, rows, truth)
    return str(path)
