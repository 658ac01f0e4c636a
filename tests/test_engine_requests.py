"""Every request is all-or-nothing on every rank: the bad-request catalogue, the finite guard, fault injection.

Each catalogue entry is run at CP=1 (four single-process replicas of the pool) and at DP×CP = 2×2, on a
trainer that holds accumulated gradients and AdamW moments: each must raise a UserInputError naming the
field, leave the state bit-identical on every rank, and the next good request must equal a fresh trainer's.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from support.harness import RankPool
from support.tiny_models import hf_model

from ringtune.engine.batch import MAX_TARGET_K
from ringtune.engine.grad_stash import drop_gradients
from ringtune.engine.optimizer import ADAMW_KERNELS, AdamParams, default_adamw_kernel, new_adamw
from ringtune.engine.trainer import TrainDatum, Trainer
from ringtune.errors import NonFiniteError, UserInputError
from ringtune.models.checkpoints.hf import load_hf
from ringtune.parallel.control import RankFailedError

BUDGET = 48  # per-rank tokens: several microbatches per request
LENS = (5, 17, 3, 11, 2, 9, 13, 7)
ADAM = AdamParams(learning_rate=1e-2, eps=1e-8, weight_decay=0.01)
TIMEOUT_S = 10.0  # the data-group timeout of this module's meshes


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(4, timeout=300, collective_timeout_s=TIMEOUT_S)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("requests") / "qwen3_5"
    hf_model("qwen3_5", seed=4).save_pretrained(path)
    return str(path)


# --------------------------------------------------------------------------------------------------- requests


KEEP, DROP = object(), object()  # override results: leave the datum's value alone / remove the key


def datums(loss_fn: str, vocab: int, lens=LENS, seed: int = 0, **override) -> list[TrainDatum]:
    """Good datums of ``loss_fn``; ``override[key] = fn(i, n, inputs)`` gives datum i's new value for ``key``
    (``tokens`` and ``inputs`` replace the whole field), or KEEP, or DROP (remove the key)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lens):
        inputs: object = {"target_tokens": torch.randint(0, vocab, (n,), generator=gen)}
        if loss_fn == "cross_entropy":
            inputs["weights"] = torch.rand(n, generator=gen)
        else:
            inputs["logprobs"] = -torch.rand(n, generator=gen) * 3
            inputs["advantages"] = torch.randn(n, generator=gen)
            if loss_fn == "gspo":
                inputs["sequence_ratio_mask"] = torch.ones(n)
        tokens: object = torch.randint(0, vocab, (n,), generator=gen)
        for key, fn in override.items():
            value = fn(i, n, inputs)
            if value is KEEP:
                continue
            if key == "tokens":
                tokens = value
            elif key == "inputs":
                inputs = value
            elif value is DROP:
                inputs.pop(key, None)
            else:
                inputs[key] = value
        out.append(TrainDatum(tokens=tokens, inputs=inputs))
    return out


def on(index: int, value):
    """An override that sets datum ``index``'s value (``value``, or ``value(n)`` if callable); others KEEP."""
    return lambda i, n, inputs: (value(n) if callable(value) else value) if i == index else KEEP


def every(value):
    """An override that sets every datum's value (``value(n)``, or DROP)."""
    return lambda i, n, inputs: value if value is DROP else value(n)


def fb(loss_fn="cross_entropy", config=None, **override):
    return ("fb", loss_fn, config, override)


def step(**fields):
    return ("optim", fields)


NAN, INF = float("nan"), float("inf")
IDS_2D = lambda n: torch.zeros(n, 2, dtype=torch.int64)  # noqa: E731

