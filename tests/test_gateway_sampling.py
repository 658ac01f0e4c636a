"""Sampling through the gateway with the real SDK: sessions from the base model, a named export and the
current weights; log-probs on-policy with the trainer; compute_logprobs; seeds; concurrency; prompt alt tokens;
bad parameters.

One gateway (a LocalBackend over a tiny random Qwen3.5, float32, decoding in 1 ms turns) serves the module.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import tinker
import torch
from gateway_fixtures import API_KEY, MODEL_NAME, start_gateway, tiny_model_dir
from tinker.proto import tinker_public_pb2 as pb

from ringtune.models.checkpoints.hf import load_hf
from ringtune.sample import SamplingParams, generate

PROMPT = [3, 17, 42, 8, 5]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("gateway-sampling")
    model_dir = tiny_model_dir(root / "models" / "tiny")
    # A 1 ms decode slice: every generation here runs in turns of about one step (the results must not change).
    server = start_gateway(root / "checkpoints", model_dir, max_live_runs=8, sample_slice_s=0.001)
    yield {"url": server.url, "model_dir": model_dir, "server": server}
    server.stop()


@pytest.fixture(scope="module")
def clients(gateway):
    with tinker.ServiceClient(base_url=gateway["url"], api_key=API_KEY) as sc:
        tc = sc.create_lora_training_client(MODEL_NAME, rank=0).result()
        yield sc, tc


def train_one_step(tc, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    data = [
        tinker.Datum(
            model_input=tinker.ModelInput.from_ints(torch.randint(0, 90, (9,), generator=gen).tolist()),
            loss_fn_inputs={"target_tokens": torch.randint(0, 90, (9,), generator=gen).tolist(), "weights": [1.0] * 9},
        )
    ]
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(tinker.AdamParams(learning_rate=5e-2)).result()


def test_on_policy_sampler_and_trainer_agree(clients):
    """Sample from the current weights, then forward the samples on the trainer: the same log-probs."""
    _, tc = clients
    train_one_step(tc, 0)
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = tinker.SamplingParams(max_tokens=12, temperature=1.0, seed=5, stop=[])
    result = sampler.sample(tinker.ModelInput.from_ints(PROMPT), num_samples=3, sampling_params=params).result()
    assert len(result.sequences) == 3
    kl_terms = []
    for seq in result.sequences:
        assert len(seq.tokens) == 12 and len(seq.logprobs) == 12 and seq.stop_reason == "length"
        full = PROMPT + seq.tokens
        datum = tinker.Datum(
            model_input=tinker.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(full) - 1)},
        )
        trainer_lp = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
        sampler_lp = torch.tensor(seq.logprobs)
        kl_terms.append(sampler_lp - trainer_lp[len(PROMPT) - 1 :])
    # KL(sampler || trainer) estimated on the sampled tokens: both sides run the float32 model on the same
    # weights (decode with caches vs the packed forward), so only summation order differs.
    kl = torch.cat(kl_terms).mean().abs().item()
    assert kl <= 1e-6, kl
    assert torch.cat(kl_terms).abs().max().item() <= 1e-4


def test_compute_logprobs_equals_the_trainer_forward(clients):
    _, tc = clients
    sampler = tc.save_weights_and_get_sampling_client().result()
    got = sampler.compute_logprobs(tinker.ModelInput.from_ints(PROMPT)).result()
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [0.0] * (len(PROMPT) - 1)},
    )
    want = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    assert got[0] is None and len(got) == len(PROMPT)
    assert torch.allclose(torch.tensor(got[1:]), want, atol=1e-5)
    # Only the last 2 scored (the SDK checks that nothing before them is); they equal the full call's.
    tail = sampler.compute_logprobs(tinker.ModelInput.from_ints(PROMPT), prompt_logprobs_last_n=2).result()
    assert tail[:-2] == [None] * (len(PROMPT) - 2) and tail[-2:] == got[-2:]


def test_named_export_base_model_seeds_and_rest(gateway, clients):
    sc, tc = clients
    path = tc.save_weights_for_sampler("after-step").result().path
    named = sc.create_sampling_client(model_path=path).result()
    ephemeral = tc.save_weights_and_get_sampling_client().result()
    greedy = tinker.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
    a = named.sample(tinker.ModelInput.from_ints(PROMPT), 1, greedy).result().sequences[0].tokens
    b = ephemeral.sample(tinker.ModelInput.from_ints(PROMPT), 1, greedy).result().sequences[0].tokens
    assert a == b  # the export and the in-memory snapshot hold the same weights
    base = sc.create_sampling_client(base_model=MODEL_NAME).result()
    seeded = tinker.SamplingParams(max_tokens=8, temperature=1.0, seed=123, stop=[])
    one = base.sample(tinker.ModelInput.from_ints(PROMPT), 2, seeded).result()
    two = base.sample(tinker.ModelInput.from_ints(PROMPT), 2, seeded).result()
    assert [s.tokens for s in one.sequences] == [s.tokens for s in two.sequences]
    made = _raw_sampler(gateway, model_path=path)
    response = httpx.get(f"{gateway['url']}/api/v1/samplers/{made}", headers={"X-API-Key": API_KEY})
    assert response.status_code == 200 and response.json()["model_path"] == path, response.text
    assert response.json()["base_model"] == MODEL_NAME


def test_concurrent_requests_all_complete(clients):
    _, tc = clients
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = tinker.SamplingParams(max_tokens=6, temperature=0.7, stop=[])
    futures = [sampler.sample(tinker.ModelInput.from_ints(PROMPT[: 1 + i % 5]), 1, params) for i in range(24)]
    results = [f.result(timeout=120) for f in futures]
    assert all(len(r.sequences[0].tokens) == 6 for r in results)


def test_a_long_generation_lets_short_requests_through(gateway):
    """A generation of the whole served context decodes in turns (``sample_slice_s``): a short request of
    another client that arrives with it is answered after one turn, long before the long one; the long one's
    tokens are those of one uninterrupted greedy decode."""
    service = gateway["server"].service
    context = service.backend.info().context_length
    prompt = tinker.ModelInput.from_ints(PROMPT)
    long_params = tinker.SamplingParams(max_tokens=context - len(PROMPT), temperature=0.0, stop=[])
    with tinker.ServiceClient(base_url=gateway["url"], api_key=API_KEY) as sc:
        long_client = sc.create_sampling_client(base_model=MODEL_NAME).result()
        short_client = sc.create_sampling_client(base_model=MODEL_NAME).result()
        since = service.futures.clock()
        gate = threading.Event()
        service.executor.submit_for("test-gate", gate.wait, 60)  # hold the backend thread until both arrived
        try:
            long = long_client.sample(prompt, 1, long_params)
            short = short_client.sample(prompt, 1, tinker.SamplingParams(max_tokens=2, temperature=0.0, stop=[]))
            deadline = time.monotonic() + 60
            while service.futures.unsettled(since) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            gate.set()
        assert len(short.result(timeout=120).sequences[0].tokens) == 2
        tokens = long.result(timeout=300).sequences[0].tokens
    finished = [pb.SampleResponse.FromString(outcome.body) for _, outcome in service.futures.finished("sample", since)]
    assert [len(r.sequences[0].tokens) // 4 for r in finished] == [2, context - len(PROMPT)]  # int32: 4 bytes each
    model = load_hf(gateway["model_dir"], dtype=torch.float32)
    want = generate(model, [PROMPT], SamplingParams(max_tokens=context - len(PROMPT), temperature=0.0, stop=[]))
    assert tokens == want[0].sequences[0].tokens


def test_topk_sample_logprobs_through_the_sdk(clients):
    """``topk_sample_logprobs=3``: per generated token 3 ``(id, logprob)`` best first, the sampled token's
    log-prob among them exactly when listed (same float32 value) and at most the 3rd otherwise."""
    sc, _ = clients
    sampler = sc.create_sampling_client(base_model=MODEL_NAME).result()
    params = tinker.SamplingParams(max_tokens=7, temperature=0.8, seed=11, stop=[])
    prompt = tinker.ModelInput.from_ints(PROMPT)
    result = sampler.sample(prompt, 2, params, topk_sample_logprobs=3).result()
    assert len(result.sequences) == 2
    for seq in result.sequences:
        assert len(seq.topk_logprobs) == len(seq.tokens) == len(seq.logprobs) == 7
        for token, lp, entry in zip(seq.tokens, seq.logprobs, seq.topk_logprobs, strict=True):
            assert len(entry) == 3 and len({t for t, _ in entry}) == 3
            values = [v for _, v in entry]
            assert values == sorted(values, reverse=True) and all(v <= 0.0 for v in values)
            assert dict(entry)[token] == lp if token in dict(entry) else lp <= values[-1]
    plain = sampler.sample(prompt, 2, params).result()
    assert [s.tokens for s in plain.sequences] == [s.tokens for s in result.sequences]
    assert all(s.topk_logprobs is None for s in plain.sequences)


BAD_SAMPLING = {
    "temperature_negative": ({"sampling_params": {"max_tokens": 4, "temperature": -1.0}}, "temperature"),
    "temperature_nan": ({"sampling_params": {"max_tokens": 4, "temperature": "nan"}}, "temperature"),
    "top_p_zero": ({"sampling_params": {"max_tokens": 4, "top_p": 0.0}}, "top_p"),
    "top_k_zero": ({"sampling_params": {"max_tokens": 4, "top_k": 0}}, "top_k"),
    "max_tokens_zero": ({"sampling_params": {"max_tokens": 0}}, "max_tokens"),
    "max_tokens_huge": ({"sampling_params": {"max_tokens": 10**9}}, "max_tokens"),
    "seed_string": ({"sampling_params": {"max_tokens": 4, "seed": "x"}}, "seed"),
    "stop_mixed": ({"sampling_params": {"max_tokens": 4, "stop": ["a", 3]}}, "stop"),
    "unknown_param": ({"sampling_params": {"max_tokens": 4, "beam": 2}}, "beam"),
    "num_samples_zero": ({"num_samples": 0}, "num_samples"),
    "num_samples_bool": ({"num_samples": True}, "num_samples"),
    "prompt_out_of_vocab": ({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 10**6]}]}}, "tokens[1]"),
    "prompt_empty": ({"prompt": {"chunks": []}}, "prompt.chunks"),
    "prompt_image": ({"prompt": {"chunks": [{"type": "image", "data": "", "format": "png"}]}}, "image"),
    "topk_sample_negative": ({"topk_sample_logprobs": -1}, "topk_sample_logprobs=-1 must be an int in [0, 100]"),
    "topk_sample_too_many": ({"topk_sample_logprobs": 101}, "topk_sample_logprobs=101 must be an int in [0, 100]"),
    "topk_prompt_too_many": ({"topk_prompt_logprobs": 10**6}, "topk_prompt_logprobs"),
    "alt_tokens_too_many": ({"prompt_alt_tokens_k": 101}, "prompt_alt_tokens_k=101 must be an int in [0, 100]"),
    "alt_tokens_float": ({"prompt_alt_tokens_k": 2.5}, "prompt_alt_tokens_k=2.5"),
    "unknown_session": ({"sampling_session_id": "nope"}, "sampling_session_id"),
    "last_n_over_prompt": ({"prompt_logprobs": True, "prompt_logprobs_last_n": 5}, "prompt_logprobs_last_n=5"),
    "last_n_without_prompt_logprobs": ({"prompt_logprobs_last_n": 2}, "needs prompt_logprobs=true"),
    "record_stability_info_not_bool": ({"record_stability_info": "yes"}, "record_stability_info='yes'"),
    "targets_float": (
        {"target_prompt_logprobs": {"data": [1.0] * 4, "dtype": "float32", "shape": [4, 1]}},
        "target_prompt_logprobs.dtype='float32'",
    ),
    "targets_rows": (
        {"target_prompt_logprobs": {"data": [1] * 5, "dtype": "int64", "shape": [5, 1]}},
        "len(prompt) - 1 = 4",
    ),
    "targets_k_over_cap": (
        {"target_prompt_logprobs": {"data": [1] * 4 * 129, "dtype": "int64", "shape": [4, 129]}},
        "K <= 128",
    ),
    "targets_out_of_vocab": (
        {"target_prompt_logprobs": {"data": [1, 2, 10**6, 3], "dtype": "int64", "shape": [4, 1]}},
        "token id 1000000",
    ),
    "targets_bad_csr": (
        {
            "target_prompt_logprobs": {
                "data": [3],
                "dtype": "int64",
                "shape": [4, 2],
                "sparse_crow_indices": [0, 1, 1, 1],
                "sparse_col_indices": [0],
            }
        },
        "sparse_crow_indices",
    ),
}


def _raw_sampler(gateway, **source: str) -> str:
    """A sampling session made over raw HTTP (create_session, then create_sampling_session)."""
    headers = {"X-API-Key": API_KEY}
    session = httpx.post(f"{gateway['url']}/api/v1/create_session", json={"tags": []}, headers=headers).json()
    body = {"session_id": session["session_id"], "sampling_session_seq_id": 0, **source}
    response = httpx.post(f"{gateway['url']}/api/v1/create_sampling_session", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["sampling_session_id"]


@pytest.fixture(scope="module")
def raw_sampler(gateway) -> str:
    return _raw_sampler(gateway, base_model=MODEL_NAME)


@pytest.mark.parametrize("case", sorted(BAD_SAMPLING))
def test_bad_sampling_parameters_are_user_errors(gateway, raw_sampler, case):
    body = {
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": 4},
        "sampling_session_id": raw_sampler,
        "seq_id": 10_000 + sorted(BAD_SAMPLING).index(case),
        "type": "sample",
    }
    patch, needle = BAD_SAMPLING[case]
    body.update(patch)
    response = httpx.post(f"{gateway['url']}/api/v1/asample", json=body, headers={"X-API-Key": API_KEY})
    assert 400 <= response.status_code < 500 and response.status_code not in (402, 409), response.text
    assert needle in response.json()["error"], response.text
    assert httpx.get(f"{gateway['url']}/api/v1/healthz").status_code == 200


def test_raw_sample_and_bad_session_sources(gateway, raw_sampler):
    headers = {"X-API-Key": API_KEY}
    body = {
        "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": 3, "temperature": 0.0, "stop": []},
        "sampling_session_id": raw_sampler,
        "seq_id": 1,
        "type": "sample",
    }
    first = httpx.post(f"{gateway['url']}/api/v1/asample", json=body, headers=headers).json()
    again = httpx.post(f"{gateway['url']}/api/v1/asample", json=body, headers=headers).json()
    assert first == again and len(first["sample_sequence_ids"]) == 2  # a resubmit gets the same future
    session = httpx.post(f"{gateway['url']}/api/v1/create_session", json={}, headers=headers).json()["session_id"]
    for source, needle in (
        ({"model_path": "tinker://nope/sampler_weights/x"}, "nope"),
        ({"model_path": "/etc/passwd"}, "tinker path"),
        ({"base_model": "other/model"}, "other/model"),
        ({}, "needs base_model, model_path or both"),
    ):
        body = {"session_id": session, "sampling_session_seq_id": 1, **source}
        response = httpx.post(f"{gateway['url']}/api/v1/create_sampling_session", json=body, headers=headers)
        assert 400 <= response.status_code < 500, response.text
        assert needle in response.json()["error"], response.text


def test_finishing_the_client_session_frees_its_samplers(gateway):
    headers = {"X-API-Key": API_KEY}
    session = httpx.post(f"{gateway['url']}/api/v1/create_session", json={"tags": []}, headers=headers).json()
    body = {"session_id": session["session_id"], "sampling_session_seq_id": 0, "base_model": MODEL_NAME}
    created = httpx.post(f"{gateway['url']}/api/v1/create_sampling_session", json=body, headers=headers, timeout=60)
    sampler_id = created.json()["sampling_session_id"]
    request = {
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": 2},
        "sampling_session_id": sampler_id,
        "type": "sample",
    }
    assert httpx.post(f"{gateway['url']}/api/v1/asample", json=request, headers=headers).status_code == 200
    finish = {"reason": {"type": "success"}}
    url = f"{gateway['url']}/api/v1/sessions/{session['session_id']}/finish"
    assert httpx.post(url, json=finish, headers=headers).status_code == 200
    response = httpx.post(f"{gateway['url']}/api/v1/asample", json=request, headers=headers)
    assert 400 <= response.status_code < 500 and "no such sampling session" in response.json()["error"]


def test_target_prompt_logprobs_dense_and_sparse_equal_the_trainer(clients):
    """K candidate ids per prompt position (the decisions recipe's call): log-probs of the trainer's [N, K]
    forward at every asked cell, 0.0 elsewhere; a sparse request gets a sparse answer with its indices."""
    _, tc = clients
    sampler = tc.save_weights_and_get_sampling_client().result()
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 90, (12,), generator=gen).tolist()
    ids = torch.randint(0, 90, (len(prompt) - 1, 3), generator=gen)
    ids[2, 1] = ids[5, 0] = -1
    asked = ids >= 0
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints(prompt[:-1]),
        loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_torch(ids.clamp(min=0)),
            "weights": tinker.TensorData.from_torch(torch.zeros(ids.shape)),
        },
    )
    want = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    params = tinker.SamplingParams(max_tokens=1)
    dense = sampler.sample(
        tinker.ModelInput.from_ints(prompt), 1, params, target_prompt_logprobs=tinker.TensorData.from_torch(ids)
    ).result()
    got = dense.target_prompt_logprobs.to_torch()
    assert got.shape == ids.shape and dense.target_prompt_logprobs.sparse_crow_indices is None
    assert torch.allclose(got[asked], want[asked].float(), atol=1e-5) and (got[~asked] == 0).all()
    one_row = torch.full_like(ids, -1)
    one_row[7] = ids[7]  # only the answer position asks, as in tinker_cookbook.recipes.decisions
    sparse = sampler.sample(
        tinker.ModelInput.from_ints(prompt),
        1,
        params,
        target_prompt_logprobs=tinker.TensorData.from_torch_sparse(one_row, pad_value=-1),
    ).result()
    assert sparse.target_prompt_logprobs.sparse_crow_indices is not None
    got = sparse.target_prompt_logprobs.to_torch()
    assert torch.allclose(got[7], want[7].float(), atol=1e-5) and (got[torch.arange(11) != 7] == 0).all()


def test_prompt_alt_tokens_through_the_sdk(clients):
    """``prompt_alt_tokens_k=4``: [len(prompt) - 1, 4] draws and their log-probs, which are the trainer's
    log-probs of those ids at those positions (asked back as target_prompt_logprobs); the seed fixes them."""
    _, tc = clients
    sampler = tc.save_weights_and_get_sampling_client().result()
    gen = torch.Generator().manual_seed(9)
    prompt = tinker.ModelInput.from_ints(torch.randint(0, 90, (14,), generator=gen).tolist())
    params = tinker.SamplingParams(max_tokens=3, temperature=1.0, seed=21, stop=[])
    result = sampler.sample(prompt, 1, params, prompt_alt_tokens_k=4).result()
    ids = result.prompt_alt_tokens.tokens.to_torch()
    lps = result.prompt_alt_tokens.logprobs.to_torch()
    assert ids.shape == lps.shape == (13, 4) and ids.dtype == torch.int64 and lps.dtype == torch.float32
    assert ids.unique().numel() > 4 and bool((lps <= 0).all())
    again = sampler.sample(
        prompt, 1, params, prompt_alt_tokens_k=4, target_prompt_logprobs=tinker.TensorData.from_torch(ids)
    )
    again = again.result()
    assert torch.equal(again.prompt_alt_tokens.tokens.to_torch(), ids)  # same seed, same draws
    assert torch.allclose(again.target_prompt_logprobs.to_torch(), lps, atol=1e-6)
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints(prompt.to_ints()[:-1]),
        loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_torch(ids),
            "weights": tinker.TensorData.from_torch(torch.zeros(ids.shape)),
        },
    )
    trainer = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    assert torch.allclose(trainer.float(), lps, atol=1e-5)  # float32 prefill vs packed forward: ~1e-6
    other = sampler.sample(prompt, 1, tinker.SamplingParams(max_tokens=3, seed=22, stop=[]), prompt_alt_tokens_k=4)
    assert not torch.equal(other.result().prompt_alt_tokens.tokens.to_torch(), ids)
    assert sampler.sample(prompt, 1, params).result().prompt_alt_tokens is None


def test_routes_answered_on_the_backend_thread_refuse_during_a_drain(gateway, tmp_path):
    """After SIGTERM's drain began (``GatewayService.drain``), a route that would wait on the backend thread
    (create_sampling_session, the served probe) answers a JSON 503 ``category: server`` at once, never a 500."""
    server = start_gateway(tmp_path / "checkpoints", gateway["model_dir"])
    try:
        http = httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": API_KEY}, timeout=30)
        session = http.post("create_session", json={"tags": []}).json()["session_id"]
        server.service.drain()
        body = {"session_id": session, "sampling_session_seq_id": 0, "base_model": MODEL_NAME}
        for route, payload in (("create_sampling_session", body), ("ringtune/probe", {"name": "ring_accumulation"})):
            response = http.post(route, json=payload)
            assert response.status_code == 503, (route, response.text)
            assert response.json()["category"] == "server" and "shutting down" in response.json()["error"]
    finally:
        server.stop()
