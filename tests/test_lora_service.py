"""LoRA runs through the real SDK against ``ringtune serve --cp 2`` (one server per module, float64).

``create_lora_training_client(base, rank=4)`` makes a LoRA run: ``get_info`` says so; forward_backward and
optim_step equal a single-process :class:`LoraTrainer` (same seed, hence the same initial adapters);
save_state / create-from-state restore adapters + moments; the sampler of a LoRA run samples from the
merged weights (its log-probs are the run's forward); a full fine-tuning run beside it still sees the
unchanged base.
"""

from __future__ import annotations

import httpx
import pytest
import tinker
import torch
from gateway_fixtures import tiny_model_dir
from test_gateway_workers import ADAM, engine_datums, sdk_datums

from ringtune.engine.lora_trainer import LoraTrainer
from ringtune.engine.trainer import Trainer
from ringtune.gateway.serve_process import ServeProcess
from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.lora import LoraModel, LoraSpec

API_KEY = "tml-lora"
BUDGET = 64
RANK, SEED = 4, 3
ADAM_SDK = tinker.AdamParams(learning_rate=1e-2, eps=1e-8)  # = test_gateway_workers.ADAM


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_serve")
    model_dir = tiny_model_dir(tmp / "models" / "tiny")
    args = ["--cp", "2", "--dtype", "float64", "--max-tokens-per-rank", str(BUDGET), "--linear-cp-mode", "chunkwise"]
    args += ["--collective-timeout", "20", "--lora-pass-runs", "8"]
    proc = ServeProcess(
        str(model_dir), checkpoint_root=tmp / "ckpt", log_path=tmp / "serve.log", api_key=API_KEY, extra_args=args
    )
    with proc:
        yield {"url": proc.url, "model_dir": model_dir, "root": tmp / "ckpt"}


