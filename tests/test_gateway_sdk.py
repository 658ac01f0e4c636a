"""The gateway driven by the real tinker 0.38 SDK over 127.0.0.1, compared with a direct Trainer call.

One gateway (a LocalBackend over a tiny random Qwen3.5, float32) serves the whole module. Every numeric
check is bit for bit: the gateway and the reference Trainer run the same float32 code on the same
weights and data in this process, and the wire carries float32 outputs and float64 metrics exactly.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import tinker
import torch
from gateway_fixtures import API_KEY, MAX_TOKENS_PER_RANK, MODEL_NAME, start_gateway, tiny_model_dir

from ringtune.engine.optimizer import AdamParams
from ringtune.engine.trainer import TrainDatum, Trainer
from ringtune.models.checkpoints.load import load_model

CHUNK = 4  # fwdbwd_max_chunk_len: requests of more datums are split by the SDK (and sent out of order)
ADAM = {"learning_rate": 3e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.01, "grad_clip_norm": 0.0}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("gateway-sdk")
    model_dir = tiny_model_dir(root / "models" / "tiny")
    server = start_gateway(root / "checkpoints", model_dir, fwdbwd_max_chunk_len=CHUNK, max_live_runs=8)
    yield {"url": server.url, "model_dir": model_dir, "root": root / "checkpoints", "server": server}
    server.stop()


def service_client(gateway) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=gateway["url"], api_key=API_KEY)


def reference(gateway) -> Trainer:
    """A Trainer on the same weights as a fresh run, built exactly as the LocalBackend builds one."""
    return Trainer(
        load_model(str(gateway["model_dir"]), dtype=torch.float32), None, max_tokens_per_rank=MAX_TOKENS_PER_RANK
    )


def make_data(seed: int, loss: str, *, k: int | None = None, sparse: bool = False, lengths=(3, 9, 17, 5)):
    """The same request as SDK datums (from torch tensors) and as engine TrainDatums (the same tensors)."""
    gen = torch.Generator().manual_seed(seed)
    sdk, engine = [], []
    for n in lengths:
        tokens = torch.randint(0, 96, (n,), generator=gen)
        if k is None:
            targets = torch.randint(0, 96, (n,), generator=gen)
        else:
            targets = torch.randint(1, 96, (n, k), generator=gen)
            if sparse:
                targets[:, 1:] = 0  # mostly zeros: the SDK sends CSR
        inputs: dict[str, torch.Tensor] = {"target_tokens": targets}
        if loss == "cross_entropy":
            weights = torch.rand(targets.shape, generator=gen) + 0.5
            if sparse:
                weights[:, 1:] = 0.0
            inputs["weights"] = weights
        else:
            inputs["logprobs"] = -3 * torch.rand(n, generator=gen)
            inputs["advantages"] = torch.randn(n, generator=gen)
            if loss == "gspo":
                inputs["sequence_ratio_mask"] = torch.ones(n)
        sdk.append(tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens.tolist()), loss_fn_inputs=dict(inputs)))
        engine.append(TrainDatum(tokens=tokens, inputs=inputs))
    return sdk, engine


def assert_same_outputs(sdk_out: tinker.ForwardBackwardOutput, ref_outputs, ref_metrics) -> None:
    assert len(sdk_out.loss_fn_outputs) == len(ref_outputs)
    for i, (got, want) in enumerate(zip(sdk_out.loss_fn_outputs, ref_outputs, strict=True)):
        for key in ("logprobs", "elementwise_loss"):
            expected = want[key].numpy().astype(np.float32)
            assert got[key].shape == list(expected.shape), (i, key)
            assert np.array_equal(got[key].to_numpy(), expected), (i, key)
    assert sdk_out.metrics["loss:sum"] == ref_metrics["loss:sum"]
    assert sdk_out.metrics["num_tokens:sum"] == ref_metrics["num_tokens:sum"]


LOSSES = [
    ("cross_entropy", None, {}),
    ("cross_entropy", None, {"k": 3}),
    ("cross_entropy", None, {"k": 3, "sparse": True}),
    ("importance_sampling", None, {}),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, {}),
    ("cispo", None, {}),
    ("dro", {"beta": 0.1}, {}),
    ("gspo", None, {}),
]


def test_handshake_info_and_tokenizer(gateway):
    with service_client(gateway) as sc:
        tc = sc.create_lora_training_client(MODEL_NAME, rank=0).result()
        info = tc.get_info()
        assert info.model_data.model_name == MODEL_NAME and info.is_lora is False
        assert info.model_data.tokenizer_id == str(gateway["model_dir"].resolve())
        tokenizer = tc.get_tokenizer()
        assert tokenizer.encode("w3 w17 w42", add_special_tokens=False) == [3, 17, 42]
        caps = tinker.RestClient(base_url=gateway["url"], api_key=API_KEY).get_server_capabilities().result()
        assert caps.supported_models[0].model_name == MODEL_NAME
        with pytest.raises(tinker.BadRequestError, match=r"lora_config\.rank=2000"):
            sc.create_lora_training_client(MODEL_NAME, rank=2000).result()
        with pytest.raises(tinker.BadRequestError, match="not served here"):
            sc.create_lora_training_client("other/model", rank=0).result()


def test_losses_and_steps_equal_a_direct_trainer(gateway):
    """forward, then forward_backward + optim_step (pipelined) for every loss, in lockstep with a Trainer."""
    ref = reference(gateway)
    with service_client(gateway) as sc:
        tc = sc.create_lora_training_client(MODEL_NAME, rank=0).result()
        sdk, engine = make_data(0, "cross_entropy")
        got = tc.forward(sdk, "cross_entropy").result()
        want = ref.forward(engine, "cross_entropy")
        assert_same_outputs(got, want.outputs, want.metrics)
        for step, (loss, config, shape) in enumerate(LOSSES):
            sdk, engine = make_data(step + 1, loss, **shape)
            fb = tc.forward_backward(sdk, loss, config)
            opt = tc.optim_step(tinker.AdamParams(**ADAM))
            want = ref.forward_backward(engine, loss, config)
            assert_same_outputs(fb.result(), want.outputs, want.metrics)
            want_opt = ref.optim_step(AdamParams(**ADAM))
            got_opt = opt.result().metrics
            assert got_opt["grad_norm:mean"] == want_opt["grad_norm:mean"], loss
            assert got_opt["step:max"] == step + 1
        sdk, engine = make_data(99, "cross_entropy")
        want = ref.forward(engine, "cross_entropy")
        assert_same_outputs(tc.forward(sdk, "cross_entropy").result(), want.outputs, want.metrics)


def test_chunked_request_equals_the_same_chunks_on_a_trainer(gateway):
    """10 datums go out as chunks of 4, 4, 2 (the first sent last); the gateway runs them in seq_id order."""
    ref = reference(gateway)
    lengths = (3, 9, 17, 5, 2, 11, 1, 6, 8, 4)
    with service_client(gateway) as sc:
        tc = sc.create_lora_training_client(MODEL_NAME, rank=0).result()
        sdk, engine = make_data(7, "importance_sampling", lengths=lengths)
        got = tc.forward_backward(sdk, "importance_sampling").result()
        outputs, loss = [], 0.0
        for start in range(0, len(engine), CHUNK):
            part = ref.forward_backward(engine[start : start + CHUNK], "importance_sampling")
            outputs += part.outputs
            loss += part.metrics["loss:sum"]
        assert_same_outputs(got, outputs, {"loss:sum": loss, "num_tokens:sum": float(sum(lengths))})
        got_opt = tc.optim_step(tinker.AdamParams(**ADAM)).result().metrics
        assert got_opt["grad_norm:mean"] == ref.optim_step(AdamParams(**ADAM))["grad_norm:mean"]


def test_forward_backward_custom(gateway):
    """The SDK's client-side custom loss: forward, torch loss on the log-probs, cross_entropy with -dC/dlp."""
    ref = reference(gateway)

    def custom(data, logprobs):
        loss = sum((lp.exp() * lp).sum() for lp in logprobs)
        return loss, {"entropy_like:sum": float(loss.detach())}

    with service_client(gateway) as sc:
        tc = sc.create_lora_training_client(MODEL_NAME, rank=0).result()
        sdk, engine = make_data(11, "cross_entropy")
        got = tc.forward_backward_custom(sdk, custom).result()
        forward = ref.forward(engine, "cross_entropy")
        lps = [o["logprobs"].to(torch.float32).clone().requires_grad_(True) for o in forward.outputs]
        loss, _ = custom(None, lps)
        loss.backward()
        weighted = [
            TrainDatum(d.tokens, {"target_tokens": d.inputs["target_tokens"], "weights": -lp.grad})
            for d, lp in zip(engine, lps, strict=True)
        ]
        surrogate = ref.forward_backward(weighted, "cross_entropy")
        assert got.metrics["loss:sum"] == float(loss.detach()) == got.metrics["entropy_like:sum"]
        assert got.metrics["surrogate_loss:sum"] == surrogate.metrics["loss:sum"]
        tc.optim_step(tinker.AdamParams(**ADAM)).result()
        ref.optim_step(AdamParams(**ADAM))
        sdk, engine = make_data(12, "cross_entropy")
        want = ref.forward(engine, "cross_entropy")
        assert_same_outputs(tc.forward(sdk, "cross_entropy").result(), want.outputs, want.metrics)


