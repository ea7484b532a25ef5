"""Fixtures of the Mooncake tests: a real store on loopback ports (store_support.py)."""

from __future__ import annotations

import pytest
from store_support import LoopbackStore


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = LoopbackStore(str(tmp_path_factory.mktemp("mooncake")))
    try:
        yield s
    finally:
        s.stop()