def peft_logprobs(base_dir, adapter_dir, tokens: list[int]) -> torch.Tensor:
    """Log-probs of ``tokens[1:]`` by transformers + peft (base in float32, the adapter as written); checks
    that every adapter tensor loads (no missing or unexpected keys)."""
    import transformers
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig.from_pretrained(adapter_dir))
    loaded = set_peft_model_state_dict(model, load_file(adapter_dir / "adapter_model.safetensors"))
    assert loaded.unexpected_keys == [] and [k for k in loaded.missing_keys if "lora_" in k] == []
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([tokens])).logits[0].log_softmax(-1)
    return logp[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


def test_lora_run_through_the_sdk_at_cp2(server):
    base = str(server["model_dir"])
    direct = LoraTrainer(
        LoraModel(load_hf(base, dtype=torch.float64), LoraSpec(rank=RANK, seed=SEED)), None, max_tokens_per_rank=BUDGET
    )
    with tinker.ServiceClient(base_url=server["url"], api_key=API_KEY) as sc:
        tc = sc.create_lora_training_client(base, rank=RANK, seed=SEED).result()
        info = tc.get_info()
        assert info.is_lora is True and info.lora_rank == RANK
        for step in range(2):
            datums = sdk_datums(step)
            got = tc.forward_backward(datums, "cross_entropy").result()
            metrics = tc.optim_step(tinker.AdamParams(learning_rate=1e-2, eps=1e-8)).result().metrics
            want = direct.forward_backward(engine_datums(datums), "cross_entropy")
            want_metrics = direct.optim_step(ADAM)
            assert _close(got.metrics["loss:sum"], want.metrics["loss:sum"])  # float64 at CP 2 and CP 1
            assert _close(metrics["grad_norm:mean"], want_metrics["grad_norm:mean"]) and metrics["grad_norm:mean"] > 0
        run = tinker.RestClient(base_url=server["url"], api_key=API_KEY).get_training_run(tc.model_id).result()
        assert run.is_lora is True and run.lora_rank == RANK
        # Adapter-only training state: adapters + moments + step, restored into a new LoRA run of the same spec.
        state = tc.save_state("lora-two").result().path
        resumed = sc.create_training_client_from_state_with_optimizer(state).result()
        assert resumed.get_info().lora_rank == RANK
        for client in (tc, resumed):  # the next step from the same state is the same step
            client.forward_backward(sdk_datums(5), "cross_entropy").result()
        adam = tinker.AdamParams(learning_rate=1e-2, eps=1e-8)
        stepped = [c.optim_step(adam).result().metrics for c in (tc, resumed)]
        assert stepped[0]["step:max"] == stepped[1]["step:max"] == 3.0
        assert _close(stepped[1]["grad_norm:mean"], stepped[0]["grad_norm:mean"])
        direct.forward_backward(engine_datums(sdk_datums(5)), "cross_entropy")
        direct.optim_step(ADAM)
        probe = sdk_datums(7)
        want = direct.forward(engine_datums(probe), "cross_entropy").metrics["loss:sum"]
        for client in (tc, resumed):
            assert _close(client.forward(probe, "cross_entropy").result().metrics["loss:sum"], want)
        # Sampling from the LoRA run: the merged snapshot's greedy tokens and log-probs are the run's forward.
        sampler = tc.save_weights_and_get_sampling_client().result()
        params = tinker.SamplingParams(max_tokens=5, temperature=0.0, stop=[])
        for i in range(2):
            seq = sampler.sample(tinker.ModelInput.from_ints([1, 2, 3 + i]), 1, params).result(timeout=120).sequences[0]
            full = [1, 2, 3 + i, *seq.tokens]
            datum = tinker.Datum(
                model_input=tinker.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(full) - 1)},
            )
            lp = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
            assert torch.allclose(torch.tensor(seq.logprobs), lp[2:].float(), atol=1e-5), (i, seq.logprobs, lp)
        named = tc.save_weights_for_sampler("lora-export").result().path
        from_path = sc.create_sampling_client(model_path=named).result()
        lp_path = from_path.compute_logprobs(tinker.ModelInput.from_ints(full)).result(timeout=120)
        assert torch.allclose(torch.tensor(lp_path[1:]), lp.float(), atol=1e-5)
        # The export's PEFT adapter, loaded by peft onto the transformers base, gives the server's log-probs.
        export = server["root"] / tc.model_id / "sampler_weights" / "lora-export"
        peft_lp = peft_logprobs(server["model_dir"], export, full)
        assert float((peft_lp - lp.float()).abs().max()) <= 1e-4
        # A full fine-tuning run beside the LoRA runs: the shared base was not changed by them.
        full_ft = sc.create_lora_training_client(base, rank=0).result()
        assert full_ft.get_info().is_lora is False
        plain = Trainer(load_hf(base, dtype=torch.float64), None, max_tokens_per_rank=BUDGET)
        want_base = plain.forward(engine_datums(probe), "cross_entropy").metrics["loss:sum"]
        assert _close(full_ft.forward(probe, "cross_entropy").result().metrics["loss:sum"], want_base)
        fresh = sc.create_lora_training_client(base, rank=2, train_mlp=False).result()  # B = 0: the base itself
        assert _close(fresh.forward(probe, "cross_entropy").result().metrics["loss:sum"], want_base)
    health = httpx.get(f"{server['url']}/api/v1/healthz")
    assert health.status_code == 200, health.text