def test_save_state_and_resume_equal_an_uninterrupted_run(gateway):
    steps = [make_data(20 + i, "cross_entropy") for i in range(3)]
    probe, _ = make_data(30, "cross_entropy")
    with service_client(gateway) as sc:
        tc = sc.create_lora_training_client(MODEL_NAME, rank=0, user_metadata={"renderer_name": "role_colon"}).result()
        for i, (sdk, _) in enumerate(steps):
            tc.forward_backward(sdk, "cross_entropy")
            tc.optim_step(tinker.AdamParams(**ADAM))
            if i == 0:
                saved = tc.save_state("after-1").result().path
                at_save = tc.forward(probe, "cross_entropy").result()
        uninterrupted = tc.forward(probe, "cross_entropy").result()
        run_id = tc.model_id
    assert saved == f"tinker://{run_id}/weights/after-1"
    with service_client(gateway) as sc:  # a new session: the old one finished and its run was freed
        resumed = sc.create_training_client_from_state_with_optimizer(saved).result()
        assert resumed.get_info().model_data.model_name == MODEL_NAME
        for sdk, _ in steps[1:]:
            resumed.forward_backward(sdk, "cross_entropy")
            resumed.optim_step(tinker.AdamParams(**ADAM))
        again = resumed.forward(probe, "cross_entropy").result()
        assert again.metrics["loss:sum"] == uninterrupted.metrics["loss:sum"]
        gateway["saved"] = (saved, at_save.metrics["loss:sum"], probe)
        weights_only = sc.create_training_client_from_state(saved).result()
        fresh = weights_only.forward(probe, "cross_entropy").result()
        assert fresh.metrics["loss:sum"] == at_save.metrics["loss:sum"]
        rest = tinker.RestClient(base_url=gateway["url"], api_key=API_KEY)
        run = rest.get_training_run(resumed.model_id).result()
        assert run.user_metadata == {"renderer_name": "role_colon"}  # inherited from the checkpoint's run
        with pytest.raises(tinker.RequestFailedError):
            sc.create_training_client_from_state(f"tinker://{run_id}/weights/missing").result()


