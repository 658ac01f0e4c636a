"""Tinker losses: config and input checks, the reference on hand-computed cases, and the CP version
against the reference in float64 at CP 1, 2, 4 (gloo rank pool).

lp is a differentiable function of a per-token leaf (``lp = -softplus(x)``), so the test compares
d loss / d x summed over the CP group with the reference's, and the elementwise losses placed back
in row order. Every rank of a DP group builds the same rows; DP groups use different seeds, so a
gspo reduction over the wrong group shows.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ringtune.errors import UserInputError
from ringtune.layout import zigzag_place, zigzag_plan, zigzag_slice
from ringtune.losses import (
    LOSS_FNS,
    LossConfig,
    check_datum_inputs,
    input_default,
    local_token_losses,
    loss_metrics,
    parse_loss_config,
    reference_datum_losses,
    reference_losses,
    required_inputs,
)
from ringtune.probes.scenarios import SCENARIOS

# Rows: the shared scenarios (1-17 token rows, lengths not divisible by 2C, a long datum spanning
# every rank, a pad-only row with no local token) plus a pad-only row that still holds a budget of
# pads, and a row of tiny datums with stream pad multiple 1.
ROWS: dict[str, tuple[int, ...]] = {**SCENARIOS, "pad_only_budget": (), "tiny_unpadded": (1, 2, 1, 3, 5, 2)}
PAD_MULTIPLE = {"tiny_unpadded": 1, "pad_only": 1}
PAD_TO = {"pad_only_budget": 8}

TIGHT_STABLE = {
    "token_ratio_low": 0.8,
    "token_ratio_high": 1.25,
    "sequence_ratio_low": 0.9,
    "sequence_ratio_high": 1.1,
    "kl_coef": 0.3,
}

# name -> (loss_fn, loss_fn_config, K of [N, K] targets or None, per-token clip thresholds)
VARIANTS = {
    "cross_entropy": ("cross_entropy", None, None, False),
    "cross_entropy_topk": ("cross_entropy", None, 3, False),
    "importance_sampling": ("importance_sampling", None, None, False),
    "ppo": ("ppo", None, None, False),
    "ppo_per_token_clip": ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, None, True),
    "cispo": ("cispo", None, None, False),
    "dro": ("dro", {"beta": 0.3}, None, False),
    "gspo": ("gspo", None, None, False),
    "gspo_tight_per_token": ("gspo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}, None, True),
    "stable_reinforce": ("stable_reinforce", None, None, False),
    "stable_reinforce_tight_kl": ("stable_reinforce", TIGHT_STABLE, None, False),
}
"""``sampled_mask`` of a stable_reinforce datum (as the gateway resolves it) is its response, nothing, or the
response's first half (a datum whose later rows a prompt span attributes), by datum."""


