"""Prompts through the DP×CP forward (``ringtune.sample.mesh_prompts``) equal the one-rank prefill.

float64, within 1e-10: prompt log-probs, top-k prompt log-probs (same ids), target prompt log-probs (K ids
per position, −1 asks nothing and gets 0), prompt alt-token draws (same ids, log-probs), the last token's
logits and the decode caches (attention K/V, GatedDeltaNet recurrent state and conv window) of packed prompts
(1–17 tokens, lengths not divisible by 2·CP, longer than a GDN chunk, one longer than a row so rows split) at
(DP, CP) in {(1, 1), (1, 2), (1, 4), (2, 2)}, both GatedDeltaNet CP modes and every attention mode the tiny
model allows; every prompt is decoded by exactly one rank of its replica. Through :class:`RankExecutor`:
long-prompt requests routed to the mesh (one-token and multi-token generations) return the same samples
(tokens, untempered log-probs, stop reasons, prompt log-probs) as ``generate`` on one rank for the same
seed; short requests still take the spread path; a prompt over the budget is a user error on every rank and
the executor keeps working.
"""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import hf_model

from ringtune.errors import UserInputError
from ringtune.models.checkpoints.hf import load_hf
from ringtune.sample.alt_tokens import AltDraws
from ringtune.sample.mesh_prompts import MeshLayout, prompts_forward, takes_mesh_forward
from ringtune.sample.params import SamplingParams
from ringtune.sample.pool import SampleRequest
from ringtune.sample.prefill import prefill
from ringtune.sample.sampler import generate
from ringtune.worker.commands import Command
from ringtune.worker.executor import ModelSpec, RankExecutor

PROMPT_LENS = (1, 2, 17, 5, 150, 3, 9, 70)
LAYOUTS = ((1, 1), (1, 2), (1, 4), (2, 2))
MODES = (("ring", "headwise"), ("allgather", "chunkwise"), ("ring", "chunkwise"))
BUDGET = 160  # per-rank tokens: several rows at every CP, the 150-token prompt alone in its row at CP 1
TOPK = 5
ALT = AltDraws(k=4, temperature=0.9, seeds=tuple(100 + i for i in range(len(PROMPT_LENS))))


def _prompts(seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _targets(seed: int = 8) -> list[torch.Tensor]:
    """Tinker target_prompt_logprobs per prompt: [n − 1, 3] ids, some −1 (nothing asked)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in PROMPT_LENS:
        ids = torch.randint(0, 96, (n - 1, 3), generator=g)
        ids[torch.rand(ids.shape, generator=g) < 0.2] = -1
        out.append(ids)
    return out


def _cache_tensors(cache) -> list[torch.Tensor]:
    """Every tensor of a SequenceCache, layer by layer (K, V or state, conv window)."""
    return [t for layer in cache.layers for t in vars(layer).values()]


def _reference(root: str) -> list[dict]:
    """The one-rank prefill of every prompt alone (CP = 1, with a cache): what generate() does itself."""
    model = load_hf(root, dtype=torch.float64)
    out = []
    with torch.inference_mode():
        for p, t in zip(_prompts(), _targets(), strict=True):
            r = prefill(model, [p], prompt_logprobs=True, topk=TOPK, targets=[t], alt=ALT.for_prompts([len(out)]))
            out.append(
                {
                    "logits": r.last_logits[0],
                    "lp": r.prompt_logprobs[0],
                    "top": r.topk_prompt_logprobs[0],
                    "cache": _cache_tensors(r.caches[0]),
                    "targets": r.target_logprobs[0],
                    "alt": r.prompt_alt_tokens[0],
                }
            )
    return out


def mesh_case(ctx, *, root: str):
    """Every layout; this rank's decoded prompts: {layout: [(prompt index, results)]}."""
    results = {}
    for dp, cp in LAYOUTS:
        for attention, gated_delta in MODES:
            if cp == 1 and (attention, gated_delta) != MODES[0]:
                continue
            mesh = ctx.mesh(dp=dp, cp=cp)
            model = load_hf(root, dtype=torch.float64)
            layout = MeshLayout(max_tokens_per_rank=BUDGET, attention=attention, gated_delta=gated_delta)
            got = prompts_forward(
                model,
                mesh,
                _prompts(),
                layout,
                prompt_logprobs=True,
                topk=TOPK,
                capture=True,
                targets=_targets(),
                alt=ALT,
            )
            results[dp, cp, attention, gated_delta] = [
                (
                    i,
                    {
                        "logits": f.last_logits,
                        "lp": f.prompt_logprobs,
                        "top": f.topk_prompt_logprobs,
                        "cache": _cache_tensors(f.cache),
                        "targets": f.target_logprobs,
                        "alt": f.prompt_alt_tokens,
                    },
                )
                for i, f in sorted(got.items())
            ]
    return results


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mesh_prompts") / "qwen3_5"
    hf_model("qwen3_5", seed=5).save_pretrained(path)
    return str(path)


def _max_abs(a: list, b: list) -> float:
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x is not None or y is not None]
    assert all(x is not None and y is not None for x, y in pairs)
    return max((abs(x - y) for x, y in pairs), default=0.0)


