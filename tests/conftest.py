"""Shared fixtures: one gloo rank pool per test module (spawning costs seconds)."""

from __future__ import annotations

import pytest

from ringtune.testing.harness import RankPool


@pytest.fixture(scope="module")
def pool4():
    pool = RankPool(4, timeout=180)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def pool8():
    pool = RankPool(8, timeout=180)
    yield pool
    pool.close()