# name -> (request, substrings of the error message)
CATALOGUE: dict[str, tuple[tuple, tuple[str, ...]]] = {
    # the request's shape
    "data_not_a_list": (("raw", {"a": 1}), ("data: expected a list",)),
    "data_empty": (("raw", []), ("holds no datums",)),
    "data_a_string": (("raw", "abc"), ("data: expected a list",)),
    "datum_a_dict": (("raw", [{"tokens": [1], "inputs": {}}]), ("data[0]: expected a TrainDatum",)),
    # model_input
    "tokens_empty": (fb(tokens=on(2, torch.zeros(0, dtype=torch.int64))), ("data[2].model_input: 0 tokens",)),
    "tokens_2d": (fb(tokens=on(1, lambda n: torch.zeros(1, n, dtype=torch.int64))), ("data[1].model_input", "[N]")),
    "tokens_float": (fb(tokens=on(0, lambda n: torch.zeros(n))), ("data[0].model_input", "integers")),
    "tokens_bool": (fb(tokens=on(0, lambda n: torch.zeros(n, dtype=torch.bool))), ("data[0].model_input", "bool")),
    "tokens_list_float": (fb(tokens=on(3, lambda n: [1.5] * n)), ("data[3].model_input", "1.5", "integer")),
    "tokens_list_bool": (fb(tokens=on(3, lambda n: [True] * n)), ("data[3].model_input", "True", "bool")),
    "tokens_list_str": (fb(tokens=on(3, lambda n: ["7"] * n)), ("data[3].model_input", "'7'", "str")),
    "tokens_ragged": (fb(tokens=on(3, lambda n: [[1, 2], [3]])), ("data[3].model_input", "rectangular")),
    "tokens_negative": (fb(tokens=on(4, lambda n: torch.tensor([3, -5][:n]))), ("data[4].model_input[1]=-5",)),
    "tokens_vocab": (fb(tokens=on(4, lambda n: torch.full((n,), 10**6))), ("data[4].model_input[0]=1000000",)),
    "tokens_string": (fb(tokens=on(0, "hello")), ("data[0].model_input", "str")),
    "tokens_none": (fb(tokens=on(0, None)), ("data[0].model_input", "NoneType")),
    "tokens_object_array": (fb(tokens=on(0, np.array(["a"], dtype=object))), ("NumPy dtype object",)),
    "tokens_over_budget": (
        fb(
            tokens=on(1, lambda n: torch.zeros(300, dtype=torch.int64)),
            target_tokens=on(1, lambda n: torch.zeros(300, dtype=torch.int64)),
            weights=on(1, lambda n: torch.zeros(300)),
        ),
        ("data[1]: 300 tokens", "over the per-rank budget"),
    ),
    # loss_fn_inputs: keys
    "inputs_not_mapping": (fb(inputs=on(1, [1, 2])), ("data[1].loss_fn_inputs: expected a mapping",)),
    "inputs_int_key": (fb(inputs=on(1, {0: torch.zeros(1)})), ("data[1].loss_fn_inputs: key 0",)),
    "inputs_unknown_key": (fb(rewards=on(2, lambda n: torch.zeros(n))), ("datum 2", "'rewards'", "known keys")),
    "missing_targets": (fb(target_tokens=every(DROP)), ("lacks target_tokens",)),
    "missing_weights_later_datum": (fb(weights=on(6, DROP)), ("datum 6",)),
    "missing_advantages": (fb("importance_sampling", advantages=every(DROP)), ("lacks advantages",)),
    "missing_logprobs": (fb("ppo", logprobs=on(7, DROP)), ("datum 7",)),
    "missing_ratio_mask": (fb("gspo", sequence_ratio_mask=every(DROP)), ("sequence_ratio_mask",)),
    # target_tokens
    "targets_float": (fb(target_tokens=on(0, lambda n: torch.zeros(n))), ("'target_tokens'", "integers")),
    "targets_bool": (fb(target_tokens=on(0, lambda n: torch.ones(n, dtype=torch.bool))), ("'target_tokens'", "bool")),
    "targets_short": (fb(target_tokens=on(1, lambda n: torch.zeros(n - 1, dtype=torch.int64))), ("expected [17]",)),
    "targets_3d": (fb(target_tokens=on(0, lambda n: torch.zeros(n, 1, 1, dtype=torch.int64))), ("'target_tokens'",)),
    "targets_negative": (fb(target_tokens=on(0, lambda n: torch.full((n,), -3))), ("holds -3",)),
    "targets_vocab": (fb(target_tokens=on(5, lambda n: torch.full((n,), 99999))), ("=99999", "vocabulary")),
    "targets_k_over_cap": (
        fb(
            target_tokens=every(lambda n: torch.zeros(n, MAX_TARGET_K + 1, dtype=torch.int64)),
            weights=every(lambda n: torch.zeros(n, MAX_TARGET_K + 1)),
        ),
        (f"K={MAX_TARGET_K + 1}", "max_target_k"),
    ),
    "targets_k_for_ppo": (fb("ppo", target_tokens=every(IDS_2D)), ("only for cross_entropy",)),
    "targets_k_zero": (fb(target_tokens=on(0, lambda n: torch.zeros(n, 0, dtype=torch.int64))), ("'target_tokens'",)),
    "targets_mixed_ndim": (
        fb(target_tokens=on(2, IDS_2D), weights=on(2, lambda n: torch.zeros(n, 2))),
        ("data[2]", "one K"),
    ),
    "targets_mixed_k": (
        fb(
            target_tokens=lambda i, n, x: torch.zeros(n, 2 + (i == 3), dtype=torch.int64),
            weights=lambda i, n, x: torch.zeros(n, 2 + (i == 3)),
        ),
        ("data[3]", "one K"),
    ),
    # per-token values
    "weights_short": (fb(weights=on(1, lambda n: torch.zeros(n + 1))), ("'weights'", "[18]")),
    "weights_1d_with_k": (fb(target_tokens=every(IDS_2D)), ("'weights'", "shape of target_tokens")),
    "weights_nan": (fb(weights=on(3, lambda n: torch.full((n,), NAN))), ("'weights'", "nan", "finite")),
    "weights_inf": (fb(weights=on(3, lambda n: torch.full((n,), INF))), ("'weights'", "inf")),
    "weights_neg_inf": (fb(weights=on(3, lambda n: torch.full((n,), -INF))), ("'weights'", "-inf")),
    "weights_bool": (fb(weights=on(0, lambda n: torch.ones(n, dtype=torch.bool))), ("'weights'", "bool")),
    "weights_complex": (fb(weights=on(0, lambda n: torch.ones(n, dtype=torch.complex64))), ("complex",)),
    "weights_str_list": (fb(weights=on(0, lambda n: ["1"] * n)), ("'weights'", "str")),
    "weights_none_in_list": (fb(weights=on(0, lambda n: [None] * n)), ("'weights'", "NoneType")),
    "advantages_nan": (fb("ppo", advantages=on(4, lambda n: torch.full((n,), NAN))), ("'advantages'", "nan")),
    "logprobs_inf": (fb("cispo", logprobs=on(4, lambda n: torch.full((n,), -INF))), ("'logprobs'", "-inf")),
    "ratio_mask_nan": (fb("gspo", sequence_ratio_mask=on(0, lambda n: torch.full((n,), NAN))), ("nan",)),
    "mask_nan": (fb(mask=on(0, lambda n: torch.full((n,), NAN))), ("'mask'", "nan")),
    "clip_low_negative": (fb("ppo", clip_low_threshold=on(0, lambda n: torch.full((n,), -0.5))), ("must be >= 0",)),
    "clip_low_above_high": (
        fb(
            "ppo",
            clip_low_threshold=on(1, lambda n: torch.full((n,), 2.0)),
            clip_high_threshold=on(1, lambda n: torch.full((n,), 1.0)),
        ),
        ("needs low <= high",),
    ),
    "clip_low_above_config_high": (
        fb("ppo", clip_low_threshold=on(5, lambda n: torch.full((n,), 1.5))),
        ("data[5]", "loss_fn_config value", "low <= high"),
    ),
    "advantages_wrong_shape_k": (
        fb(
            "importance_sampling",
            target_tokens=every(IDS_2D),
            advantages=every(lambda n: torch.zeros(n, 3)),
            logprobs=every(lambda n: torch.zeros(n, 2)),
        ),
        ("'advantages'", "shape of target_tokens"),
    ),
    # loss_fn and its config
    "loss_unknown": (fb("foo"), ("loss_fn='foo'", "choose one of")),
    "loss_stable_reinforce": (fb("stable_reinforce"), ("stable_reinforce", "lacks", "sampled_mask")),
    "loss_custom": (fb("custom"), ("forward_backward_custom",)),
    "loss_none": (fb(None), ("loss_fn=None",)),
    "loss_int": (fb(3), ("loss_fn=3",)),
    "config_unknown_key": (fb("ppo", {"clip_lo": 0.5}), ("'clip_lo'", "takes only")),
    "config_string": (fb("ppo", {"clip_low_threshold": "0.5"}), ("finite real number",)),
    "config_bool": (fb("dro", {"beta": True}), ("'beta'", "finite real number")),
    "config_nan": (fb("ppo", {"clip_high_threshold": NAN}), ("finite real number",)),
    "config_beta_inf": (fb("dro", {"beta": INF}), ("'beta'",)),
    "config_low_above_high": (fb("ppo", {"clip_low_threshold": 2.0}), ("low <= high",)),
    "config_low_negative": (fb("cispo", {"clip_low_threshold": -1.0}), ("must be >= 0",)),
    "config_beta_negative": (fb("dro", {"beta": -0.1}), ("'beta'", ">= 0")),
    "config_for_cross_entropy": (fb("cross_entropy", {"beta": 0.1}), ("takes no loss_fn_config",)),
    "config_not_mapping": (fb("ppo", [("clip_low_threshold", 0.5)]), ("loss_fn_config: expected a mapping",)),
    # AdamParams
    "lr_string": (step(learning_rate="1e-3"), ("adam_params.learning_rate='1e-3'", "str")),
    "lr_bool": (step(learning_rate=True), ("adam_params.learning_rate=True", "bool")),
    "lr_negative": (step(learning_rate=-1e-3), ("adam_params.learning_rate=-0.001", ">= 0")),
    "lr_nan": (step(learning_rate=NAN), ("adam_params.learning_rate=nan",)),
    "lr_inf": (step(learning_rate=INF), ("adam_params.learning_rate=inf",)),
    "lr_none": (step(learning_rate=None), ("adam_params.learning_rate=None",)),
    "beta1_one": (step(beta1=1.0), ("adam_params.beta1=1.0", "[0, 1)")),
    "beta1_negative": (step(beta1=-0.1), ("adam_params.beta1",)),
    "beta2_above": (step(beta2=1.5), ("adam_params.beta2=1.5",)),
    "beta2_list": (step(beta2=[0.9]), ("adam_params.beta2=[0.9]", "list")),
    "eps_zero": (step(eps=0.0), ("adam_params.eps=0.0", "> 0")),
    "eps_negative": (step(eps=-1e-8), ("adam_params.eps",)),
    "eps_string": (step(eps="tiny"), ("adam_params.eps='tiny'",)),
    "weight_decay_negative": (step(weight_decay=-0.01), ("adam_params.weight_decay",)),
    "grad_clip_negative": (step(grad_clip_norm=-1.0), ("adam_params.grad_clip_norm",)),
    "grad_clip_nan": (step(grad_clip_norm=NAN), ("adam_params.grad_clip_norm=nan",)),
    # finite values that make the loss or the gradient non-finite (NonFiniteError)
    "advantages_1e38": (fb("importance_sampling", advantages=on(2, lambda n: torch.full((n,), 1e38))), ("data[2]",)),
    "weights_3e38": (fb(weights=on(6, lambda n: torch.full((n,), 3e38))), ("data[6]", "non-finite")),
    "dro_logprobs_1e30": (fb("dro", logprobs=on(1, lambda n: torch.full((n,), -1e30))), ("data[1]", "non-finite")),
}
NON_FINITE = {"advantages_1e38", "weights_3e38", "dro_logprobs_1e30"}


RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo")


def make_request(name: str, vocab: int):
    request, _ = CATALOGUE[name]
    if request[0] != "fb":
        return request
    _, loss_fn, config, override = request
    base = loss_fn if loss_fn in RL_LOSSES else "cross_entropy"
    return ("fb", datums(base, vocab, **override), loss_fn, config)


# --------------------------------------------------------------------------------------------------- state


def snapshot(trainer: Trainer) -> dict[str, object]:
    state: dict[str, object] = {"step": trainer.step, "expected": trainer.invariant.expected}
    canary = trainer.invariant.canary.grad
    state["canary"] = None if canary is None else canary.clone()
    for name, p in trainer.model.named_parameters():
        state[f"w.{name}"] = p.detach().clone()
        state[f"g.{name}"] = None if p.grad is None else p.grad.clone()
        for key, value in trainer.optimizer.state.get(p, {}).items():
            state[f"m.{name}.{key}"] = value.clone() if isinstance(value, torch.Tensor) else value
    return state


def differences(a: dict, b: dict) -> list[str]:
    out = [k for k in sorted(set(a) | set(b)) if k not in a or k not in b]
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        same = torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
        if not same:
            out.append(k)
    return sorted(out)


def primed(ctx, root: str, dp: int, cp: int, adamw_kernel: str | None = None) -> Trainer:
    """A trainer that has stepped once (moments exist) and holds accumulated gradients."""
    mesh = ctx.mesh(dp=dp, cp=cp)  # (1, 1): four single-rank replicas of the pool
    model = load_hf(root, dtype=torch.float32)
    trainer = Trainer(model, mesh, max_tokens_per_rank=BUDGET, adamw_kernel=adamw_kernel)
    vocab = trainer.model.config.vocab_size
    trainer.forward_backward(datums("cross_entropy", vocab, seed=1), "cross_entropy")
    trainer.optim_step(ADAM)
    trainer.forward_backward(datums("ppo", vocab, seed=2), "ppo")
    return trainer