def test_mesh_forward_equals_one_rank_prefill_float64(pool4, checkpoint):
    want = _reference(checkpoint)
    runs: dict[tuple, list] = {}
    for res in pool4.run(mesh_case, root=checkpoint):
        for key, decoded in res.items():
            runs.setdefault(key, []).extend(decoded)
    assert len(runs) == 1 + 3 * len(MODES)
    for key, decoded in runs.items():
        dp, cp = key[:2]
        counts = [sum(1 for i, _ in decoded if i == j) for j in range(len(PROMPT_LENS))]
        assert counts == [4 // (dp * cp)] * len(PROMPT_LENS), (key, counts)  # one decoding rank per replica
        for i, g in decoded:
            w, n = want[i], PROMPT_LENS[i]
            assert len(g["cache"]) == len(w["cache"]), key
            for got_t, want_t in zip(g["cache"], w["cache"], strict=True):
                assert got_t.shape == want_t.shape and got_t.dtype == want_t.dtype, key
                assert (got_t - want_t).abs().max().item() <= 1e-10, (key, i)
            assert g["lp"][0] is None and len(g["lp"]) == n, key
            assert g["targets"].shape == (n - 1, 3), key
            assert (g["targets"] - w["targets"]).abs().max().item() <= 1e-10 if n > 1 else True, key
            assert (g["targets"][_targets()[i] < 0] == 0).all(), key
            (g_ids, g_lps), (w_ids, w_lps) = g["alt"], w["alt"]
            assert g_ids.shape == (n - 1, ALT.k) and g_ids.dtype == torch.int64, key
            assert torch.equal(g_ids, w_ids), (key, i)
            assert (g_lps - w_lps).abs().max().item() <= 1e-10 if n > 1 else True, key
            assert _max_abs(g["lp"], w["lp"]) <= 1e-10, key
            assert (g["logits"] - w["logits"]).abs().max().item() <= 1e-10, key
            assert g["top"][0] is None and len(g["top"]) == n, key
            for gt, wt in zip(g["top"][1:], w["top"][1:], strict=True):
                assert [t for t, _ in gt] == [t for t, _ in wt], key
                assert max(abs(a - b) for (_, a), (_, b) in zip(gt, wt, strict=True)) <= 1e-10, key


def test_route_takes_long_prompts():
    assert takes_mesh_forward(4096, min_prompt_tokens=4096)
    assert not takes_mesh_forward(4095, min_prompt_tokens=4096)


def _requests() -> list[SampleRequest]:
    prompts = _prompts(seed=11)
    params = SamplingParams(max_tokens=1, temperature=0.8, top_k=20, seed=17)
    out = [SampleRequest(prompt=p, params=params, num_samples=3, prompt_logprobs=True) for p in prompts]
    out.append(SampleRequest(prompt=prompts[0], params=SamplingParams(max_tokens=4, seed=2), num_samples=2))
    out.append(SampleRequest(prompt=prompts[4], params=SamplingParams(max_tokens=1, temperature=0.0)))
    # Long prompts that generate several tokens: prefilled on the mesh, decoded from the gathered caches.
    decode = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, seed=5, stop=[])
    out += [SampleRequest(prompt=prompts[i], params=decode, num_samples=2, prompt_logprobs=True) for i in (2, 4, 7)]
    greedy = SamplingParams(max_tokens=5, temperature=0.0, stop=[])
    out.append(SampleRequest(prompt=prompts[6], params=greedy, topk_sample_logprobs=3))  # top-3 per token too
    alt = SamplingParams(max_tokens=1, temperature=0.7, seed=23)  # 4 draws per prompt position too
    out.append(SampleRequest(prompt=prompts[7], params=alt, prompt_logprobs=True, prompt_alt_tokens_k=4))
    return out


