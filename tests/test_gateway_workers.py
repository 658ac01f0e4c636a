"""``ringtune serve --cp 2``: the gateway on rank 0 of two worker ranks, driven by the real SDK.

One server per module (a subprocess, float64 so that CP=2 and CP=1 agree to ~1e-14 before the float32 wire):
its results equal a direct single-process Trainer's; save/resume works across ranks; then one worker rank is
SIGKILLed during a forward_backward: the SDK call fails with a server error within 60 s and healthz says so.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import tinker
import torch
from gateway_fixtures import tiny_model_dir
from tinker.types import RequestErrorCategory

from ringtune.engine.optimizer import AdamParams
from ringtune.engine.trainer import TrainDatum, Trainer
from ringtune.gateway.serve_process import ServeProcess
from ringtune.models.checkpoints.hf import load_hf

API_KEY = "tml-workers"
BUDGET = 64
ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("workers")
    model_dir = tiny_model_dir(tmp / "models" / "tiny")
    args = ["--cp", "2", "--dtype", "float64", "--max-tokens-per-rank", str(BUDGET), "--linear-cp-mode", "chunkwise"]
    args += ["--collective-timeout", "20", "--log-level", "info"]  # info: the per-operation log lines
    args += ["--max-restarts", "0"]  # a dead worker is not healed here (tests/test_supervisor.py heals)
    args += ["--sample-slice", "0.001"]  # generations decode in turns of ~1 step on both ranks (sample_more)
    proc = ServeProcess(
        str(model_dir), checkpoint_root=tmp / "ckpt", log_path=tmp / "serve.log", api_key=API_KEY, extra_args=args
    )
    with proc:
        yield {
            "url": proc.url,
            "proc": proc.proc,
            "model_dir": model_dir,
            "root": tmp / "ckpt",
            "log": tmp / "serve.log",
        }


def sdk_datums(seed: int, lens=(5, 17, 3, 11, 2, 9, 13, 30)) -> list[tinker.Datum]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lens:
        tokens = torch.randint(0, 90, (n,), generator=gen).tolist()
        targets = torch.randint(0, 90, (n,), generator=gen).tolist()
        weights = torch.rand(n, generator=gen).tolist()
        out.append(
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints(tokens),
                loss_fn_inputs={"target_tokens": targets, "weights": weights},
            )
        )
    return out


def engine_datums(datums: list[tinker.Datum]) -> list[TrainDatum]:
    return [
        TrainDatum(
            tokens=d.model_input.to_ints(),
            inputs={
                k: torch.tensor(v.tolist(), dtype=torch.float32 if k == "weights" else torch.int64)
                for k, v in d.loss_fn_inputs.items()
            },
        )
        for d in datums
    ]


def test_cp2_server_equals_a_single_process_trainer(server):
    direct = Trainer(load_hf(server["model_dir"], dtype=torch.float64), None, max_tokens_per_rank=BUDGET)
    with tinker.ServiceClient(base_url=server["url"], api_key=API_KEY) as sc:
        tc = sc.create_lora_training_client(str(server["model_dir"]), rank=0).result()
        for step in range(2):
            datums = sdk_datums(step)
            got = tc.forward_backward(datums, "cross_entropy").result()
            metrics = tc.optim_step(tinker.AdamParams(learning_rate=1e-2, eps=1e-8)).result().metrics
            want = direct.forward_backward(engine_datums(datums), "cross_entropy")
            want_metrics = direct.optim_step(ADAM)
            # float64 on both sides (CP=2 vs CP=1 differ by summation order, ~1e-14); logprobs cross the wire as
            # float32, so they agree to float32 rounding.
            assert abs(got.metrics["loss:sum"] - want.metrics["loss:sum"]) <= 1e-9 * abs(want.metrics["loss:sum"])
            for out, ref in zip(got.loss_fn_outputs, want.outputs, strict=True):
                assert torch.allclose(out["logprobs"].to_torch().double(), ref["logprobs"], rtol=1e-6, atol=1e-6)
            assert (
                abs(metrics["grad_norm:mean"] - want_metrics["grad_norm:mean"]) <= 1e-9 * want_metrics["grad_norm:mean"]
            )
        records = [
            json.loads(line) for line in (server["root"] / tc.model_id / "metrics.jsonl").read_text().splitlines()
        ]
        assert [r["op"] for r in records] == ["forward_backward", "optim_step"] * 2
        assert records[-1]["step:max"] == 2.0 and records[-1]["grad_norm:mean"] == metrics["grad_norm:mean"]
        assert f"op=optim_step model={tc.model_id}" in server["log"].read_text()
        state = tc.save_state("two-steps").result().path
        resumed = sc.create_training_client_from_state_with_optimizer(state).result()
        again = resumed.forward(sdk_datums(7), "cross_entropy").result().metrics["loss:sum"]
        want = direct.forward(engine_datums(sdk_datums(7)), "cross_entropy").metrics["loss:sum"]
        assert abs(again - want) <= 1e-9 * abs(want)
        bad = sdk_datums(8)
        bad[3] = tinker.Datum(model_input=bad[3].model_input, loss_fn_inputs={"target_tokens": [1] * 11})
        with pytest.raises(tinker.RequestFailedError):
            tc.forward_backward(bad, "cross_entropy").result()  # user error on every rank; the server goes on
        assert tc.forward(sdk_datums(9), "cross_entropy").result().metrics["num_tokens:sum"] == 90.0
        # Sampling at DP×CP = 1×2: requests are spread over both ranks; each samples on its own snapshot.
        sampler = tc.save_weights_and_get_sampling_client().result()
        params = tinker.SamplingParams(max_tokens=5, temperature=0.0, stop=[])
        futures = [sampler.sample(tinker.ModelInput.from_ints([1, 2, 3 + i]), 1, params) for i in range(6)]
        samples = [f.result(timeout=120).sequences[0] for f in futures]
        for i, seq in enumerate(samples):
            full = [1, 2, 3 + i, *seq.tokens]
            datum = tinker.Datum(
                model_input=tinker.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(full) - 1)},
            )
            lp = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
            assert torch.allclose(torch.tensor(seq.logprobs), lp[2:].float(), atol=1e-5), (i, seq.logprobs, lp)
        # A prompt longer than the per-rank budget (the default --mesh-prompt-tokens): compute_logprobs runs
        # through the CP=2 forward, zigzag-split like a training datum; equal to the trainer's forward.
        long_prompt = torch.randint(0, 90, (2 * BUDGET - 8,), generator=torch.Generator().manual_seed(3)).tolist()
        got = sampler.compute_logprobs(tinker.ModelInput.from_ints(long_prompt)).result(timeout=120)
        datum = tinker.Datum(
            model_input=tinker.ModelInput.from_ints(long_prompt[:-1]),
            loss_fn_inputs={"target_tokens": long_prompt[1:], "weights": [0.0] * (len(long_prompt) - 1)},
        )
        want = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
        assert got[0] is None and len(got) == len(long_prompt)
        assert torch.allclose(torch.tensor(got[1:]), want.float(), atol=1e-6)
        # A generation after that prompt: prefilled by both ranks (caches gathered), decoded by one; on-policy.
        params = tinker.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
        seq = sampler.sample(tinker.ModelInput.from_ints(long_prompt), 1, params).result(timeout=120).sequences[0]
        full = long_prompt + seq.tokens
        datum = tinker.Datum(
            model_input=tinker.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(full) - 1)},
        )
        lp = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
        assert len(seq.tokens) == 6
        assert torch.allclose(torch.tensor(seq.logprobs), lp[len(long_prompt) - 1 :].float(), atol=1e-6)
        # Prompt alt tokens of that prompt on both ranks, with no seed (the backend fixes one before the ranks
        # see the request): their log-probs are the trainer's log-probs of the drawn ids.
        plain = tinker.SamplingParams(max_tokens=1, stop=[])
        alt = sampler.sample(tinker.ModelInput.from_ints(long_prompt), 1, plain, prompt_alt_tokens_k=3).result(120)
        ids = alt.prompt_alt_tokens.tokens.to_torch()
        assert ids.shape == (len(long_prompt) - 1, 3) and ids.unique().numel() > 3
        datum = tinker.Datum(
            model_input=tinker.ModelInput.from_ints(long_prompt[:-1]),
            loss_fn_inputs={
                "target_tokens": tinker.TensorData.from_torch(ids),
                "weights": tinker.TensorData.from_torch(torch.zeros(ids.shape)),
            },
        )
        want = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
        assert torch.allclose(alt.prompt_alt_tokens.logprobs.to_torch(), want.float(), atol=1e-6)


def _worker_pids(pid: int) -> list[int]:
    """The server's worker-rank processes (spawned children running ``multiprocessing.spawn``)."""
    out = []
    for child in map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split()):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_text()
        except FileNotFoundError:
            continue
        if "spawn_main" in cmdline:
            out.append(child)
    return out


def test_sigkill_of_a_worker_fails_the_call_with_a_server_error(server):
    with tinker.ServiceClient(base_url=server["url"], api_key=API_KEY) as sc:
        tc = sc.create_lora_training_client(str(server["model_dir"]), rank=0).result()
        future = tc.forward_backward(sdk_datums(11, lens=(30,) * 40), "cross_entropy")
        time.sleep(0.5)
        workers = _worker_pids(server["proc"].pid)
        assert len(workers) == 1, workers  # CP=2: rank 0 is the server process, rank 1 a spawned worker
        start = time.monotonic()
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(tinker.RequestFailedError) as info:
            future.result(timeout=90)
        assert time.monotonic() - start < 60
        assert info.value.category == RequestErrorCategory.Server, info.value
    health = httpx.get(f"{server['url']}/api/v1/healthz")
    assert health.status_code == 503, health.text
