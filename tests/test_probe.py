"""`ringtune probe` end to end at tiny sizes: CP 2 in float64 passes every check (GDN, attention and the MoE MLP,
its experts replicated and split over the CP ranks) and prints the table."""

from __future__ import annotations

from ringtune.cli import main
from ringtune.probes.layer_probe import loss_mask, probe_row


def test_probe_float64_cp2_passes(capsys):
    code = main(["probe", "--cp", "2", "--dtype", "float64", "--tokens", "256", "--scale", "16"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "probe PASS" in out and "gdn       chunkwise C=2" in out and "input grad pre-split" in out
    assert "moe       expert_parallel C=2  mlp.experts.gate_up_proj" in out  # experts split over the CP ranks


def test_loss_sits_after_the_first_split_of_the_straddling_datum():
    lens = probe_row(2048, seed=0)
    assert sum(lens) == 2048 and min(lens) >= 1
    for cp in (2, 4, 8):
        mask, datum, split = loss_mask(lens, cp)
        start = sum(lens[:datum])
        assert 0 < split < lens[datum]
        assert mask[start + split : start + lens[datum]].all() and int(mask.sum()) == lens[datum] - split