def executor_case(ctx, *, root: str, dp: int, cp: int):
    import ringtune.worker.executor as executor_module

    routed: list[int] = []  # prompts per prompts_forward call: proves which requests took the mesh
    original = executor_module.prompts_forward

    def counting(model, mesh, prompts, *args, **kwargs):
        routed.append(len(prompts))
        return original(model, mesh, prompts, *args, **kwargs)

    executor_module.prompts_forward = counting
    mesh = ctx.mesh(dp=dp, cp=cp)
    spec = ModelSpec(
        source=root,
        dtype="float64",
        max_tokens_per_rank=BUDGET,
        trainer_options={"gated_delta": "chunkwise"},
        mesh_prompt_tokens=8,  # prompts of >= 8 tokens and max_tokens=1 go through the mesh
    )
    executor = RankExecutor(spec, mesh)
    executor.execute(Command("create_sampler", args={"sampler_id": "s", "source": _base_source()}))
    results = executor.execute(Command("sample", args={"sampler_id": "s", "requests": _requests()}))
    too_long = SampleRequest(prompt=[1] * (BUDGET * cp * 2), params=SamplingParams(max_tokens=1))
    try:
        executor.execute(Command("sample", args={"sampler_id": "s", "requests": [too_long]}))
        refused = None
    except UserInputError as exc:
        refused = str(exc)
    again = executor.execute(Command("sample", args={"sampler_id": "s", "requests": _requests()[:2]}))
    executor_module.prompts_forward = original
    return {"results": results, "refused": refused, "again": again, "routed": routed}


def _base_source():
    from ringtune.sample.pool import SamplerSource

    return SamplerSource()


@pytest.mark.parametrize(("dp", "cp"), [(1, 2), (2, 2)])
def test_executor_routes_long_one_token_requests_to_the_mesh(pool4, checkpoint, dp, cp):
    model = load_hf(checkpoint, dtype=torch.float64)
    want = [
        generate(
            model,
            [r.prompt],
            r.params,
            num_samples=r.num_samples,
            prompt_logprobs=r.prompt_logprobs,
            topk_sample_logprobs=r.topk_sample_logprobs,
            prompt_alt_tokens_k=r.prompt_alt_tokens_k,
        )[0]
        for r in _requests()
    ]
    answers = [a for a in pool4.run(executor_case, root=checkpoint, dp=dp, cp=cp) if a["results"] is not None]
    assert len(answers) == 4 // (dp * cp)  # one result rank per replica of the mesh
    for answer in answers:
        # _requests(): the 4 prompts of >= 8 tokens generating one token with prompt log-probs in one
        # forward, the 3 generating 6 in another (with caches), the greedy one-token one, the greedy
        # 5-token one, the one with alt tokens; then the too-long one; the short ones, the 4-token generation
        # of a 1-token prompt and the repeated pair (1 and 2 tokens) are spread over the ranks.
        assert sorted(answer["routed"]) == [1, 1, 1, 1, 3, 4], answer["routed"]
        assert answer["refused"] is not None and "max_tokens_per_rank=160" in answer["refused"]
        for got, ref in zip(answer["results"], want, strict=True):
            assert [s.tokens for s in got.sequences] == [s.tokens for s in ref.sequences]
            assert [s.stop_reason for s in got.sequences] == [s.stop_reason for s in ref.sequences]
            for gs, rs in zip(got.sequences, ref.sequences, strict=True):
                assert max(abs(a - b) for a, b in zip(gs.logprobs, rs.logprobs, strict=True)) <= 1e-10
                assert (gs.topk_logprobs is None) == (rs.topk_logprobs is None)
                for g_row, r_row in zip(gs.topk_logprobs or [], rs.topk_logprobs or [], strict=True):
                    assert [t for t, _ in g_row] == [t for t, _ in r_row] and len(g_row) == 3
                    assert _max_abs([v for _, v in g_row], [v for _, v in r_row]) <= 1e-10
            assert (got.prompt_alt_tokens is None) == (ref.prompt_alt_tokens is None)
            if ref.prompt_alt_tokens is not None:
                assert torch.equal(got.prompt_alt_tokens[0], ref.prompt_alt_tokens[0])
                assert got.prompt_alt_tokens[0].shape == (len(got.prompt_logprobs) - 1, 4)
                assert (got.prompt_alt_tokens[1] - ref.prompt_alt_tokens[1]).abs().max().item() <= 1e-10
            if ref.prompt_logprobs is None:
                assert got.prompt_logprobs is None
            else:
                assert _max_abs(got.prompt_logprobs, ref.prompt_logprobs) <= 1e-10
        assert [s.tokens for s in answer["again"][0].sequences] == [s.tokens for s in want[0].sequences]
