"""LoRA runs' forward_backward requests joined into one pass over the shared base, through the real SDK.

One gateway (LocalBackend, tiny random Qwen3.5, float64) serves the module. With the backend thread held
until every client's requests are queued, three LoRA runs' forward_backward calls run as one pass
(``lora_pass_runs:max`` = 3), and each run's loss, log-probs and next forward (after its own optim_step)
equal those of a twin run that stepped alone; a bad request joined with good ones gets its own error.
Their sampling clients' concurrent requests decode in one batch (every row with its run's adapters), and
each sampled token's log-prob equals the run's own training forward of the sequence.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import tinker
from gateway_fixtures import API_KEY, MAX_TOKENS_PER_RANK, MODEL_NAME, tiny_model_dir

from ringtune.gateway.config import GatewayConfig
from ringtune.gateway.server import ServerThread
from ringtune.worker.local import LocalBackend

ADAM = tinker.AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[ServerThread]:
    root = tmp_path_factory.mktemp("gateway-lora-passes")
    model_dir = tiny_model_dir(root / "models" / "tiny")
    backend = LocalBackend(
        str(model_dir), max_tokens_per_rank=MAX_TOKENS_PER_RANK, model_name=MODEL_NAME, dtype="float64"
    )
    config = GatewayConfig(  # a 1 ms decode slice: concurrent generations take turns of about one step
        checkpoint_root=str(root / "checkpoints"),
        api_key=API_KEY,
        max_live_runs=8,
        lora_pass_runs=8,
        sample_slice_s=0.001,
    )
    server = ServerThread(backend, config)
    server.start()
    yield server
    server.stop()


def datums(seed: int, lengths: tuple[int, ...]) -> list[tinker.Datum]:
    out = []
    for j, n in enumerate(lengths):
        tokens = [(seed * 31 + j * 7 + i * 5) % 90 + 1 for i in range(n + 1)]
        out.append(
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n},
            )
        )
    return out


DATA = [datums(1, (9, 3)), datums(2, (1, 20)), datums(3, (14,))]


def held(service, count: int, submit):
    """Hold the backend thread, call ``submit()``, wait until ``count`` requests are queued, release."""
    since = service.futures.clock()
    gate = threading.Event()
    service.executor.submit_for("test-gate", gate.wait, 60)
    try:
        result = submit()
        deadline = time.monotonic() + 60
        while service.futures.unsettled(since) < count and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        gate.set()
    return result


def test_three_lora_runs_share_a_pass_and_each_gets_its_own_result(gateway):
    service = gateway.service
    with tinker.ServiceClient(base_url=gateway.url, api_key=API_KEY) as sc:
        joined = [sc.create_lora_training_client(MODEL_NAME, rank=4, seed=10 + i).result() for i in range(3)]
        alone = [sc.create_lora_training_client(MODEL_NAME, rank=4, seed=10 + i).result() for i in range(3)]

        def submit():
            return [
                (tc.forward_backward(d, "cross_entropy"), tc.optim_step(ADAM))
                for tc, d in zip(joined, DATA, strict=True)
            ]

        pending = held(service, 6, submit)
        together = [(fb.result(timeout=120), step.result(timeout=120)) for fb, step in pending]
        separate = []
        for tc, d in zip(alone, DATA, strict=True):  # one at a time: nothing to join
            separate.append((tc.forward_backward(d, "cross_entropy").result(), tc.optim_step(ADAM).result()))
        for (fb, _), (fb0, _), data in zip(together, separate, DATA, strict=True):
            assert fb.metrics["lora_pass_runs:max"] == 3.0
            assert "lora_pass_runs:max" not in fb0.metrics
            assert abs(fb.metrics["loss:sum"] - fb0.metrics["loss:sum"]) <= 1e-10 * abs(fb0.metrics["loss:sum"])
            assert (
                fb.metrics["num_tokens:sum"] == fb0.metrics["num_tokens:sum"] == sum(d.model_input.length for d in data)
            )
            for got, want in zip(fb.loss_fn_outputs, fb0.loss_fn_outputs, strict=True):
                diffs = [abs(a - b) for a, b in zip(got["logprobs"].data, want["logprobs"].data, strict=True)]
                assert max(diffs) <= 1e-10
        # after each run's own optim_step the adapters are the same: a forward of the same datums agrees
        for tc, tc0, d in zip(joined, alone, DATA, strict=True):
            after, after0 = tc.forward(d, "cross_entropy").result(), tc0.forward(d, "cross_entropy").result()
            assert abs(after.metrics["loss:sum"] - after0.metrics["loss:sum"]) <= 1e-10 * abs(
                after0.metrics["loss:sum"]
            )
        # the adapters differ per run: the three runs' losses after one step are not all the same function
        assert len({round(fb.metrics["loss:sum"], 6) for fb, _ in together}) == 3

        bad = [
            tinker.Datum(model_input=tinker.ModelInput.from_ints([1, 5000]), loss_fn_inputs={"target_tokens": [2, 3]})
        ]

        def submit_with_bad():
            return [
                joined[0].forward(DATA[0], "cross_entropy"),
                joined[1].forward(bad, "cross_entropy"),
                joined[2].forward(DATA[2], "cross_entropy"),
            ]

        first, wrong, third = held(service, 3, submit_with_bad)
        with pytest.raises(Exception, match="vocab"):
            wrong.result(timeout=120)
        assert first.result(timeout=120).metrics["lora_pass_runs:max"] == 2.0
        assert third.result(timeout=120).metrics["lora_pass_runs:max"] == 2.0


def test_lora_samplers_decode_in_one_batch_each_with_its_adapters(gateway):
    service = gateway.service
    stats = gateway.backend.executor.executors[MODEL_NAME].samplers.decodes.stats
    with tinker.ServiceClient(base_url=gateway.url, api_key=API_KEY) as sc:
        runs = [sc.create_lora_training_client(MODEL_NAME, rank=2 + 2 * i, seed=20 + i).result() for i in range(3)]
        for tc, d in zip(runs, DATA, strict=True):  # adapters of their own (a fresh run's B = 0 is the base)
            tc.forward_backward(d, "cross_entropy").result()
            tc.optim_step(tinker.AdamParams(learning_rate=5e-2)).result()
        samplers = [tc.save_weights_and_get_sampling_client().result() for tc in runs]
        prompt = tinker.ModelInput.from_ints([5, 17, 3, 44, 2])
        before = stats.peak_models

        def submit():
            params = [tinker.SamplingParams(max_tokens=12, temperature=1.0, stop=[], seed=i) for i in range(3)]
            return [s.sample(prompt, num_samples=2, sampling_params=p) for s, p in zip(samplers, params, strict=True)]

        results = [call.result(timeout=120) for call in held(service, 3, submit)]
        assert before < 3 <= stats.peak_models  # the three runs' rows decoded in one step
        for tc, result in zip(runs, results, strict=True):
            for seq in result.sequences:
                tokens = [*prompt.to_ints(), *seq.tokens]
                datum = tinker.Datum(
                    model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
                )
                forward = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
                got = forward[prompt.length - 1 :]
                assert max(abs(a - b) for a, b in zip(got, seq.logprobs, strict=True)) <= 1e-9