def good_tail(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The next good request and step; the weights after it."""
    vocab = trainer.model.config.vocab_size
    trainer.forward_backward(datums("importance_sampling", vocab, seed=3), "importance_sampling")
    trainer.optim_step(ADAM)
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def catalogue_case(ctx, *, root: str, dp: int, cp: int, names: list[str]):
    trainer = primed(ctx, root, dp, cp)
    vocab = trainer.model.config.vocab_size
    report = {}
    for name in names:
        before = snapshot(trainer)
        request = make_request(name, vocab)
        try:
            if request[0] == "raw":
                trainer.forward_backward(request[1], "cross_entropy")
            elif request[0] == "fb":
                trainer.forward_backward(request[1], request[2], request[3])
            else:
                trainer.optim_step(AdamParams(**{**ADAM.__dict__, **request[1]}))
            outcome = ("no error", "")
        except UserInputError as exc:
            outcome = (type(exc).__name__, str(exc))
        except Exception as exc:  # a crash: reported, the test fails
            outcome = (f"CRASH {type(exc).__name__}", str(exc))
        report[name] = (*outcome, differences(before, snapshot(trainer)))
    after_bad = good_tail(trainer)
    fresh = good_tail(primed(ctx, root, dp, cp))
    report["__next_good_equals_fresh__"] = all(torch.equal(after_bad[n], fresh[n]) for n in fresh)
    return report


@pytest.mark.parametrize(("dp", "cp"), [(1, 1), (2, 2)])
def test_bad_request_catalogue(pool, checkpoint, dp, cp):
    assert len(CATALOGUE) >= 80
    names = sorted(CATALOGUE)
    for rank, report in enumerate(pool.run(catalogue_case, root=checkpoint, dp=dp, cp=cp, names=names)):
        assert report.pop("__next_good_equals_fresh__"), f"rank {rank}: the next good request differs from fresh"
        for name, (kind, message, changed) in report.items():
            want = NonFiniteError.__name__ if name in NON_FINITE else None
            assert kind != "no error" and not kind.startswith("CRASH"), (rank, name, kind, message)
            assert want is None or kind == want, (rank, name, kind, message)
            for needle in CATALOGUE[name][1]:
                assert needle in message, (rank, name, needle, message)
            assert not changed, (rank, name, changed[:5])


def test_optional_keys_may_differ_between_datums(checkpoint):
    """A key present on datum 0 but not on later ones (mask, per-token thresholds) is fine: defaults apply."""
    trainer = Trainer(load_hf(checkpoint, dtype=torch.float64), None, max_tokens_per_rank=BUDGET)
    vocab = trainer.model.config.vocab_size
    plain = datums("ppo", vocab, seed=5)
    mixed = datums(
        "ppo",
        vocab,
        seed=5,
        mask=on(0, torch.ones),
        clip_low_threshold=on(6, lambda n: torch.full((n,), 0.8, dtype=torch.float64)),  # = the config value
    )
    want = trainer.forward(plain, "ppo").outputs
    got = trainer.forward(mixed, "ppo").outputs
    assert all(torch.equal(a["elementwise_loss"], b["elementwise_loss"]) for a, b in zip(got, want, strict=True))
    trainer.forward_backward(plain, "ppo")  # accumulated gradients, which a forward must not touch
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    lists = [TrainDatum(tokens=d.tokens.tolist(), inputs={k: v.tolist() for k, v in d.inputs.items()}) for d in plain]
    converted = trainer.forward(lists, "ppo").outputs
    assert all(torch.equal(a["logprobs"], b["logprobs"]) for a, b in zip(converted, want, strict=True))
    assert all(torch.equal(p.grad, grads[n]) for n, p in trainer.model.named_parameters())


def test_importance_sampling_takes_k_targets_per_position(checkpoint):
    """[N, K] targets for importance_sampling: each column's terms equal a [N] request on that column."""
    trainer = Trainer(load_hf(checkpoint, dtype=torch.float64), None, max_tokens_per_rank=BUDGET)
    vocab = trainer.model.config.vocab_size
    gen = torch.Generator().manual_seed(11)
    data = []
    for n in (4, 9, 6):
        inputs = {
            "target_tokens": torch.randint(0, vocab, (n, 3), generator=gen),
            "logprobs": -torch.rand(n, 3, generator=gen, dtype=torch.float64),
            "advantages": torch.randn(n, 3, generator=gen, dtype=torch.float64),
        }
        data.append(TrainDatum(tokens=torch.randint(0, vocab, (n,), generator=gen), inputs=inputs))
    got = trainer.forward(data, "importance_sampling").outputs
    for k in range(3):
        column = [TrainDatum(d.tokens, {key: v[:, k] for key, v in d.inputs.items()}) for d in data]
        want = trainer.forward(column, "importance_sampling").outputs
        for g, w in zip(got, want, strict=True):
            assert g["logprobs"].shape[1] == 3
            assert torch.allclose(g["logprobs"][:, k], w["logprobs"], atol=1e-12)
            assert torch.allclose(g["elementwise_loss"][:, k], w["elementwise_loss"], atol=1e-12)


# --------------------------------------------------------------------------------------------------- faults


def fault_case(ctx, *, root: str, kill: bool = False):
    """DP×CP = 2×2: global rank 1 fails before its second microbatch (after one ran backward)."""
    trainer = primed(ctx, root, 2, 2)
    vocab = trainer.model.config.vocab_size
    before = snapshot(trainer)

    def hook(m: int) -> None:
        if ctx.rank == 1 and m == 1:
            if kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("injected fault in microbatch 1")

    clean = trainer.faults
    trainer.faults = replace(clean, before_microbatch=hook)
    start = time.monotonic()
    try:
        trainer.forward_backward(datums("cross_entropy", vocab, lens=LENS * 4, seed=9), "cross_entropy")
        outcome = ("no error", "")
    except Exception as exc:
        outcome = (type(exc).__name__, str(exc))
    elapsed = time.monotonic() - start
    trainer.faults = clean
    changed = differences(before, snapshot(trainer))
    if kill:
        return outcome, elapsed, changed
    after = good_tail(trainer)
    fresh = good_tail(primed(ctx, root, 2, 2))
    return outcome, elapsed, changed, all(torch.equal(after[n], fresh[n]) for n in fresh)


def test_fault_mid_request_every_rank_raises_state_unchanged(pool, checkpoint):
    for rank, (outcome, elapsed, changed, next_equal) in enumerate(pool.run(fault_case, root=checkpoint)):
        kind, message = outcome
        assert kind == RankFailedError.__name__, (rank, kind, message)
        assert "rank 1 failed: RuntimeError: injected fault in microbatch 1" in message, (rank, message)
        assert elapsed < 3 * TIMEOUT_S + 30, (rank, elapsed)
        assert not changed, (rank, changed[:5])
        assert next_equal, f"rank {rank}: the next good request after the fault differs from a fresh trainer's"


def test_sigkill_of_one_rank_others_raise_quickly(pool, checkpoint):
    results = pool.run(fault_case, root=checkpoint, kill=True, allow_dead=True)
    assert results[1] is None  # the killed rank
    for rank in (0, 2, 3):
        (kind, message), elapsed, changed = results[rank]
        assert kind == RankFailedError.__name__, (rank, kind, message)
        assert elapsed < 30, (rank, elapsed)
        assert not changed, (rank, changed[:5])


# --------------------------------------------------------------------------------------------------- finite guard


def nan_case(ctx, *, root: str):
    """A NaN injected into one rank's gradient, then into a weight: refused, state kept, later steps work."""
    trainer = primed(ctx, root, 2, 2)
    vocab = trainer.model.config.vocab_size
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    moments = snapshot(trainer)
    param = trainer.model.model.norm.weight
    if ctx.rank == 2:
        param.grad[0] = float("nan")
    out = {}
    try:
        trainer.optim_step(ADAM)
    except NonFiniteError as exc:
        out["grad"] = str(exc)
    out["grad_kept"] = all(torch.equal(p.detach(), weights[n]) for n, p in trainer.model.named_parameters())
    out["moments_kept"] = not [k for k in differences(moments, snapshot(trainer)) if k.startswith(("m.", "w."))]
    out["grads_dropped"] = all(p.grad is None for p in trainer.params)
    trainer.forward_backward(datums("cross_entropy", vocab, seed=7), "cross_entropy")
    out["later_step"] = trainer.optim_step(ADAM)["grad_norm:mean"]
    out["finite"] = all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())
    with torch.no_grad():
        saved = param[1].clone()
        param[1] = float("nan")
    try:
        trainer.forward_backward(datums("cross_entropy", vocab, seed=8), "cross_entropy")
    except NonFiniteError as exc:
        out["weight_fb"] = str(exc)
    try:
        trainer.optim_step(ADAM)
    except NonFiniteError as exc:
        out["weight_step"] = str(exc)
    with torch.no_grad():
        param[1] = saved
    trainer.forward_backward(datums("cross_entropy", vocab, seed=8), "cross_entropy")
    out["after_restore"] = trainer.optim_step(ADAM)["grad_norm:mean"]
    return out


