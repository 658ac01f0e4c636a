"""The rank pool reports every rank's failure: tracebacks, exit codes of dead ranks, who never answered; a
crash of the transport alone is retried once with a warning, a Python error never."""

from __future__ import annotations

import os

import pytest
import torch
from support.harness import RankPool


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


def exit_once_case(ctx, *, marker: str) -> int:
    """Rank 0's process dies the first time (no Python error: a crash), the others wait in a collective."""
    if ctx.rank == 0 and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(9)
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    return int(t)


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
    with (
        pytest.warns(RuntimeWarning, match="retrying once"),
        pytest.raises(RuntimeError, match=r"rank 0 died \(exit code 7\)"),
    ):
        pool2.run(exit_on_rank_case, bad=0)  # dies on the retry too: a real crash fails
    assert pool2.run(sum_case, value=2.0) == [6.0, 6.0]


def test_a_transport_crash_is_retried_once_with_a_warning(pool2, tmp_path):
    with pytest.warns(RuntimeWarning, match=r"rank 0 died \(exit code 9\)"):
        assert pool2.run(exit_once_case, marker=str(tmp_path / "crashed")) == [2, 2]


def test_a_python_error_is_not_retried(pool2, tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a retry would warn
        with pytest.raises(RuntimeError, match="deliberate failure on rank 0"):
            pool2.run(raise_on_rank_case, bad=0)
