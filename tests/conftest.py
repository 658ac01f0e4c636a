"""Shared fixtures: one gloo rank pool per test module (spawning costs seconds); one intra-op thread."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from support.harness import RankPool


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


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module of tiny kernels: OpenMP spin-waits cost ~10x on a busy 2-core box.
    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