def test_sampler_weights_rest_and_finish(gateway):
    with service_client(gateway) as sc:
        tc = sc.create_lora_training_client(MODEL_NAME, rank=0, user_metadata={"k": "v"}).result()
        run_id = tc.model_id
        path = tc.save_weights_for_sampler("s0").result().path
        assert path == f"tinker://{run_id}/sampler_weights/s0"
        exported = load_model(str(gateway["root"] / run_id / "sampler_weights" / "s0"))
        base = load_model(str(gateway["model_dir"]))
        for (name, a), (_, b) in zip(exported.state_dict().items(), base.state_dict().items(), strict=True):
            assert torch.equal(a, b), name
        sampler = tc.save_weights_and_get_sampling_client()
        assert isinstance(sampler, tinker.SamplingClient)
        tc.save_state("w0").result()
        rest = tinker.RestClient(base_url=gateway["url"], api_key=API_KEY)
        runs = rest.list_training_runs(limit=100).result()
        assert run_id in [r.training_run_id for r in runs.training_runs]
        run = rest.get_training_run(run_id).result()
        assert run.user_metadata == {"k": "v"} and run.is_lora is False
        assert run.last_checkpoint.checkpoint_id == "weights/w0"
        checkpoints = rest.list_checkpoints(run_id).result().checkpoints
        assert sorted(c.checkpoint_id for c in checkpoints) == ["sampler_weights/s0", "weights/w0"]
        info = rest.get_weights_info_by_tinker_path(f"tinker://{run_id}/weights/w0").result()
        assert info.base_model == MODEL_NAME and info.is_lora is False
        rest.delete_checkpoint(run_id, "weights/w0").result()
        assert [c.checkpoint_id for c in rest.list_checkpoints(run_id).result().checkpoints] == ["sampler_weights/s0"]
        assert not (gateway["root"] / run_id / "weights" / "w0").exists()
    # the session finished: its run is freed (the backend drops it) but its record and checkpoints stay
    deadline = time.monotonic() + 10
    while run_id in gateway["server"].backend.trainers and time.monotonic() < deadline:
        time.sleep(0.05)
    assert run_id not in gateway["server"].backend.trainers
    rest = tinker.RestClient(base_url=gateway["url"], api_key=API_KEY)
    assert rest.get_training_run(run_id).result().training_run_id == run_id
    assert len(rest.list_checkpoints(run_id).result().checkpoints) == 1


def test_records_survive_a_restart(gateway):
    """A second gateway on the same checkpoint root lists the runs and resumes from their checkpoints."""
    saved, loss_at_save, probe = gateway["saved"]
    server = start_gateway(gateway["root"], gateway["model_dir"])
    try:
        rest = tinker.RestClient(base_url=server.url, api_key=API_KEY)
        run_id = saved.removeprefix("tinker://").split("/")[0]
        assert rest.get_training_run(run_id).result().user_metadata == {"renderer_name": "role_colon"}
        with tinker.ServiceClient(base_url=server.url, api_key=API_KEY) as sc:
            tc = sc.create_training_client_from_state_with_optimizer(saved).result()
            assert tc.forward(probe, "cross_entropy").result().metrics["loss:sum"] == loss_at_save
    finally:
        server.stop()
