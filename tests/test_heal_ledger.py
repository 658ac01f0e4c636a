"""ringtune.worker.heal_ledger: what a heal restores, as the verbs that succeeded left it (no ranks needed)."""

from __future__ import annotations

import json

from ringtune.engine.checkpoint_layout import META_NAME
from ringtune.sample.pool import SamplerSource
from ringtune.worker.heal_ledger import HealLedger, RunTrack


def test_a_run_is_tracked_from_create_to_free(tmp_path):
    ledger = HealLedger()
    ledger.record("create_run", {"run_id": "r", "base_model": "m", "lora": {"rank": 4}}, None)
    assert ledger.runs["r"] == RunTrack("m", lora={"rank": 4})
    ledger.record("forward_backward", {"run_id": "r", "forward_only": True}, ([], {}))
    assert not ledger.runs["r"].pending  # a forward leaves no gradients
    ledger.record("forward_backward", {"run_id": "r", "forward_only": False}, ([], {}))
    assert ledger.runs["r"].pending
    ledger.record("optim_step", {"run_id": "r"}, {"step:max": 7.0})
    assert (ledger.runs["r"].step, ledger.runs["r"].pending) == (7, False)
    ledger.record("save_state", {"run_id": "r", "path": "/ck/a"}, None)
    track = ledger.runs["r"]
    assert (track.checkpoint, track.checkpoint_step, track.optimizer) == ("/ck/a", 7, True)
    saved = tmp_path / "b"
    saved.mkdir()
    (saved / META_NAME).write_text(json.dumps({"step": 3}))
    ledger.gradients_pending("r")
    ledger.record("load_state", {"run_id": "r", "path": str(saved), "optimizer": False}, None)
    assert (track.checkpoint, track.checkpoint_step, track.optimizer, track.step, track.pending) == (
        str(saved),
        3,
        False,
        3,
        False,
    )
    ledger.record("free_run", {"run_id": "r"}, None)
    assert ledger.runs == {}
    ledger.gradients_pending("r")  # a freed run is not brought back
    assert ledger.runs == {}


def test_a_sampler_remembers_its_runs_step_and_verbs_that_change_nothing_are_ignored():
    ledger = HealLedger()
    ledger.record("create_run", {"run_id": "r", "base_model": "m", "lora": None}, None)
    ledger.record("optim_step", {"run_id": "r"}, {})  # no step:max: one more step
    live, base = SamplerSource(run_id="r"), SamplerSource()
    ledger.record("create_sampler", {"sampler_id": "s1", "source": live}, None)
    ledger.record("create_sampler", {"sampler_id": "s2", "source": base}, None)
    assert ledger.samplers == {"s1": (live, 1), "s2": (base, None)}
    ledger.record("sample", {"sampler_id": "s1", "requests": []}, [])
    ledger.record("export_for_sampler", {"run_id": "r", "path": "/x"}, None)
    ledger.record("free_sampler", {"sampler_id": "s1"}, None)
    assert ledger.samplers == {"s2": (base, None)} and ledger.runs["r"].step == 1