def test_non_finite_gradient_and_weight_are_refused(pool, checkpoint):
    for rank, out in enumerate(pool.run(nan_case, root=checkpoint)):
        assert "summed gradient's norm is nan" in out["grad"], (rank, out)
        assert out["grad_kept"] and out["moments_kept"] and out["grads_dropped"], (rank, out)
        assert np.isfinite(out["later_step"]) and out["finite"], (rank, out)
        assert "forward_backward refused (loss_fn='cross_entropy'): non-finite" in out["weight_fb"], (rank, out)
        assert "model.norm.weight" in out["weight_step"], (rank, out)
        assert np.isfinite(out["after_restore"]), (rank, out)


def overflow_case(ctx, *, root: str, dp: int, cp: int, adamw_kernel: str | None = None):
    """A finite gradient element of 2.9e32 on one rank of the mesh (its square overflows float32's second moment),
    then a finite learning rate of 1e39 (the weights would overflow): both refused, nothing changed."""
    trainer = primed(ctx, root, dp, cp, adamw_kernel)
    vocab = trainer.model.config.vocab_size
    out = {}
    for name, adam in (("huge_grad", ADAM), ("huge_lr", AdamParams(**{**ADAM.__dict__, "learning_rate": 1e39}))):
        if name == "huge_lr":
            trainer.forward_backward(datums("cross_entropy", vocab, seed=6), "cross_entropy")
        before = snapshot(trainer)
        if name == "huge_grad" and (dp * cp == 1 or ctx.rank == ctx.world_size - 1):  # one rank of the mesh
            trainer.model.model.norm.weight.grad[3] = 2.9e32
        try:
            trainer.optim_step(adam)
            out[name] = "no error"
        except NonFiniteError as exc:
            out[name] = str(exc)
        changed = differences(before, snapshot(trainer))
        out[f"{name}_changed"] = [k for k in changed if not k.startswith("g.") and k not in ("canary", "expected")]
        out[f"{name}_grads_dropped"] = all(p.grad is None for p in trainer.params)
    after = good_tail(trainer)
    fresh = primed(ctx, root, dp, cp, adamw_kernel)
    drop_gradients(fresh.params, fresh.invariant)  # what the refusals dropped
    out["next_equals_fresh"] = all(torch.equal(after[n], w) for n, w in good_tail(fresh).items())
    out["moments_finite"] = all(
        bool(torch.isfinite(v).all()) for s in trainer.optimizer.state.values() for v in s.values()
    )
    return out


