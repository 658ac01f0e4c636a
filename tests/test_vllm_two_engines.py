"""``serve --sampler vllm`` with two engines through the unmodified tinker SDK: two tiny random Llama engines (CPU,
float32) behind one gateway; sampling sessions are placed on both; a SIGKILL of one (started without restarts)
fails its session's request with a ``server`` error while the other engine keeps serving; the killed engine's
session then moves to the survivor and samples the same greedy tokens; both process groups are gone at the end.

Skipped with the reason when the engine interpreter has no vLLM (``make test-vllm`` runs it). Two engines at
once (about 6 GiB, 30-60 s to start side by side on 2 cores).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
import tinker
from tinker.types import RequestErrorCategory
from vllm_fixtures import (
    API_KEY,
    MODEL_NAME,
    live_group_members,
    missing_engine_reason,
    start_vllm_gateway,
    test_engine,
    tiny_llama_dir,
)

pytestmark = pytest.mark.skipif(missing_engine_reason() is not None, reason=str(missing_engine_reason()))

PROMPT = tinker.ModelInput.from_ints([3, 17, 42, 8, 5, 60])
GREEDY = tinker.SamplingParams(max_tokens=6, temperature=0.0, stop=[])


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("vllm-two-engines")
    model_dir = tiny_llama_dir(root / "llama")
    engines = [test_engine(model_dir, root / f"engine-{i}.log", max_restarts=0) for i in range(2)]
    server = start_vllm_gateway(root / "checkpoints", model_dir, {MODEL_NAME: engines})
    try:
        with tinker.ServiceClient(base_url=server.url, api_key=API_KEY) as sc:
            yield {"sc": sc, "engines": engines, "sampler": server.service.engine_sampler}
    finally:
        pids = [e.process_id() for e in engines]
        server.stop()
        assert all(pid is not None and live_group_members(pid) == [] for pid in pids)  # no orphans


def _greedy(client) -> list[int]:
    return list(client.sample(PROMPT, 1, GREEDY).result().sequences[0].tokens)


def test_sessions_spread_and_one_engine_crash_leaves_the_other_serving(served):
    sc, engines, sampler = served["sc"], served["engines"], served["sampler"]
    clients = []
    for expected in (0, 1):  # base sessions go to the least loaded engine
        clients.append(sc.create_sampling_client(base_model=MODEL_NAME).result())
        newest = list(sampler.sessions.values())[-1]
        assert newest.slot.index == expected and newest.slot.engine is engines[expected]
    greedy = [_greedy(c) for c in clients]
    assert greedy[0] == greedy[1] and len(greedy[0]) == 6  # one base model on both engines

    os.killpg(engines[0].process_id(), signal.SIGKILL)
    with pytest.raises(tinker.RequestFailedError) as info:
        clients[0].sample(PROMPT, 2, tinker.SamplingParams(max_tokens=100, temperature=1.0, stop=[])).result()
    assert info.value.category == RequestErrorCategory.Server, info.value
    assert _greedy(clients[1]) == greedy[1]  # the other engine kept serving
    deadline = time.monotonic() + 60
    while not engines[0].gave_up:  # max_restarts=0: its monitor gives it up
        assert time.monotonic() < deadline, engines[0].state
        time.sleep(0.5)
    assert _greedy(clients[0]) == greedy[0]  # its session moved to the surviving engine
    assert all(s.slot.engine is engines[1] for s in sampler.sessions.values())
    third = sc.create_sampling_client(base_model=MODEL_NAME).result()  # new sessions avoid the dead engine
    assert _greedy(third) == greedy[0] and list(sampler.sessions.values())[-1].slot.index == 1
