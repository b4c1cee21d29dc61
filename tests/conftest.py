"""Fixtures: the recorded reference runs of tests/data (see helpers.py)."""

from __future__ import annotations

import pytest
from helpers import GOLDEN_FILES, Golden, load_golden


@pytest.fixture(scope="session", params=GOLDEN_FILES)
def golden(request) -> Golden:
    return load_golden(request.param)


@pytest.fixture(scope="session")
def small() -> Golden:
    return load_golden("small_seed0.npz")
