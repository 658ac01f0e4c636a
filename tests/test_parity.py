"""The parity client (issue 11): the small matrix through real ``ringtune serve`` subprocesses and the real SDK.

One module-scoped matrix on a tiny random Qwen3.5 (row budget 512 tokens): CP=1 reference, CP=2 headwise and
chunkwise, DP=2 at CP=1 and at CP=2 in both modes (float32), and every debug fault at CP=2. Clean layouts must
pass ``compare`` (step-1 grad-norm ratio within 1e-5), each fault must fail it naming the figure, the CLI exits
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

from ringtune.cli import main
from ringtune.engine.faults import DEBUG_FAULTS
from ringtune.layout.contiguous import contiguous_part
from ringtune.layout.zigzag import chunk_len, zigzag_plan
from ringtune.parity.compare import ComparisonRefusedError, compare_dumps
from ringtune.parity.datums import build_datum_set, text_token_stream
from ringtune.parity.matrix import MatrixConfig, run_matrix
from ringtune.parity.sampler_kl import PROMPT_CAP, SAMPLE_TOKENS, kl_estimates, sampler_prompts
from ringtune.parity.windows import Layout, request_positions

ROW_TOKENS = 512

# What each fault must break first (the figure compare names): a wrong rotary position shows in every log-prob
# past chunk C; an average instead of a sum halves the grad norm (CP=2) but not the Adam update; a dropped GDN
# state shows right after a split row; a flipped loss sign on one rank flips half of every datum's loss.
EXPECTED = {
    "position_off_by_one": "lp.mean",
    "gradients_averaged": "grad_norm.cross_entropy",
    "gdn_state_dropped": "lp.split[",
    "loss_sign_flipped": "loss.cross_entropy.per_token",
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
    assert [len(d.tokens) for d in a.main[:16]] == list(range(2, 18))
    assert [len(d.tokens) for d in a.long] == [500, 1000]
    assert all(w == 0.0 for w in a.long[1].weights[:500]) and all(w > 0 for w in a.long[1].weights[500:])
    assert build_datum_set(seed=1, vocab_size=96, context_length=1024, stream=stream).digest() != a.digest()


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
        faults=DEBUG_FAULTS,
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
    ]
    for row in clean:
        assert not row.result.failures, [(f.name, f.value, f.limit) for f in row.result.failures]
        assert row.result.figure("grad_norm.cross_entropy").value <= 1e-5  # the brief's float32 bound
        assert row.png.is_file() and row.png.stat().st_size > 1000
    faults = {r.spec.debug_fault: r for r in report.rows if r.expect_fail}
    assert set(faults) == set(DEBUG_FAULTS)
    for name, row in faults.items():
        names = [f.name for f in row.result.failures]
        assert any(n.startswith(EXPECTED[name]) for n in names), (name, names)
    # KL(sampler ‖ trainer) was measured on every server; the off-by-one trainer disagrees with its own sampler.
    for row in clean:
        assert row.result.figure("sampler_kl.k3").value <= 1e-10
    wrong = faults["position_off_by_one"].result
    assert not wrong.figure("sampler_kl.k3").ok and not wrong.figure("sampler_kl.max_abs").ok
    assert report.ok
    text = config.doc.read_text()
    assert "| tiny-qwen3.5 | float32 | CP2 chunkwise | pass |" in text
    assert "| tiny-qwen3.5 | float32 | DP2 CP2 chunkwise | pass |" in text and "| DP2 CP1 | pass |" in text
    assert "sampler KL" in text and "not measured" not in text
    assert all(f"`{name}`" in text for name in DEBUG_FAULTS)


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
        mode = "chunkwise" if fault == "gdn_state_dropped" else "headwise"
        bad = _dump(config, f"cp2-{mode}-dp1-float32-fault-{fault}")
        assert main(["parity", "compare", str(ref), str(bad)]) == 1
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
