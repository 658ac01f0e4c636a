"""The rank pool reports every rank's failure: tracebacks, exit codes of dead ranks, who never answered."""

from __future__ import annotations

import os

import pytest
import torch

from ringtune.testing.harness import RankPool


@pytest.fixture(scope="module")
def pool2():
    pool = RankPool(2, timeout=60)
    yield pool
    pool.close()


def sum_case(ctx, *, value: float) -> float:
    t = torch.tensor([value * (ctx.rank + 1)])
    torch.distributed.all_reduce(t)
    return float(t)


def raise_on_rank_case(ctx, *, bad: int) -> int:
    if ctx.rank == bad:
        raise ValueError(f"deliberate failure on rank {ctx.rank}")
    return ctx.rank


def exit_on_rank_case(ctx, *, bad: int) -> int:
    if ctx.rank == bad:
        os._exit(7)
    return ctx.rank


def test_results_in_rank_order(pool2):
    assert pool2.run(sum_case, value=1.5) == [4.5, 4.5]


def test_a_raising_rank_is_named_with_its_traceback_and_the_others_reported(pool2):
    with pytest.raises(RuntimeError) as err:
        pool2.run(raise_on_rank_case, bad=1)
    text = str(err.value)
    assert "rank 1:" in text and "deliberate failure on rank 1" in text
    assert "ranks done: [0]" in text
    assert pool2.run(sum_case, value=1.0) == [3.0, 3.0]  # restarted, usable


def test_a_dead_rank_is_named_with_its_exit_code(pool2):
    with pytest.raises(RuntimeError, match=r"rank 0 died \(exit code 7\)"):
        pool2.run(exit_on_rank_case, bad=0)
    assert pool2.run(sum_case, value=2.0) == [6.0, 6.0]
