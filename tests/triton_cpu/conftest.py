"""One pair of gloo ranks for every multi-rank test of this folder (run by ``tests/test_triton_cpu.py`` in a child
pytest): the workers' start and fla's interpreted import in each worker are paid once, not once per file."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.harness import RankPool
from support.triton_interpreter import missing_reason


@pytest.fixture(scope="session")
def interpreted_pool2() -> Iterator[RankPool]:
    """Two gloo ranks whose cases run fla under Triton's interpreter; skips (with the reason) where fla is missing."""
    reason = missing_reason("fla")
    if reason is not None:
        pytest.skip(reason)
    pool = RankPool(2, timeout=600)
    yield pool
    pool.close()