def make_row(seq_lens: tuple[int, ...], seed: int, variant: str):
    """(x leaf values, row-level inputs, datum id per token, config) of one packed row of datums.

    Each datum of n tokens has a prompt of P in [0, n] tokens (weight / advantage 0, sampler logprob 0
    as the cookbook sends), then a response. Weights are real (negative too); sampler logprobs sit
    off this pass's lp by a per-datum bias plus noise, so ratios fall on both sides of every clip.
    gspo's sequence_ratio_mask is the response, nothing (s = 1), or a random subset, by datum.
    """
    loss_fn, raw_config, k, per_token_clip = VARIANTS[variant]
    config = parse_loss_config(loss_fn, raw_config)
    gen = torch.Generator().manual_seed(seed)
    T = sum(seq_lens)
    x = torch.randn(T, *((k,) if k else ()), generator=gen, dtype=torch.float64) * 2
    lp = -F.softplus(x)
    parts: dict[str, list[torch.Tensor]] = {}
    for d, n in enumerate(seq_lens):
        prompt = int(torch.randint(0, n + 1, (1,), generator=gen))
        resp = (torch.arange(n) >= prompt).double()
        seg = lp[sum(seq_lens[:d]) : sum(seq_lens[: d + 1])]
        datum: dict[str, torch.Tensor] = {"target_tokens": torch.randint(0, 50, seg.shape, generator=gen)}
        if loss_fn == "cross_entropy":
            resp_k = resp[:, None] if k else resp
            datum["weights"] = torch.randn(seg.shape, generator=gen, dtype=torch.float64) * resp_k
        else:
            bias = float(torch.randn((), generator=gen)) * 0.3
            q = seg + bias + 0.6 * torch.randn(n, generator=gen, dtype=torch.float64)
            datum["logprobs"] = q * resp
            adv = float(torch.randn((), generator=gen)) + 0.5 * torch.randn(n, generator=gen, dtype=torch.float64)
            datum["advantages"] = adv * resp
            mode = d % 3
            if mode == 0:
                datum["sequence_ratio_mask"] = resp
            elif mode == 1:
                datum["sequence_ratio_mask"] = torch.zeros(n, dtype=torch.float64)
            else:
                datum["sequence_ratio_mask"] = (torch.rand(n, generator=gen) < 0.5).double()
            if loss_fn == "stable_reinforce":
                datum["sampled_mask"] = [resp, torch.zeros(n, dtype=torch.float64), resp * (torch.arange(n) < n // 2)][
                    mode
                ].double()
                del datum["sequence_ratio_mask"]
        if per_token_clip:  # odd datums "did not send" the key: the engine fills the config value
            lo = 0.7 + 0.25 * torch.rand(n, generator=gen, dtype=torch.float64)
            hi = 1.05 + 0.3 * torch.rand(n, generator=gen, dtype=torch.float64)
            if d % 2:
                lo = torch.full((n,), input_default(config, "clip_low_threshold"), dtype=torch.float64)
                hi = torch.full((n,), input_default(config, "clip_high_threshold"), dtype=torch.float64)
            datum["clip_low_threshold"], datum["clip_high_threshold"] = lo, hi
        check_datum_inputs(loss_fn, d, n, datum)
        for key, value in datum.items():
            parts.setdefault(key, []).append(value)
    inputs = {key: torch.cat(values) for key, values in parts.items()}
    datum_id = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens, dtype=torch.int64))
    return x, inputs, datum_id, config


def reference_row(x: torch.Tensor, inputs, seq_lens, config: LossConfig):
    """(elementwise [T], d loss / d x [T]) of the reference, one datum at a time over full vectors."""
    leaf = x.clone().requires_grad_()
    lp = -F.softplus(leaf)
    datums, start = [], 0
    for n in seq_lens:
        datums.append((lp[start : start + n], {key: v[start : start + n] for key, v in inputs.items()}))
        start += n
    terms = reference_losses(config, datums)
    if not terms:
        return torch.zeros_like(x), torch.zeros_like(x)
    out = torch.cat(terms)
    out.sum().backward()
    return out.detach(), leaf.grad


