"""A ``ringtune serve --cp 2`` that stays up: idle, with a stopped rank, and what a client sees when one dies.

One server per module (a subprocess; float64 tiny model; the real SDK over 127.0.0.1), tests in this order:

1. idle for :data:`IDLE_S` seconds right after start (the old liveness killed it after 10 s): healthz answers
   200 every second, then a forward_backward works;
2. ``max_tokens`` that does not fit the served context beside the prompt: a JSON 400, ``category: user``,
   naming both;
3. the worker rank SIGSTOPped for :data:`STOP_S` seconds (longer than the old 10 s) with a forward_backward
   in flight: healthz stays 200, and after SIGCONT the request completes with the same result as before the
   stop (bit for bit: the same computation on unchanged weights);
4. the worker rank SIGKILLed (``--max-restarts 0``: no healing here): the request in flight fails with a
   ``server`` error naming the dead rank within seconds (never a hang), healthz 503, a later request fails the
   same way.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import tinker
import torch
from gateway_fixtures import tiny_model_dir
from tinker.types import RequestErrorCategory

from ringtune.gateway.serve_process import ServeProcess, worker_pids

API_KEY = "tml-liveness"
CONTEXT = 96
IDLE_S = 62.0
STOP_S = 15.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("liveness")
    model_dir = tiny_model_dir(tmp / "models" / "tiny")
    args = ["--cp", "2", "--dtype", "float64", "--context-length", str(CONTEXT), "--linear-cp-mode", "chunkwise"]
    args += ["--collective-timeout", "60", "--max-restarts", "0"]
    proc = ServeProcess(
        str(model_dir), checkpoint_root=tmp / "ckpt", log_path=tmp / "serve.log", api_key=API_KEY, extra_args=args
    )
    with proc:
        yield {"url": proc.url, "pid": proc.proc.pid, "model": str(model_dir), "log": proc.log_tail}


def _worker_pid(server_pid: int) -> int:
    """The one spawned worker rank of a CP=2 server (rank 0 is the server process)."""
    workers = worker_pids(server_pid)
    assert len(workers) == 1, workers
    return workers[0]


def _datums(seed: int, lens: tuple[int, ...]) -> list[tinker.Datum]:
    gen = torch.Generator().manual_seed(seed)
    return [
        tinker.Datum(
            model_input=tinker.ModelInput.from_ints(torch.randint(0, 90, (n,), generator=gen).tolist()),
            loss_fn_inputs={
                "target_tokens": torch.randint(0, 90, (n,), generator=gen).tolist(),
                "weights": torch.rand(n, generator=gen).tolist(),
            },
        )
        for n in lens
    ]


def _health(server) -> httpx.Response:
    return httpx.get(f"{server['url']}/api/v1/healthz", timeout=10)


def _logprobs(result) -> list[torch.Tensor]:
    return [out["logprobs"].to_torch() for out in result.loss_fn_outputs]


def test_an_idle_server_stays_up_then_serves(server):
    codes = []
    end = time.monotonic() + IDLE_S
    while time.monotonic() < end:
        codes.append(_health(server).status_code)
        time.sleep(1.0)
    assert set(codes) == {200}, f"{codes}\n{server['log']()}"
    with tinker.ServiceClient(base_url=server["url"], api_key=API_KEY) as sc:
        tc = sc.create_lora_training_client(server["model"], rank=0).result()
        result = tc.forward_backward(_datums(1, (9, 30)), "cross_entropy").result(timeout=120)
    assert len(result.loss_fn_outputs) == 2


def test_max_tokens_beyond_the_context_is_a_user_error(server):
    caps = httpx.get(f"{server['url']}/api/v1/get_server_capabilities", headers={"X-API-Key": API_KEY}).json()
    context = caps["supported_models"][0]["max_context_length"]  # the served one (the budget rounds it up)
    assert context >= CONTEXT
    prompt = tinker.ModelInput.from_ints(list(range(12)))
    with tinker.ServiceClient(base_url=server["url"], api_key=API_KEY) as sc:
        sampler = sc.create_sampling_client(base_model=server["model"]).result()
        with pytest.raises(tinker.BadRequestError) as info:  # refused when it arrives: a JSON 400
            sampler.sample(prompt, 1, tinker.SamplingParams(max_tokens=context - 11, stop=[])).result(timeout=60)
        fits = sampler.sample(prompt, 1, tinker.SamplingParams(max_tokens=context - 12, stop=[])).result(timeout=120)
    assert info.value.body["category"] == "user", info.value.body
    message = str(info.value)
    assert f"max_tokens={context - 11}" in message and f"context length {context}" in message, message
    assert len(fits.sequences[0].tokens) == context - 12


def test_a_stopped_worker_is_waited_for(server):
    data = _datums(2, (5, 17, 40, 11, 30))
    worker = _worker_pid(server["pid"])
    with tinker.ServiceClient(base_url=server["url"], api_key=API_KEY) as sc:
        tc = sc.create_lora_training_client(server["model"], rank=0).result()
        before = tc.forward_backward(data, "cross_entropy").result(timeout=120)
        os.kill(worker, signal.SIGSTOP)
        try:
            future = tc.forward_backward(data, "cross_entropy")
            codes = []
            end = time.monotonic() + STOP_S
            while time.monotonic() < end:
                codes.append(_health(server).status_code)
                time.sleep(1.0)
        finally:
            os.kill(worker, signal.SIGCONT)
        during = future.result(timeout=120)
    assert set(codes) == {200}, codes  # a stopped rank is slow, not dead
    for a, b in zip(_logprobs(before), _logprobs(during), strict=True):
        assert torch.equal(a, b)
    assert during.metrics == before.metrics
    assert _health(server).status_code == 200


def test_a_killed_worker_fails_requests_with_a_server_error(server):
    worker = _worker_pid(server["pid"])
    with tinker.ServiceClient(base_url=server["url"], api_key=API_KEY) as sc:
        tc = sc.create_lora_training_client(server["model"], rank=0).result()
        os.kill(worker, signal.SIGSTOP)  # the request is surely in flight when the rank dies
        future = tc.forward_backward(_datums(3, (30, 30, 30)), "cross_entropy")
        time.sleep(1.0)
        start = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(tinker.RequestFailedError) as info:
            future.result(timeout=60)
        failed_after = time.monotonic() - start
        assert info.value.category == RequestErrorCategory.Server, info.value
        health = _health(server)
        with pytest.raises(tinker.RequestFailedError) as later:
            tc.forward_backward(_datums(4, (7,)), "cross_entropy").result(timeout=60)
    assert failed_after < 20, failed_after  # found by the OS at the next poll, not after a 60 s timeout
    assert "rank 1" in str(info.value), info.value
    assert health.status_code == 503, health.text
    assert later.value.category == RequestErrorCategory.Server, later.value
