"""The parity client (issue 11): the small matrix through real ``ringtune serve`` subprocesses and the real SDK.

One module-scoped matrix on a tiny random Qwen3.5 (row budget 512 tokens): CP=1 reference, CP=2 headwise and
chunkwise, DP=2 at CP=1 and at CP=2 in both modes (float32), a tiny Qwen3.5-MoE at CP=2 EP=2 against its own
CP=1 reference, and every debug fault compare catches, at its layout
(``FAULT_LAYOUTS``: CP=2 or CP=4, float32 or bfloat16 with its own CP=1 reference). Clean layouts must pass
``compare`` (step-1 grad-norm ratio within 1e-5), each fault must fail it naming the figure, the CLI exits
0 / 1 / 2, and the report and PNGs exist.
Every server samples, so every dump holds its KL(sampler ‖ trainer): clean layouts pass it, and a trainer that
reads wrong positions fails it. Plus the window math against :mod:`ringtune.layout`, the KL estimators and the
row-budget refusal, without servers.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ringtune.cli import main
from ringtune.layout.contiguous import contiguous_part
from ringtune.layout.zigzag import chunk_len, zigzag_plan, zigzag_slice
from ringtune.parity.compare import CPU_ONLY, ComparisonRefusedError, compare_dumps
from ringtune.parity.datums import build_datum_set, text_token_stream
from ringtune.parity.limits import LIMITS
from ringtune.parity.matrix import FAULT_LAYOUTS, MatrixConfig, run_matrix
from ringtune.parity.noise import noise_floors
from ringtune.parity.sampler_kl import PROMPT_CAP, SAMPLE_TOKENS, kl_estimates, sampler_prompts
from ringtune.parity.servers import ServeSpec
from ringtune.parity.windows import Layout, request_positions

ROW_TOKENS = 512
pytestmark = pytest.mark.timeout(3600)
"""The module's matrix serves 15 servers one after another inside one fixture: on a loaded 2-core machine it ran
24 min (5 min of CPU) while its CP=1 references ran two torch threads; with one (``servers.SERVER_THREADS``) the
module took 700 s at load ~20-27 (the fixture 629 s), still past the suite's 900 s default now and then: slow is
not dead."""

# What each fault must break first (the figure compare names): a wrong rotary position shows in every log-prob
# past chunk C; an average instead of a sum halves the grad norm (CP=2) but not the Adam update; a dropped GDN
# state shows right after a split row; a flipped loss sign on one rank flips half of every datum's loss.
EXPECTED = {
    "position_off_by_one": "lp.mean",
    "gradients_averaged": "grad_norm.cross_entropy",
    "gdn_state_dropped": "lp.split[",
    "loss_sign_flipped": "loss.cross_entropy.per_token",
    # New in issue 22: a replica that skips weight decay fails the replica check at the first decayed step; a
    # rank without scored tokens that drops its backward loses the tail datum's gradient through it; a ring
    # shift in the wrong direction (CP=4 only) reads the wrong K/V blocks; a decay rounded to bf16 on its way
    # through the relayout moves the positions every honest layout computes bit-identically (chunk 0).
    "weight_decay_skipped_cp1": "replicas.identical",
    "unscored_backward_skipped": "grad_norm.long_step",
    "ring_shift_reversed": "lp.mean",
    "gdn_decay_relayout_bf16": "lp.chunk[0].moved",
    # A partial dK/dV rounded to bf16 before each ring hop stays within bf16 noise in every model-level figure;
    # the server's probe (the same blocks accumulated in float64, rounded once) sees ~22% of dK/dV elements move.
    "ring_dkv_exchange_bf16": "probe.ring_accumulation",
}


# ------------------------------------------------------------------------------------------------ no servers


def test_split_rows_and_chunks_come_from_the_layout():
    """A lone datum's split rows are the starts of the contiguous parts; chunks are ceil(n / 2C) long."""
    for cp in (2, 4):
        layout = Layout(cp_size=cp, dp_size=1, max_tokens_per_rank=1024 // cp, pad_multiplier=8)
        n = 1000
        (pos,) = request_positions([n], layout)
        plan = zigzag_plan([n], cp_size=cp, cp_rank=0, pad_multiplier=8)
        want = tuple(contiguous_part(plan.for_rank(r)).start for r in range(1, cp))
        assert pos.splits == want
        c = chunk_len(n, cp)
        assert pos.boundaries == tuple(k * c for k in range(1, 2 * cp))
        assert (pos.chunk[c - 1], pos.chunk[c]) == (0, 1)
        assert pos.near_split[want[0]] == 0 and pos.near_split[want[0] - 3] == -1
    # Packed with others, a short datum in the middle of a row can hold a split; at CP=1 nothing does.
    layout = Layout(cp_size=1, dp_size=1, max_tokens_per_rank=1024, pad_multiplier=8)
    assert all(p.splits == () for p in request_positions([100, 300, 5], layout))


def test_datum_set_is_fixed_and_sized_to_the_context():
    stream = text_token_stream(96, None)
    a = build_datum_set(seed=0, vocab_size=96, context_length=1024, stream=stream)
    b = build_datum_set(seed=0, vocab_size=96, context_length=1024, stream=stream)
    assert a.digest() == b.digest()
    assert [len(d.tokens) for d in a.main[:17]] == list(range(1, 18))
    assert [len(d.tokens) for d in a.long] == [500, 1000] and len(a.tail.tokens) == 763
    assert all(w == 0.0 for w in a.long[1].weights[:500]) and all(w > 0 for w in a.long[1].weights[500:])
    # The tail datum alone in its row: at CP 2 and 4 only rank 0 holds scored tokens (its last zigzag chunk), and
    # the others hold tokens that precede them; short rows end on every CP rank.
    scored = np.flatnonzero(np.asarray(a.tail.weights) > 0)
    for cp in (2, 4):
        for rank in range(cp):
            plan = zigzag_plan([len(a.tail.tokens)], cp_size=cp, cp_rank=rank, pad_multiplier=8)
            held = zigzag_slice(torch.arange(len(a.tail.tokens)), plan, pad_value=-1)
            assert bool(np.isin(scored, held.numpy()).any()) == (rank == 0), (cp, rank)
        last = set()
        for d in a.main[:17]:
            n = len(d.tokens)
            for rank in range(cp):
                plan = zigzag_plan([n], cp_size=cp, cp_rank=rank, pad_multiplier=8)
                if n - 1 in zigzag_slice(torch.arange(n), plan, pad_value=-1).tolist():
                    last.add(rank)
        assert last == set(range(cp)), (cp, last)
    assert build_datum_set(seed=1, vocab_size=96, context_length=1024, stream=stream).digest() != a.digest()


def test_limits_follow_the_precisions_compared():
    """bf16-exact against itself is held to float32's limits (its CP layouts agree to float32 head rounding,
    docs/parity.md); against another precision it differs by bf16 rounding, so bf16 limits apply."""
    from ringtune.parity.compare import _dtype

    def dump(dtype: str) -> dict:
        return {"layout": {"dtype": dtype}}

    assert LIMITS["bf16-exact"] is LIMITS["float32"]
    assert _dtype(dump("bf16-exact"), dump("bf16-exact")) == "bf16-exact"
    assert _dtype(dump("float32"), dump("bf16-exact")) == "bf16-mixed"
    assert _dtype(dump("bf16-exact"), dump("bfloat16")) == "bfloat16"
    assert _dtype(dump("float64"), dump("float32")) == "float32"


def test_kl_estimates_and_prompts():
    sampler = np.log(np.array([0.5, 0.25, 0.125]))
    same = kl_estimates(sampler, sampler.copy())
    assert same == {"k1": 0.0, "k3": 0.0, "max_abs": 0.0}
    delta = np.array([1e-3, -2e-3, 4e-3])
    got = kl_estimates(sampler, sampler + delta)
    assert got["k1"] == pytest.approx(-delta.mean(), rel=1e-12)
    assert got["k3"] == pytest.approx(np.mean(np.exp(delta) - 1 - delta), rel=1e-12)
    assert got["k3"] == pytest.approx(np.mean(delta**2) / 2, rel=1e-2) and got["max_abs"] == pytest.approx(4e-3)
    with pytest.raises(ValueError, match="must match"):
        kl_estimates(sampler, sampler[:2])
    data = build_datum_set(seed=0, vocab_size=96, context_length=1024, stream=text_token_stream(96, None))
    prompts = dict(sampler_prompts(data, 1024))
    assert (len(prompts["lone"]), len(prompts["short17"])) == (7, 17)
    assert max(map(len, prompts.values())) == PROMPT_CAP and len(prompts) == 2 + 4
    assert max(map(len, dict(sampler_prompts(data, 100)).values())) == 100 - SAMPLE_TOKENS


# ------------------------------------------------------------------------------------------------ the matrix


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    config = MatrixConfig(
        workdir=tmp / "work",
        doc=tmp / "validation.md",
        png_dir=tmp / "validation",
        cps=(1, 2),
        dps=(1, 2),
        modes=("headwise", "chunkwise"),
        dtypes=("float32",),
        row_tokens=ROW_TOKENS,
        faults=tuple(EXPECTED),
        moe_layouts=((1, 2, 2),),
    )
    return config, run_matrix(config)


def test_clean_layouts_pass_and_faults_fail(matrix):
    config, report = matrix
    clean = [r for r in report.rows if not r.expect_fail]
    assert [r.spec.name for r in clean] == [
        "cp2-headwise-dp1-float32",
        "cp2-chunkwise-dp1-float32",
        "cp1-dp2-float32",
        "cp2-headwise-dp2-float32",
        "cp2-chunkwise-dp2-float32",
        "cp2-chunkwise-dp1-ep2-float32",  # the tiny Qwen3.5-MoE, experts split over the two CP ranks
    ]
    for row in clean:
        assert not row.result.failures, [(f.name, f.value, f.limit) for f in row.result.failures]
        assert row.result.figure("grad_norm.cross_entropy").value <= 1e-5  # the brief's float32 bound
        assert row.png.is_file() and row.png.stat().st_size > 1000
    faults = {r.spec.debug_fault: r for r in report.rows if r.expect_fail}
    assert set(faults) == set(EXPECTED)
    for name, row in faults.items():
        names = [f.name for f in row.result.failures]
        assert any(n.startswith(EXPECTED[name]) for n in names), (name, names)
    # KL(sampler ‖ trainer) was measured on every server; the off-by-one trainer disagrees with its own sampler.
    for row in clean:
        assert row.result.figure("sampler_kl.k3").value <= 1e-10
    wrong = faults["position_off_by_one"].result
    assert not wrong.figure("sampler_kl.k3").ok and not wrong.figure("sampler_kl.max_abs").ok
    # The ring-accumulation probe ran on every server: float32 is its own accumulator (not applicable); on the
    # bf16 servers whose fault is elsewhere (CP=1 reference, the GDN decay at CP=2) the ring rounds once: 0 moved.
    for name in ("cp1-dp1-bfloat16", "cp2-chunkwise-dp1-bfloat16-fault-gdn_decay_relayout_bf16"):
        probe = json.loads(_dump(config, name).read_text())["probes"]["ring_accumulation"]
        assert probe["applies"] and probe["mismatch"] == {"dq": 0.0, "dk": 0.0, "dv": 0.0}, (name, probe)
    plain = json.loads(_dump(config, "cp2-headwise-dp1-float32").read_text())["probes"]["ring_accumulation"]
    assert plain["applies"] is False and "own accumulator" in plain["why"]
    assert report.ok
    text = config.doc.read_text()
    assert "| tiny-qwen3.5 | float32 | CP2 chunkwise | pass |" in text
    assert "| tiny-qwen3.5 | float32 | DP2 CP2 chunkwise | pass |" in text and "| DP2 CP1 | pass |" in text
    assert "| tiny-qwen3.5-moe | float32 | CP2 chunkwise EP2 | pass |" in text
    assert "sampler KL" in text and "not measured" not in text
    assert all(f"`{name}`" in text for name in EXPECTED)


def test_bf16_exact_layouts_pass_the_float32_limits(tmp_path):
    """Through the SDK: a bf16-exact server at CP=2 (chunkwise GDN, ring attention) against its CP=1 reference
    passes every float32 limit (docs/parity.md, "bf16-exact: held to float32's limits"); its sampler and trainer
    agree to float32 rounding."""
    config = MatrixConfig(
        workdir=tmp_path / "work",
        doc=tmp_path / "validation.md",
        png_dir=tmp_path / "validation",
        cps=(1, 2),
        modes=("chunkwise",),
        dtypes=("bf16-exact",),
        row_tokens=ROW_TOKENS,
    )
    report = run_matrix(config)
    [row] = report.rows
    assert row.spec.name == "cp2-chunkwise-dp1-bf16-exact" and row.result.dtype == "bf16-exact"
    assert not row.result.failures, [(f.name, f.value, f.limit) for f in row.result.failures]
    assert row.result.figure("lp.mean").limit == LIMITS["float32"].lp_mean
    assert row.result.figure("sampler_kl.k3").value <= 1e-10


def _dump(config: MatrixConfig, name: str) -> Path:
    return config.workdir / f"tiny-qwen3.5-{name}.json"


def test_compare_cli_exit_codes_and_noise(matrix, tmp_path, capsys):
    config, _ = matrix
    ref, hw = _dump(config, "cp1-dp1-float32"), _dump(config, "cp2-headwise-dp1-float32")
    cw = _dump(config, "cp2-chunkwise-dp1-float32")
    png, figures = tmp_path / "d.png", tmp_path / "f.json"
    assert main(["parity", "compare", str(ref), str(hw), "--png", str(png), "--json", str(figures)]) == 0
    assert png.is_file() and json.loads(figures.read_text())
    for fault, figure in EXPECTED.items():
        cp, mode, dtype = FAULT_LAYOUTS[fault]
        spec = ServeSpec(model="m", cp=cp, dtype=dtype, linear_cp_mode=mode, debug_fault=fault)
        bad = _dump(config, spec.name)
        reference = _dump(config, f"cp1-dp1-{dtype}")
        assert main(["parity", "compare", str(reference), str(bad)]) == 1
        assert figure in capsys.readouterr().out
    # --noise: another correct layout's deviation only widens limits; a clean candidate still passes and a
    # fault still fails (its deviation is orders of magnitude above the noise run's).
    assert main(["parity", "compare", str(ref), str(hw), "--noise", str(cw)]) == 0
    bad = _dump(config, "cp2-headwise-dp1-float32-fault-position_off_by_one")
    assert main(["parity", "compare", str(ref), str(bad), "--noise", str(cw)]) == 1


def test_a_dump_without_samples_has_no_sampler_figures(matrix):
    """A server that does not sample (an older dump, another server) is compared on everything else."""
    config, _ = matrix
    a = json.loads(_dump(config, "cp1-dp1-float32").read_text())
    b = json.loads(_dump(config, "cp2-headwise-dp1-float32").read_text())
    assert b["sampler_kl"]["status"] == "measured" and b["sampler_kl"]["tokens"] > 0
    unsampled = copy.deepcopy(b)
    unsampled["sampler_kl"] = {"status": "skipped", "reason": "the server does not sample"}
    result = compare_dumps(a, unsampled)
    assert not result.failures
    assert not [f for f in result.figures if f.name.startswith("sampler_kl.")]


def test_a_reference_at_another_row_budget_is_refused(matrix, tmp_path, capsys):
    config, _ = matrix
    a = json.loads(_dump(config, "cp1-dp1-float32").read_text())
    b = json.loads(_dump(config, "cp2-headwise-dp1-float32").read_text())
    compare_dumps(a, b)  # same row budget: 512 x 1 = 256 x 2
    other = copy.deepcopy(a)
    other["layout"]["max_tokens_per_rank"] = 520
    with pytest.raises(ComparisonRefusedError, match="--max-tokens-per-rank 512"):
        compare_dumps(other, b)
    path = tmp_path / "other.json"
    path.write_text(json.dumps(other))
    assert main(["parity", "compare", str(path), str(_dump(config, "cp2-headwise-dp1-float32"))]) == 2
    assert "repacking" in capsys.readouterr().err
    other = copy.deepcopy(a)
    other["data_digest"] = "0" * 64
    with pytest.raises(ComparisonRefusedError, match="different data"):
        compare_dumps(other, b)


def test_image_records_are_compared_when_both_servers_take_images(matrix):
    """Dumps of servers that take images carry ``forward.images`` (ringtune.parity.image_datums): its deltas give
    ``lp.images.*``; a text dump has no such figure. The image records here are the lone datum's, relabelled."""
    config, _ = matrix
    a = json.loads(_dump(config, "cp1-dp1-float32").read_text())
    b = json.loads(_dump(config, "cp2-headwise-dp1-float32").read_text())
    assert not [f for f in compare_dumps(a, b).figures if f.name.startswith("lp.images")]
    for dump in (a, b):
        dump["records"]["forward.images"] = copy.deepcopy(dump["records"]["forward.lone"])
    result = compare_dumps(a, b)
    assert not result.failures and result.figure("lp.images.mean").value <= LIMITS["float32"].lp_mean
    b["records"]["forward.images"]["logprobs"][0][3] += 0.01  # an image datum's text position moved
    assert {f.name for f in compare_dumps(a, b).failures} >= {"lp.images.mean", "lp.images.p99"}


def test_the_chunk0_detector_is_cpu_only(matrix):
    """``lp.chunk[0].moved`` rests on bit-deterministic CPU kernels: a candidate whose every starting-weight
    log-prob moved by 1e-7 (far below every magnitude limit) fails it on CPU only; a dump from a CUDA server
    reports it with no limit and says why."""
    config, _ = matrix
    a = json.loads(_dump(config, "cp1-dp1-float32").read_text())
    moved = copy.deepcopy(a)
    for name in ("forward.main", "forward.lone", "forward.long"):
        moved["records"][name]["logprobs"] = [[x + 1e-7 for x in lp] for lp in a["records"][name]["logprobs"]]
    assert [f.name for f in compare_dumps(a, moved).failures] == ["lp.chunk[0].moved"]
    on_gpu = copy.deepcopy(moved)
    on_gpu["layout"]["device_type"] = "cuda"
    figure = compare_dumps(a, on_gpu).figure("lp.chunk[0].moved")
    assert figure.ok and figure.value == 1.0 and figure.limit == float("inf") and CPU_ONLY in figure.note


def test_noise_floors_are_the_compare_figures_of_permuted_runs(matrix):
    """:func:`noise_floors` takes, per limit field, the largest matching compare figure over the runs given."""
    config, _ = matrix
    a = json.loads(_dump(config, "cp1-dp1-float32").read_text())
    b = json.loads(_dump(config, "cp2-headwise-dp1-float32").read_text())
    figures = {f.name: f.value for f in compare_dumps(a, b).figures}
    floors = noise_floors(a, [b])
    assert floors["lp_mean"] == figures["lp.mean"] and floors["grad_norm"] == figures["grad_norm.cross_entropy"]
    assert floors["short_max"] == max(v for k, v in figures.items() if k.startswith("lp.short["))
    assert noise_floors(a, [a])["lp_p99"] == 0.0  # a run against itself: no spread
