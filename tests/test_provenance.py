"""stable_reinforce provenance: resolution against the sampler's records (unit), and the whole path through the
real SDK on a tiny Qwen3.5-MoE gateway (LocalBackend, float32, ``--routing-replay``): a sampling client with
``record_stability_info=True`` gets a ``sequence_id`` per sequence, the server records it with its routing, a
``forward_backward`` with ``Datum.with_provenance`` trains on the recorded log-probs and replays the recorded
experts, and a datum whose tokens do not match is refused as ``user`` with the weights unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.tiny_models import hf_model

from ringtune.engine.batch import TrainDatum
from ringtune.errors import UserInputError
from ringtune.gateway.proto import ProvenanceSpan, WireDatum
from ringtune.gateway.provenance import resolve_provenance
from ringtune.gateway.stability_records import StabilityRecords

PROMPT = [3, 17, 42, 8]
SAMPLED = [5, 11, 9]
LOGPROBS = [-0.5, -1.25, -2.0]


def prompt_run(offset: int, length: int, seq: str = "r:0") -> ProvenanceSpan:
    return ProvenanceSpan(False, seq, offset, length)


def sampled_run(offset: int, length: int, seq: str = "r:0") -> ProvenanceSpan:
    return ProvenanceSpan(True, seq, offset, length)


def rl_loop_datum(targets: list[int] | None = None, tokens: list[int] | None = None) -> WireDatum:
    """A datum as the cookbook's ``rl_loop`` builds it: input prompt + sampled[:-1], targets 0 over the prompt
    then the sampled tokens, client log-probs 0 (to show the server uses its records)."""
    tokens = tokens or PROMPT + SAMPLED[:-1]
    targets = targets or [0] * (len(PROMPT) - 1) + SAMPLED
    n = len(tokens)
    inputs = {
        "target_tokens": np.array(targets, np.int64),
        "logprobs": np.zeros(n, np.float32),
        "advantages": np.ones(n, np.float32),
    }
    model_spans = (prompt_run(0, len(PROMPT)), sampled_run(0, len(SAMPLED) - 1))
    loss_spans = (prompt_run(1, len(PROMPT) - 1), sampled_run(0, len(SAMPLED)))
    return WireDatum(np.array(tokens, np.int64), inputs, model_spans, loss_spans)


def engine_datum(wire: WireDatum) -> TrainDatum:
    return TrainDatum(torch.from_numpy(wire.tokens), {k: torch.from_numpy(v) for k, v in wire.inputs.items()})


def resolve(wire: WireDatum, records: StabilityRecords):
    return resolve_provenance([wire], [engine_datum(wire)], records)


@pytest.fixture
def records() -> StabilityRecords:
    store = StabilityRecords(None)
    routing = torch.arange(6 * 2 * 2, dtype=torch.int16).reshape(6, 2, 2)  # prompt + sampled[:-1] fed tokens
    store.add("sess:sample:0:ab", "r:0", PROMPT, SAMPLED, LOGPROBS, routing)
    return store


def test_resolution_sets_the_recorded_logprobs_sampled_rows_and_routing(records):
    (datum,), replayed = resolve(rl_loop_datum(), records)
    assert datum.inputs["logprobs"].tolist() == [0.0, 0.0, 0.0, *LOGPROBS]
    assert datum.inputs["sampled_mask"].tolist() == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert replayed == 6 and torch.equal(datum.routing, torch.arange(24).reshape(6, 2, 2))


@pytest.mark.parametrize(
    ("wire", "needles"),
    [
        (rl_loop_datum(tokens=[3, 17, 42, 8, 5, 12]), ["data[0].model_input[5]=12", "'r:0'", "sampled token 1 is 11"]),
        (rl_loop_datum(tokens=[3, 16, 42, 8, 5, 11]), ["data[0].model_input[1]=16", "prompt token 1 is 17"]),
        (
            rl_loop_datum(targets=[0, 0, 0, 5, 11, 10]),
            ["data[0].loss_fn_inputs['target_tokens'][5]=10", "'r:0'", "sampled token 2 is 9"],
        ),
    ],
)
def test_a_token_that_does_not_match_the_record_is_refused(records, wire, needles):
    with pytest.raises(UserInputError) as info:
        resolve(wire, records)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_bad_provenance_is_refused(records):
    good = rl_loop_datum()
    cases = {
        "has no stability record": WireDatum(
            good.tokens, good.inputs, (prompt_run(0, 4, "nope"), sampled_run(0, 2)), good.loss_fn_input_spans
        ),
        "cover 5 positions but the field has 6": WireDatum(
            good.tokens, good.inputs, (prompt_run(0, 4), sampled_run(0, 1)), good.loss_fn_input_spans
        ),
        "positions [2, 5) of sequence 'r:0'": WireDatum(
            good.tokens, good.inputs, good.model_input_spans, (prompt_run(1, 3), sampled_run(2, 3))
        ),
        "needs provenance": WireDatum(good.tokens, good.inputs),
    }
    for needle, wire in cases.items():
        with pytest.raises(UserInputError) as info:
            resolve(wire, records)
        assert needle in str(info.value), (needle, str(info.value))


# ---- through the SDK ------------------------------------------------------------------------------------------


def test_sdk_stable_reinforce_on_moe_with_routing_recorded_at_sampling(tmp_path):
    import tinker
    from gateway_fixtures import API_KEY, tiny_model_dir
    from tinker.types import RequestErrorCategory

    from ringtune.gateway.config import GatewayConfig
    from ringtune.gateway.server import ServerThread
    from ringtune.worker.local import LocalBackend

    model_dir = tiny_model_dir(tmp_path / "model")
    hf_model("qwen3_5_moe", seed=5).save_pretrained(model_dir)
    backend = LocalBackend(str(model_dir), max_tokens_per_rank=128, record_routing=True)
    config = GatewayConfig(checkpoint_root=str(tmp_path / "ckpt"), api_key=API_KEY, routing_replay=True)
    with ServerThread(backend, config) as url, tinker.ServiceClient(base_url=url, api_key=API_KEY) as sc:
        tc = sc.create_lora_training_client(str(model_dir), rank=0).result()
        sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
        params = tinker.SamplingParams(max_tokens=6, temperature=1.0, seed=4, stop=[])
        result = sampler.sample(tinker.ModelInput.from_ints(PROMPT), 2, params).result()
        files = list((tmp_path / "ckpt" / ".stability_records").glob("*.jsonl"))
        assert len(files) == 1 and len(files[0].read_text().splitlines()) == 2  # both sequences, persisted
        data = []
        for seq, adv in zip(result.sequences, [1.0, -1.0], strict=True):
            assert seq.sequence_id and seq.sequence_id.endswith((":0", ":1"))
            n = len(PROMPT) + len(seq.tokens) - 1
            datum = tinker.Datum(
                model_input=tinker.ModelInput.from_ints(PROMPT + seq.tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": [0] * (len(PROMPT) - 1) + seq.tokens,
                    "logprobs": [0.0] * (len(PROMPT) - 1) + seq.logprobs,
                    "advantages": [0.0] * (len(PROMPT) - 1) + [adv] * len(seq.tokens),
                },
            )
            data.append(datum.with_provenance(
                model_input=[
                    tinker.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(PROMPT)),
                    tinker.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens) - 1),
                ],
                loss_fn_inputs=[
                    tinker.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=len(PROMPT) - 1),
                    tinker.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens)),
                ],
            ))  # fmt: skip
            assert datum.model_input.length == n
        before = tc.forward(data, "stable_reinforce").result()
        # the routing recorded at sampling is replayed on every input token, so trainer and sampler agree
        assert before.metrics["routing_replay_tokens:sum"] == sum(d.model_input.length for d in data)
        assert abs(before.metrics["kl_sample_train_v1:mean"]) < 1e-5, before.metrics
        assert before.metrics["masked_token_frac:mean"] == 0.0 == before.metrics["masked_sequence_frac:mean"]

        # a sampled token changed: refused as a user error naming datum, position and sequence; nothing applied
        bad_tokens = data[1].loss_fn_inputs["target_tokens"].to_torch().clone()
        bad_tokens[-1] = (int(bad_tokens[-1]) + 1) % 96
        bad = tinker.Datum(
            model_input=data[1].model_input,
            loss_fn_inputs={**data[1].loss_fn_inputs, "target_tokens": bad_tokens},
            model_input_spans=data[1].model_input_spans,
            loss_fn_input_spans=data[1].loss_fn_input_spans,
        )
        with pytest.raises(tinker.RequestFailedError) as info:
            tc.forward_backward([data[0], bad], "stable_reinforce").result()
        message = str(info.value)
        assert info.value.category == RequestErrorCategory.User, info.value
        position = len(bad_tokens) - 1
        assert f"data[1].loss_fn_inputs['target_tokens'][{position}]" in message, message
        assert result.sequences[1].sequence_id in message, message
        tc.optim_step(tinker.AdamParams(learning_rate=0.1)).result()
        after = tc.forward(data, "stable_reinforce").result()
        for a, b in zip(before.loss_fn_outputs, after.loss_fn_outputs, strict=True):
            assert torch.equal(a["logprobs"].to_torch(), b["logprobs"].to_torch())  # the weights did not move

        # the good request trains (the advantages differ, so the gradient is not zero) and moves the weights
        out = tc.forward_backward(data, "stable_reinforce", {"kl_coef": 0.1}).result()
        assert out.metrics["loss:sum"] != 0.0
        tc.optim_step(tinker.AdamParams(learning_rate=0.1)).result()
        moved = tc.forward(data, "stable_reinforce").result()
        assert moved.metrics["kl_sample_train_v1:mean"] != before.metrics["kl_sample_train_v1:mean"]
