"""`ringtune probe` end to end at tiny sizes: CP 2 in float64 passes every check (GDN, attention, the MoE MLP,
its experts replicated and split over the CP ranks, and the vision tower with the product's image placement) and
prints the table."""

from __future__ import annotations

from ringtune.cli import main
from ringtune.probes.layer_probe import loss_mask, probe_row
from ringtune.probes.vision_probe import PROBE_TOWER, images_on_two_ranks, vision_row


def test_probe_float64_cp2_passes(capsys):
    code = main(["probe", "--cp", "2", "--dtype", "float64", "--tokens", "256", "--scale", "16"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "probe PASS" in out and "gdn       chunkwise C=2" in out and "input grad pre-split" in out
    assert "moe       expert_parallel C=2  mlp.experts.gate_up_proj" in out  # experts split over the CP ranks
    assert "vision    per_image C=2  blocks.0.attn.qkv.weight" in out and "vision    per_image C=2  PASS" in out
    assert "vision    per_image C=2  patch grad" in out and "image embeddings rows below cosine 0.99: 0 of" in out


def test_loss_sits_after_the_first_split_of_the_straddling_datum():
    lens = probe_row(2048, seed=0)
    assert sum(lens) == 2048 and min(lens) >= 1
    for cp in (2, 4, 8):
        mask, datum, split = loss_mask(lens, cp)
        start = sum(lens[:datum])
        assert 0 < split < lens[datum]
        assert mask[start + split : start + lens[datum]].all() and int(mask.sum()) == lens[datum] - split


def test_vision_row_holds_1_to_3_images_of_different_grids_across_rank_boundaries():
    for seed in (0, 1, 2):
        seq_lens, images = vision_row(seed, (2, 4))
        counts = sorted(len(seq) for seq in images)
        assert counts[0] == 0 and counts[-1] == 3 and 1 in counts  # a text-only sequence, 1 and 3 images
        for n, seq in zip(seq_lens, images, strict=True):
            assert len({im.grid_thw for im in seq}) == len(seq)
            ends = [0] + [im.token_end for im in seq]
            for prev_end, im in zip(ends, seq, strict=False):
                assert prev_end <= im.token_start and im.token_end < n
                t, h, w = im.grid_thw
                assert im.num_tokens == t * h * w // PROBE_TOWER.spatial_merge_size**2
                assert tuple(im.pixel_values.shape) == (t * h * w, PROBE_TOWER.patch_dim)
        for cp in (2, 4):
            assert images_on_two_ranks(seq_lens, images, cp) >= 2