def loss_case(ctx, *, variant: str, cp: int, no_reduce: bool = False, rows=None):
    """Per row: this rank's placed elementwise loss and gradient, the reference, and invariants."""
    mesh = ctx.mesh(dp=ctx.world_size // cp, cp=cp)
    results = {}
    for index, name in enumerate(rows or ROWS):
        seq_lens = ROWS[name]
        x, inputs, datum_id, config = make_row(seq_lens, 1000 * index + 17 * mesh.dp_rank, variant)
        ref_out, ref_grad = reference_row(x, inputs, seq_lens, config)
        bounds = [(sum(seq_lens[:d]), sum(seq_lens[: d + 1])) for d in range(len(seq_lens))]
        per_datum = [{key: v[lo:hi] for key, v in inputs.items()} for lo, hi in bounds]
        lp_full = -F.softplus(x)
        metrics = loss_metrics(
            config, [ref_out[lo:hi] for lo, hi in bounds], [lp_full[lo:hi] for lo, hi in bounds], per_datum
        )
        plan = zigzag_plan(
            seq_lens,
            cp_size=cp,
            cp_rank=mesh.cp_rank,
            pad_multiplier=PAD_MULTIPLE.get(name, 8),
            pad_to=PAD_TO.get(name),
        )
        leaf = zigzag_slice(x, plan).requires_grad_()
        local = {key: zigzag_slice(v, plan) for key, v in inputs.items()}
        before = {key: v.clone() for key, v in local.items()}
        index_local = zigzag_slice(datum_id, plan, pad_value=-1)
        group = None if no_reduce or (cp == 1 and index % 2 == 0) else mesh.cp_group
        out = local_token_losses(
            config, -F.softplus(leaf), local, datum_index=index_local, num_datums=len(seq_lens), group=group
        )
        graph = out.requires_grad and out.grad_fn is not None
        out.sum().backward()
        real = plan.is_real if out.dim() == 1 else plan.is_real[:, None].expand_as(out)
        scale = local.get("weights" if config.loss_fn == "cross_entropy" else "advantages", torch.zeros_like(out))
        zero_input = scale == 0  # CE [T, K] has [T, K] weights; the other losses are [T]
        zero_ok = bool((out[~real] == 0).all())
        if config.loss_fn != "dro":  # dro's penalty has no mask: A = 0 tokens keep it
            zero_ok = zero_ok and bool((out[real & zero_input] == 0).all())
        results[name] = {
            "out": zigzag_place(out.detach(), plan),
            "grad": zigzag_place(leaf.grad, plan),
            "ref_out": ref_out,
            "ref_grad": ref_grad,
            "zero_ok": zero_ok,
            "graph": graph,
            "local_len": plan.local_len,
            "scored": int((real & ~zero_input).sum()),
            "clip_frac": metrics.get("clip_frac:mean", metrics.get("masked_token_frac:mean")),
            "masked_sequences": metrics.get("masked_sequence_frac:mean"),
            "loss_sum": metrics["loss:sum"],
            "unmodified": all(torch.equal(local[key], before[key]) for key in local),
        }
    return results


def max_err(per_rank, cp: int, name: str, field: str) -> float:
    err = 0.0
    for start in range(0, len(per_rank), cp):
        group = per_rank[start : start + cp]
        total = sum(res[name][field] for res in group)
        want = group[0][name][f"ref_{field}"]
        if want.numel():
            err = max(err, float((total - want).abs().max()))
    return err


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cp_float64_equals_reference(pool4, variant, cp):
    per_rank = pool4.run(loss_case, variant=variant, cp=cp)
    for name in ROWS:
        for rank, res in enumerate(per_rank):
            row = res[name]
            assert row["graph"], (rank, name, "output not connected to lp's graph")
            assert row["zero_ok"], (rank, name, "pad / zero-weight term is not exactly 0")
            assert row["unmodified"], (rank, name, "inputs modified in place")
        assert max_err(per_rank, cp, name, "out") <= 1e-10, (name, max_err(per_rank, cp, name, "out"))
        assert max_err(per_rank, cp, name, "grad") <= 1e-10, (name, max_err(per_rank, cp, name, "grad"))
        assert per_rank[0][name]["loss_sum"] == pytest.approx(float(per_rank[0][name]["ref_out"].sum()), abs=1e-12)
    if VARIANTS[variant][0] in ("ppo", "cispo", "gspo", "stable_reinforce"):  # ratios fall out of range, not always
        fracs = [res[name]["clip_frac"] for res in per_rank for name in ROWS]
        assert 0 < max(fracs) and min(fracs) < 1, fracs
    if variant == "stable_reinforce_tight_kl":  # the sequence band drops some datums whole, not all
        fracs = [res[name]["masked_sequences"] for res in per_rank for name in ROWS]
        assert 0 < max(fracs) and min(fracs) < 1, fracs
    # The scenarios do reach the hard cases: a rank with no local token, and (CP>1) a rank with local
    # tokens of which none is scored.
    assert any(res["pad_only"]["local_len"] == 0 for res in per_rank)
    if cp == 4:
        assert any(res["single_token"]["local_len"] > 0 and res["single_token"]["scored"] == 0 for res in per_rank)


def test_gspo_without_the_cp_reduction_is_wrong(pool4):
    """Negative control: the per-datum sequence ratio needs the whole datum (long_alone spans 4 ranks)."""
    per_rank = pool4.run(loss_case, variant="gspo", cp=4, no_reduce=True, rows=["long_alone"])
    assert max_err(per_rank, 4, "long_alone", "out") > 1e-3


# ---- single process: the reference on hand-computed values ---------------------------------------


def grad_of(config: LossConfig, lp_values, inputs):
    lp = torch.tensor(lp_values, dtype=torch.float64, requires_grad=True)
    inputs = {k: torch.tensor(v, dtype=torch.float64) for k, v in inputs.items()}
    out = reference_datum_losses(config, lp, inputs)
    out.sum().backward()
    return out.detach().tolist(), lp.grad.tolist()


def test_reference_hand_computed():
    ln = math.log
    out, grad = grad_of(parse_loss_config("cross_entropy", None), [-1.0, -2.0], {"weights": [2.0, -0.5]})
    assert out == [2.0, -1.0] and grad == [-2.0, 0.5]
    # ppo, A > 0: r = 1.5 clips (no gradient), r = 0.5 does not (gradient -A·r); A < 0: r = 0.5 clips.
    q = [0.0, 0.0, 0.0]
    lp = [ln(1.5), ln(0.5), ln(0.5)]
    out, grad = grad_of(parse_loss_config("ppo", None), lp, {"logprobs": q, "advantages": [2.0, 2.0, -1.0]})
    assert out == pytest.approx([-2.4, -1.0, 0.8]) and grad == pytest.approx([0.0, -1.0, 0.0])
    # cispo: weight sg(clip(r, 0, 4)) times -lp·A; r = 8 clips to 4.
    out, grad = grad_of(
        parse_loss_config("cispo", None), [ln(8.0), -1.0], {"logprobs": [0.0, -1.0], "advantages": [1.0, 3.0]}
    )
    assert out == pytest.approx([-4 * ln(8.0), 3.0]) and grad == pytest.approx([-4.0, -3.0])
    # importance_sampling: -r·A, gradient -r·A.
    out, grad = grad_of(
        parse_loss_config("importance_sampling", None), [ln(2.0)], {"logprobs": [0.0], "advantages": [3.0]}
    )
    assert out == pytest.approx([-6.0]) and grad == pytest.approx([-6.0])
    # dro: -(lp·A - ½β(lp-q)²), gradient -A + β(lp-q); an A = 0 token keeps the penalty.
    out, grad = grad_of(
        parse_loss_config("dro", {"beta": 0.5}), [-1.0, -2.0], {"logprobs": [-2.0, 0.0], "advantages": [2.0, 0.0]}
    )
    assert out == pytest.approx([2.25, 1.0]) and grad == pytest.approx([-1.5, -1.0])
    # gspo: s = exp(mean over the mask of lp - q) = exp((ln 2 + ln 1.5)/2) = sqrt(3) > 1.2 clips for A > 0.
    inputs = {"logprobs": [0.0, 0.0, 0.0], "advantages": [1.0, 1.0, -1.0], "sequence_ratio_mask": [1.0, 1.0, 0.0]}
    out, grad = grad_of(parse_loss_config("gspo", None), [ln(2.0), ln(1.5), ln(9.0)], inputs)
    s = math.sqrt(3.0)
    assert out == pytest.approx([-1.2, -1.2, s]) and grad == pytest.approx([0.0, 0.0, s])
    # stable_reinforce: r = 1.5 kept (weight 1.5), r = 3 outside [0.5, 2] masked, the prompt row (not sampled)
    # and its advantage ignored; sequence ratio exp((ln 1.5 + ln 3) / 2) = 2.12 > 2 masks the whole datum.
    config = parse_loss_config("stable_reinforce", {"kl_coef": 1.0})
    inputs = {"logprobs": [0.0, 0.0, 0.0], "advantages": [5.0, 2.0, 2.0], "sampled_mask": [0.0, 1.0, 1.0]}
    lp = [-1.0, ln(1.5), ln(3.0)]
    out, grad = grad_of(config, lp, inputs)
    assert out == pytest.approx([0.0, 0.5 * ln(1.5) ** 2, 0.5 * ln(3.0) ** 2])  # only the kl term: masked
    assert grad == pytest.approx([0.0, ln(1.5), ln(3.0)])
    config = parse_loss_config("stable_reinforce", {"sequence_ratio_high": 3.0})
    out, grad = grad_of(config, lp, inputs)  # the datum is kept: the token band alone masks r = 3
    assert out == pytest.approx([0.0, -1.5 * ln(1.5) * 2.0, 0.0]) and grad == pytest.approx([0.0, -3.0, 0.0])
    # gspo with nothing marked: s = 1.
    inputs = {"logprobs": [5.0], "advantages": [2.0], "sequence_ratio_mask": [0.0]}
    out, grad = grad_of(parse_loss_config("gspo", None), [-1.0], inputs)
    assert out == pytest.approx([-2.0]) and grad == pytest.approx([-2.0])


def test_local_float32_and_single_process_matches_reference():
    """lp in float32 (the engine's dtype): same as the float64 reference to float32 rounding (~1e-7
    relative on O(1) terms; limit 1e-5)."""
    for variant in VARIANTS:
        seq_lens = (3, 9, 1)
        x, inputs, datum_id, config = make_row(seq_lens, 5, variant)
        ref_out, ref_grad = reference_row(x, inputs, seq_lens, config)
        leaf = x.float().requires_grad_()
        local = {key: v.float() for key, v in inputs.items()}
        out = local_token_losses(config, -F.softplus(leaf), local, datum_index=datum_id, num_datums=3, group=None)
        out.sum().backward()
        assert out.dtype == torch.float32
        assert float((out.detach().double() - ref_out).abs().max()) <= 1e-5, variant
        assert float((leaf.grad.double() - ref_grad).abs().max()) <= 1e-5, variant


def test_local_rejects_bad_shapes():
    config = parse_loss_config("ppo", None)
    lp = torch.zeros(4, 2)
    with pytest.raises(ValueError, match=r"only \(.cross_entropy., .importance_sampling.\) take"):
        local_token_losses(config, lp, {}, datum_index=torch.zeros(4, dtype=torch.int64), num_datums=1, group=None)
    with pytest.raises(ValueError, match="datum_index"):
        local_token_losses(
            config, lp[:, 0], {}, datum_index=torch.zeros(3, dtype=torch.int64), num_datums=1, group=None
        )


def test_loss_metrics():
    config = parse_loss_config("ppo", None)
    lp = [torch.log(torch.tensor([1.5, 1.0, 0.5, 2.0], dtype=torch.float64))]
    inputs = [{"logprobs": torch.zeros(4), "advantages": torch.tensor([1.0, 1.0, 1.0, 0.0])}]
    elementwise = reference_losses(config, list(zip(lp, inputs, strict=True)))
    metrics = loss_metrics(config, elementwise, lp, inputs)
    assert metrics["loss:sum"] == pytest.approx(-(1.2 + 1.0 + 0.5))
    assert metrics["clip_frac:mean"] == pytest.approx(2 / 3)  # 1.5 and 0.5 are outside [0.8, 1.2]
    assert all(key.count(":") == 1 for key in metrics)
    assert loss_metrics(parse_loss_config("cross_entropy", None), [torch.ones(2, 3)]) == {"loss:sum": 6.0}
    gspo = parse_loss_config("gspo", None)
    inputs = [{"logprobs": torch.zeros(2), "advantages": torch.ones(2), "sequence_ratio_mask": torch.ones(2)}]
    lp = [torch.log(torch.tensor([2.0, 1.5]))]
    assert loss_metrics(gspo, [torch.zeros(2)], lp, inputs)["clip_frac:mean"] == 1.0  # s = sqrt(3)
    stable = parse_loss_config("stable_reinforce", None)
    inputs = [
        {"logprobs": torch.zeros(3), "advantages": torch.ones(3), "sampled_mask": torch.tensor([0.0, 1.0, 1.0])},
        {"logprobs": torch.zeros(1), "advantages": torch.ones(1), "sampled_mask": torch.ones(1)},
        {"logprobs": torch.zeros(2), "advantages": torch.ones(2), "sampled_mask": torch.zeros(2)},
    ]
    lp = [torch.log(torch.tensor([9.0, 1.5, 3.0])), torch.log(torch.tensor([1.0])), torch.zeros(2)]
    metrics = loss_metrics(stable, [torch.zeros(3), torch.zeros(1), torch.zeros(2)], lp, inputs)
    assert metrics["masked_token_frac:mean"] == pytest.approx(1 / 3)  # 3 is outside [0.5, 2]; row 0 not sampled
    assert metrics["masked_sequence_frac:mean"] == pytest.approx(1 / 2)  # sqrt(4.5) > 2; datum 2 has no sampled row
    assert metrics["kl_sample_train_v1:mean"] == pytest.approx(-(math.log(1.5) + math.log(3.0)) / 3)
    assert metrics["kl_sample_train_v2:mean"] == pytest.approx((math.log(1.5) ** 2 + math.log(3.0) ** 2) / 6)


# ---- config and input validation -------------------------------------------------------------------


def test_parse_loss_config_defaults_and_overrides():
    assert parse_loss_config("ppo", None) == LossConfig(loss_fn="ppo", clip_low=0.8, clip_high=1.2)
    assert parse_loss_config("gspo", {}) == LossConfig(loss_fn="gspo", clip_low=0.8, clip_high=1.2)
    assert parse_loss_config("cispo", None) == LossConfig(loss_fn="cispo", clip_low=0.0, clip_high=4.0)
    assert parse_loss_config("dro", None) == LossConfig(loss_fn="dro", beta=0.05)
    assert parse_loss_config("dro", {"beta": 1}).beta == 1.0
    assert parse_loss_config("cross_entropy", None) == LossConfig(loss_fn="cross_entropy")
    cfg = parse_loss_config("ppo", {"clip_high_threshold": 1.5})
    assert (cfg.clip_low, cfg.clip_high) == (0.8, 1.5)
    assert set(LOSS_FNS) == {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"}
    stable = parse_loss_config("stable_reinforce", None)
    assert (stable.token_band, stable.sequence_band, stable.kl_coef) == ((0.5, 2.0), (0.5, 2.0), 0.0)
    stable = parse_loss_config("stable_reinforce", {"kl_coef": 0.1, "token_ratio_high": 3})
    assert (stable.token_band, stable.kl_coef) == ((0.5, 3.0), 0.1)


@pytest.mark.parametrize(
    ("loss_fn", "config", "needles"),
    [
        ("stable_reinforce", {"token_ratio_low": 1.2}, ["token_ratio_low=1.2", "0 <= low <= 1 <= high"]),
        ("stable_reinforce", {"sequence_ratio_high": 0.9}, ["sequence_ratio_high=0.9", "must hold"]),
        ("stable_reinforce", {"kl_coef": -1}, ["'kl_coef'", ">= 0"]),
        ("stable_reinforce", {"beta": 0.1}, ["'beta'", "takes only token_ratio_low"]),
        ("custom", None, ["'custom'", "forward_backward_custom"]),
        ("sft", None, ["'sft'", "cross_entropy, importance_sampling, ppo, cispo, dro, gspo, stable_reinforce"]),
        ("ppo", {"clip_eps": 0.2}, ["'clip_eps'", "0.2", "clip_low_threshold, clip_high_threshold"]),
        ("importance_sampling", {"clip_low_threshold": 0.8}, ["'clip_low_threshold'", "takes no loss_fn_config"]),
        ("dro", {"clip_low_threshold": 0.8}, ["takes only beta"]),
        ("ppo", {"clip_low_threshold": float("nan")}, ["'clip_low_threshold'", "nan", "finite"]),
        ("ppo", {"clip_low_threshold": "0.8"}, ["'0.8'", "finite real number"]),
        ("ppo", {"clip_low_threshold": True}, ["True", "finite real number"]),
        ("ppo", {"clip_low_threshold": 1.3}, ["clip_low_threshold=1.3", "clip_high_threshold=1.2", "low <= high"]),
        ("cispo", {"clip_low_threshold": -0.1}, ["-0.1", ">= 0"]),
        ("dro", {"beta": -1.0}, ["'beta'", "-1.0", ">= 0"]),
    ],
)
def test_parse_loss_config_errors(loss_fn, config, needles):
    with pytest.raises(UserInputError) as info:
        parse_loss_config(loss_fn, config)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_required_inputs():
    assert required_inputs("cross_entropy") == ("target_tokens", "weights")
    for loss_fn in ("importance_sampling", "ppo", "cispo", "dro"):
        assert required_inputs(loss_fn) == ("target_tokens", "logprobs", "advantages")
    assert required_inputs("gspo") == ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask")
    assert required_inputs("stable_reinforce") == ("target_tokens", "logprobs", "advantages", "sampled_mask")
    with pytest.raises(UserInputError, match="custom"):
        required_inputs("custom")


def _rl(n: int = 4, **extra):
    return {
        "target_tokens": torch.zeros(n, dtype=torch.int64),
        "logprobs": torch.zeros(n),
        "advantages": torch.ones(n),
        **extra,
    }


@pytest.mark.parametrize(
    ("loss_fn", "inputs", "needles"),
    [
        (
            "ppo",
            {"target_tokens": torch.zeros(4, dtype=torch.int64), "logprobs": torch.zeros(4)},
            ["datum 3", "advantages"],
        ),
        ("gspo", _rl(), ["datum 3", "sequence_ratio_mask"]),
        ("ppo", _rl(advantages=torch.ones(5)), ["datum 3", "'advantages'", "[5]", "expected [4]"]),
        (
            "ppo",
            _rl(target_tokens=torch.zeros(4, 2, dtype=torch.int64)),
            ["'target_tokens'", "[4, 2]", "only for cross_entropy and importance_sampling"],
        ),
        ("ppo", _rl(target_tokens=torch.zeros(3, dtype=torch.int64)), ["'target_tokens'", "[3]", "expected [4]"]),
        ("ppo", _rl(target_tokens=torch.zeros(4)), ["'target_tokens'", "torch.float32", "int64"]),
        ("ppo", _rl(target_tokens=torch.tensor([0, -1, 2, 3])), ["'target_tokens'", "-1", ">= 0"]),
        ("ppo", _rl(advantages=torch.tensor([0.0, float("inf"), 1.0, 1.0])), ["'advantages'][1]", "inf", "finite"]),
        ("ppo", _rl(rewards=torch.zeros(4)), ["datum 3", "'rewards'", "known keys"]),
        ("ppo", _rl(clip_low_threshold=torch.full((4,), -1.0)), ["'clip_low_threshold'", "-1.0", ">= 0"]),
        (
            "ppo",
            _rl(clip_low_threshold=torch.tensor([0.8, 1.5, 0.8, 0.8]), clip_high_threshold=torch.full((4,), 1.2)),
            ["clip_low_threshold[1]=1.5", "clip_high_threshold[1]=1.2"],
        ),
        (
            "cross_entropy",
            {"target_tokens": torch.zeros(4, 2, dtype=torch.int64), "weights": torch.ones(4)},
            ["'weights'", "[4]", "expected [4, 2]", "shape of target_tokens"],
        ),
        (
            "cross_entropy",
            {
                "target_tokens": torch.zeros(4, 2, dtype=torch.int64),
                "weights": torch.tensor([[1.0, 0.0]] * 3 + [[0.0, float("nan")]]),
            },
            ["'weights'][3, 1]", "nan"],
        ),
        (
            "cross_entropy",
            {"target_tokens": torch.zeros(4, 0, dtype=torch.int64), "weights": torch.ones(4, 0)},
            ["[4, 0]", "[4, K]"],
        ),
    ],
)
def test_check_datum_inputs_errors(loss_fn, inputs, needles):
    with pytest.raises(UserInputError) as info:
        check_datum_inputs(loss_fn, 3, 4, inputs)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_check_datum_inputs_accepts():
    check_datum_inputs("ppo", 0, 4, _rl(mask=torch.ones(4), weights=torch.ones(4)))  # known, unused: ignored
    check_datum_inputs(
        "cross_entropy", 0, 4, {"target_tokens": torch.zeros(4, 3, dtype=torch.int64), "weights": -torch.ones(4, 3)}
    )
    check_datum_inputs(
        "cross_entropy", 0, 0, {"target_tokens": torch.zeros(0, dtype=torch.int64), "weights": torch.zeros(0)}
    )
    check_datum_inputs("gspo", 0, 4, _rl(sequence_ratio_mask=torch.ones(4), clip_high_threshold=torch.full((4,), 2.0)))
    with pytest.raises(UserInputError, match="stable_reinforce"):
        check_datum_inputs("stable_reinforce", 0, 4, _rl())


def test_input_default():
    config = parse_loss_config("cispo", None)
    assert input_default(config, "clip_low_threshold") == 0.0
    assert input_default(config, "clip_high_threshold") == 4.0
    assert input_default(config, "mask") == 1.0
    with pytest.raises(UserInputError, match=r"loss_fn_inputs\['weights'\] has no default"):
        input_default(config, "weights")
    with pytest.raises(UserInputError, match="has no default"):
        input_default(parse_loss_config("cross_entropy", None), "clip_low_threshold")
