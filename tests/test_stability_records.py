"""The sampler's stability records: lookup, the memory bound, expiry a day after a session's last use, and
persistence (a new store on the same directory restores what the old one kept)."""

from __future__ import annotations

import os

import pytest
import torch

from ringtune.gateway.stability_records import DEFAULT_TTL_S, StabilityRecords


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_records_round_float32_and_keep_routing(tmp_path):
    records = StabilityRecords(tmp_path, clock=Clock())
    routing = torch.arange(5 * 2 * 2, dtype=torch.int16).reshape(5, 2, 2)
    records.add("s:sample:0:a", "req-1:0", [1, 2, 3], [7, 8, 9], [-0.1, -1.0 / 3.0, -2.0], routing)
    got = records.get("req-1:0")
    assert got is not None and (got.prompt, got.tokens) == ((1, 2, 3), (7, 8, 9))
    assert got.logprobs[1] == float(torch.tensor(-1.0 / 3.0, dtype=torch.float32)) != -1.0 / 3.0
    assert torch.equal(got.routing, routing)
    assert records.get("req-1:1") is None
    with pytest.raises(ValueError, match="2 log-probs for 3 sampled tokens"):
        records.add("s", "x", [1], [1, 2, 3], [0.0, 0.0])


def test_memory_bound_evicts_the_least_recently_used():
    records = StabilityRecords(None, max_tokens=20, clock=Clock())
    for i in range(3):
        records.add("s", f"r:{i}", [1] * 4, [2] * 4, [0.0] * 4)  # 8 tokens each
    assert len(records) == 2 and records.num_tokens == 16 and records.get("r:0") is None
    records.get("r:1")  # used: r:2 is now the oldest
    records.add("s", "r:3", [1] * 4, [2] * 4, [0.0] * 4)
    assert records.get("r:2") is None and records.get("r:1") is not None and records.get("r:3") is not None


def test_a_session_expires_a_day_after_its_last_use(tmp_path):
    clock = Clock()
    records = StabilityRecords(tmp_path, clock=clock)
    records.add("old", "a:0", [1], [2], [0.0])
    records.add("used", "b:0", [1], [2], [0.0])
    clock.now += DEFAULT_TTL_S - 10
    assert records.get("b:0") is not None  # a training request used it: its day starts again
    clock.now += 20
    assert records.get("a:0") is None and records.get("b:0") is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["used.jsonl"]  # the expired session's file is gone


def test_a_new_store_restores_the_unexpired_records_under_the_bound(tmp_path):
    clock = Clock()
    records = StabilityRecords(tmp_path, max_tokens=100, clock=clock)
    routing = torch.ones(3, 1, 2, dtype=torch.int16)
    records.add("s:sample:1:x", "r:0", [1, 2], [3, 4], [-0.5, -0.25], routing)
    records.add("s:sample:1:x", "r:1", [1, 2], [5], [-1.5])
    records.add("gone", "g:0", [1], [2], [0.0])
    os.utime(tmp_path / "gone.jsonl", (clock.now - DEFAULT_TTL_S - 1,) * 2)  # last used over a day ago
    (tmp_path / "s_sample_1_x.jsonl").touch()
    os.utime(tmp_path / "s_sample_1_x.jsonl", (clock.now,) * 2)
    again = StabilityRecords(tmp_path, max_tokens=3, clock=clock)  # room for the newest record only
    assert again.get("g:0") is None and not (tmp_path / "gone.jsonl").exists()
    assert again.get("r:0") is None
    got = again.get("r:1")
    assert got is not None and got.tokens == (5,) and got.logprobs == (-1.5,) and got.session == "s:sample:1:x"
    full = StabilityRecords(tmp_path, clock=clock)  # the rewritten file holds what was kept
    assert len(full) == 1
    restored = StabilityRecords(tmp_path.parent / "other", clock=clock)
    assert len(restored) == 0
    records2 = StabilityRecords(tmp_path / "r2", clock=clock)
    records2.add("t", "q:0", [1, 2], [3, 4], [-0.5, -0.25], routing)
    assert torch.equal(StabilityRecords(tmp_path / "r2", clock=clock).get("q:0").routing, routing)