def test_lora_runs_share_a_pass_on_the_served_mesh(server):
    """Three LoRA runs' requests queued behind a long forward of a fourth run join one pass on the CP=2 mesh
    (the supervised backend, the command to both ranks); each run's loss and step equal a single-process
    LoraTrainer of its own (float64)."""
    base = str(server["model_dir"])
    seeds = (20, 21, 22)
    model = load_hf(base, dtype=torch.float64)
    with tinker.ServiceClient(base_url=server["url"], api_key=API_KEY) as sc:
        long = sc.create_lora_training_client(base, rank=RANK, seed=19).result()
        runs = [sc.create_lora_training_client(base, rank=RANK, seed=s).result() for s in seeds]
        busy = long.forward(sdk_datums(0, lens=(60,) * 24), "cross_entropy")  # the backend is busy a while
        pending = [
            (tc.forward_backward(sdk_datums(40 + i), "cross_entropy"), tc.optim_step(ADAM_SDK))
            for i, tc in enumerate(runs)
        ]
        busy.result(timeout=300)
        results = [(fb.result(timeout=300), step.result(timeout=300)) for fb, step in pending]
    assert max(fb.metrics.get("lora_pass_runs:max", 1.0) for fb, _ in results) >= 2.0
    for i, (seed, (fb, step)) in enumerate(zip(seeds, results, strict=True)):
        direct = LoraTrainer(LoraModel(model, LoraSpec(rank=RANK, seed=seed)), None, max_tokens_per_rank=BUDGET)
        want = direct.forward_backward(engine_datums(sdk_datums(40 + i)), "cross_entropy")
        want_step = direct.optim_step(ADAM)
        assert _close(fb.metrics["loss:sum"], want.metrics["loss:sum"]), (i, fb.metrics)
        assert _close(step.metrics["grad_norm:mean"], want_step["grad_norm:mean"]), i


def test_save_weights_external_downloads_through_signed_urls(server, tmp_path, monkeypatch):
    """SDK 0.38's download path: ``save_weights_external`` then ``RestClient.get_external_weights_urls`` (and the
    cookbook's ``weights.download``) fetch every file of the export over signed URLs, for a LoRA run (its PEFT
    adapter included) and a full fine-tuning run; a tampered or foreign signature is a 403, an encrypted export
    a user error."""
    import urllib.error
    import urllib.request

    from tinker_cookbook import weights

    with tinker.ServiceClient(base_url=server["url"], api_key=API_KEY) as sc:
        rest = tinker.RestClient(base_url=server["url"], api_key=API_KEY)
        lora = sc.create_lora_training_client(str(server["model_dir"]), rank=RANK, seed=SEED).result()
        full = sc.create_lora_training_client(str(server["model_dir"]), rank=0).result()
        for tc, expect in ((lora, {"adapter_model.safetensors", "adapter_config.json"}), (full, set())):
            tc.forward_backward(sdk_datums(1), "cross_entropy").result()
            tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
            path = tc.save_weights_external("ext").result().path
            assert path == f"tinker://{tc.model_id}/external_weights/ext"
            listed = {c.checkpoint_id: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
            assert listed["external_weights/ext"].checkpoint_type == "external"
            response = rest.get_external_weights_urls(path).result()
            on_disk = server["root"] / tc.model_id / "external_weights" / "ext"
            assert set(response.urls) == {p.name for p in on_disk.iterdir() if p.is_file()}
            assert {"config.json", "model.safetensors"} | expect <= set(response.urls)
            for name, url in response.urls.items():
                assert urllib.request.urlopen(url).read() == (on_disk / name).read_bytes()  # no API key needed
            bad = response.urls["config.json"].replace("sig=", "sig=0")
            with pytest.raises(urllib.error.HTTPError, match="403"):
                urllib.request.urlopen(bad)
            other = response.urls["config.json"].replace("/config.json?", "/model.safetensors?")
            with pytest.raises(urllib.error.HTTPError, match="403"):
                urllib.request.urlopen(other)  # a URL names one file
        monkeypatch.setenv("TINKER_API_KEY", API_KEY)
        out = weights.download(tinker_path=path, output_dir=str(tmp_path / "dl"), base_url=server["url"])
        assert (tmp_path / "dl" / "model.safetensors").read_bytes() == (on_disk / "model.safetensors").read_bytes()
        assert out == str(tmp_path / "dl")
        with pytest.raises(tinker.RequestFailedError, match="age_encryption_recipients"):
            full.save_weights_external("enc", age_encryption_recipients=["age1xyz"]).result()