@pytest.mark.parametrize(("dp", "cp", "adamw_kernel"), [(1, 1, None), (2, 2, None), (2, 2, "fused")])
def test_update_that_would_overflow_a_moment_or_weight_is_refused(pool, checkpoint, dp, cp, adamw_kernel):
    """Also with the ``fused`` AdamW kernel (CUDA's default; torch runs it on CPU too): the trial update of
    ``non_finite_update`` takes the kernel the optimizer runs."""
    kw = {"adamw_kernel": adamw_kernel}
    for rank, out in enumerate(pool.run(overflow_case, root=checkpoint, dp=dp, cp=cp, **kw)):
        assert "AdamW update of parameter(s) model.norm.weight would make" in out["huge_grad"], (rank, out)
        assert "AdamW update of parameter(s)" in out["huge_lr"], (rank, out)
        for name in ("huge_grad", "huge_lr"):
            assert out[f"{name}_changed"] == [] and out[f"{name}_grads_dropped"], (rank, name, out)
        assert out["next_equals_fresh"] and out["moments_finite"], (rank, out)


def adamw_kernels_case(ctx, *, root: str):
    """Three steps by each AdamW kernel from the same start: the start, the weights after, the kernels' flags."""
    out = {}
    for kernel in ADAMW_KERNELS:
        trainer = Trainer(load_hf(root, dtype=torch.float32), None, max_tokens_per_rank=BUDGET, adamw_kernel=kernel)
        out["start"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        out["default"] = default_adamw_kernel(trainer.params)
        vocab = trainer.model.config.vocab_size
        for seed in range(3):
            trainer.forward_backward(datums("cross_entropy", vocab, seed=seed), "cross_entropy")
            trainer.optim_step(ADAM)
        out[kernel] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        out[f"{kernel}.fused"] = bool(trainer.optimizer.param_groups[0]["fused"])
    return out


def test_adamw_kernels_take_the_same_steps(pool, checkpoint):
    """``fused`` (CUDA's default) and torch's default AdamW give the same weights after three steps to float32
    rounding: each element's update is the same few float32 operations in another order. Steps of lr 1e-2 move
    the weights by ~3e-2, so 1e-6 is ~30 ulps of the update, far below what a changed formula would move (a missed
    bias correction: ~1e-2)."""
    out = pool.run(adamw_kernels_case, root=checkpoint)[0]
    assert out["fused.fused"] and not out["torch_default.fused"] and out["default"] == "fused"  # CPU too
    fused, default, start = out["fused"], out["torch_default"], out["start"]
    worst = max(float((fused[n] - w).abs().max()) for n, w in default.items())
    moved = max(float((default[n] - w).abs().max()) for n, w in start.items())
    print(f"\nafter 3 AdamW steps: max |fused - torch_default| {worst:.1e}, max |moved| {moved:.1e}")
    assert worst <= 1e-6 and moved > 1e-2
    with pytest.raises(ValueError, match="adamw kernel 'apex': choose one of fused, torch_default"):
        new_adamw([torch.nn.Parameter(torch.zeros(2))], "apex")


def test_a_checkpoint_resumes_under_the_other_adamw_kernel(checkpoint, tmp_path):
    """The kernel is the live trainer's, not the checkpoint's (checkpoint_fit._KERNEL_KEYS): a state saved by a
    ``torch_default`` trainer (every CPU checkpoint before ``fused`` became the CPU default) loads into a ``fused``
    one, which stays fused, with the moments and step as saved; its next step equals the ``torch_default``
    continuation to float32 rounding (the 1e-6 of test_adamw_kernels_take_the_same_steps), and the other way round."""

    def trainer(kernel: str) -> Trainer:
        return Trainer(load_hf(checkpoint, dtype=torch.float32), None, max_tokens_per_rank=BUDGET, adamw_kernel=kernel)

    for saved_by, resumed_by in (("torch_default", "fused"), ("fused", "torch_default")):
        first = trainer(saved_by)
        vocab = first.model.config.vocab_size
        first.forward_backward(datums("cross_entropy", vocab, seed=0), "cross_entropy")
        first.optim_step(ADAM)
        first.save_state(str(tmp_path / saved_by))
        resumed = trainer(resumed_by)
        resumed.load_state(str(tmp_path / saved_by))
        assert bool(resumed.optimizer.param_groups[0]["fused"]) == (resumed_by == "fused")
        for p, q in zip(first.params, resumed.params, strict=True):
            a, b = first.optimizer.state[p], resumed.optimizer.state[q]
            assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"]) and float(a["step"]) == float(b["step"]) == 1.0
        for t in (first, resumed):
            t.forward_backward(datums("cross_entropy", vocab, seed=1), "cross_entropy")
            t.optim_step(ADAM)
        worst = max(float((p - q).abs().max()) for p, q in zip(first.params, resumed.params, strict=True))
        assert worst <= 1e-6, (saved_by, resumed_by, worst)
