"""Bad input over raw HTTP (httpx): each gets the right status or future error, the server stays up and the
weights do not change. Also seq_id ordering: out-of-order submits, duplicates, gaps that get skipped."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from gateway_fixtures import API_KEY, MODEL_NAME, start_gateway, tiny_model_dir
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

GAP_TIMEOUT_S = 10.0  # long enough that out-of-order submits on a busy machine are never taken for a gap
MAX_BODY = 1 << 20


class Api:
    """A raw client of one gateway, with one session and one full fine-tuning model."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": API_KEY}, timeout=30)
        self.session = self.post("create_session", json={"tags": [], "user_metadata": None, "sdk_version": "x"}).json()[
            "session_id"
        ]
        created = self.post("create_model", json=self.create_body(0)).json()
        self.model = self.result(created["request_id"])["model_id"]
        self.seq = 0

    def create_body(self, model_seq_id: int, rank: int = 0, base_model: str = MODEL_NAME) -> dict[str, Any]:
        return {
            "session_id": self.session,
            "model_seq_id": model_seq_id,
            "base_model": base_model,
            "lora_config": {"rank": rank},
            "type": "create_model",
        }

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.http.post(path, **kwargs)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def result(self, request_id: str) -> Any:
        """Poll until done: a JSON dict (result or error) or the decoded ForwardBackwardOutput."""
        while True:
            response = self.post("retrieve_future", json={"request_id": request_id})
            assert response.status_code == 200, response.text
            if response.headers["content-type"] == "application/x-protobuf":
                return deserialize_forward_backward_output(response.content)
            body = response.json()
            if body.get("type") != "try_again":
                return body

    def fwd_message(
        self, seq: int, loss: str = "cross_entropy", forward_only: bool = True, **inputs: Any
    ) -> pb.ForwardBackwardRequest:
        """A valid request (as the SDK encodes it) of one 6-token datum, ``inputs`` replacing its defaults."""
        fields = {"target_tokens": np.arange(1, 7, dtype=np.int64), "weights": np.ones(6, np.float32)} | inputs
        datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8, 9, 10]), loss_fn_inputs=fields)
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn=loss),
            model_id=self.model,
            seq_id=seq,
        )
        msg = forward_backward_request_to_proto(request)
        msg.forward_only = forward_only
        return msg

    def submit_fwd(self, msg: pb.ForwardBackwardRequest) -> httpx.Response:
        return self.post(
            "forward_backward", content=msg.SerializeToString(), headers={"Content-Type": "application/x-protobuf"}
        )

    def forward(self) -> np.ndarray:
        response = self.submit_fwd(self.fwd_message(self.next_seq()))
        return self.result(response.json()["request_id"]).loss_fn_outputs[0]["logprobs"].to_numpy()

    def optim(self, seq: int, **adam: Any) -> httpx.Response:
        body = json.dumps({"model_id": self.model, "seq_id": seq, "adam_params": adam})  # NaN allowed
        return self.post("optim_step", content=body, headers={"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> Iterator[Api]:
    root = tmp_path_factory.mktemp("gateway-http")
    model_dir = tiny_model_dir(root / "models" / "tiny")
    server = start_gateway(
        root / "checkpoints",
        model_dir,
        gap_timeout_s=GAP_TIMEOUT_S,
        max_body_bytes=MAX_BODY,
        fwdbwd_max_chunk_bytes=MAX_BODY // 2,
        poll_timeout_s=1.0,
        max_live_runs=2,
    )
    client = Api(server.url)
    client.root = root  # type: ignore[attr-defined]
    yield client
    assert client.http.get("healthz").json() == {"status": "ok"}  # still up after everything
    client.http.close()
    server.stop()


def assert_refused(response: httpx.Response, status: int, words: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["category"] == "user" and words in body["error"], body


def test_api_key(api):
    url = f"{api.url}/api/v1"
    assert_refused(httpx.post(f"{url}/client/config", json={}), 401, "X-API-Key")
    assert_refused(httpx.post(f"{url}/client/config", json={}, headers={"X-API-Key": "tml-wrong"}), 401, "X-API-Key")
    assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}
    with pytest.raises(tinker.AuthenticationError):
        tinker.RestClient(base_url=api.url, api_key="tml-wrong").list_training_runs().result()


def test_served_probe_route(api):
    """ringtune's own ``POST /api/v1/ringtune/probe``: keyed like every route; an unknown probe is a JSON 400
    naming it; the ring-accumulation probe answers (a float32 server is its own accumulator: not applicable)."""
    url = f"{api.url}/api/v1/ringtune/probe"
    assert_refused(httpx.post(url, json={"name": "ring_accumulation"}), 401, "X-API-Key")
    assert_refused(api.post("ringtune/probe", json={"name": "nope"}), 400, "'nope' is not a served probe")
    assert_refused(api.post("ringtune/probe", json={}), 422, "name")
    summary = api.post("ringtune/probe", json={"name": "ring_accumulation"}).json()
    assert summary["probe"] == "ring_accumulation" and summary["applies"] is False, summary
    assert "float32 is its own accumulator" in summary["why"] and summary["cp"] == 1


def test_malformed_requests_get_json_4xx(api):
    proto_headers = {"Content-Type": "application/x-protobuf"}
    assert_refused(api.post("forward_backward", content=b"\xff\xfe garbage", headers=proto_headers), 400, "protobuf")
    assert_refused(
        api.post("create_model", content=b"{not json", headers={"Content-Type": "application/json"}), 422, "invalid"
    )
    assert_refused(api.post("create_model", json={"session_id": api.session}), 422, "model_seq_id")
    assert_refused(
        api.post("optim_step", json={"model_id": api.model, "seq_id": "x", "adam_params": {}}), 422, "seq_id"
    )
    unknown = api.fwd_message(1)
    unknown.model_id = "nope:train:0"
    assert_refused(api.submit_fwd(unknown), 404, "no such training run")
    assert_refused(api.post("get_info", json={"model_id": "nope"}), 404, "no such training run")
    assert_refused(api.post("retrieve_future", json={"request_id": "nope"}), 404, "unknown")
    assert_refused(api.http.get("training_runs/nope"), 404, "no such training run")
    assert_refused(api.post("session_heartbeat", json={"session_id": "nope"}), 404, "no such session")
    big = api.post("forward_backward", content=b"\0" * (MAX_BODY + 1), headers=proto_headers)
    assert_refused(big, 413, "exceeds the limit")
    encoded = api.post("forward_backward", content=b"x", headers=proto_headers | {"Content-Encoding": "br"})
    assert_refused(encoded, 415, "Content-Encoding")
    zero = api.fwd_message(0)
    assert_refused(api.submit_fwd(zero), 400, "seq_id=0")
    assert_refused(api.post("create_model", json=api.create_body(5, rank=-1)), 400, "lora_config.rank=-1")
    assert_refused(api.post("create_model", json=api.create_body(5, base_model="x/y")), 400, "not served here")
    assert_refused(api.post("create_model", json=api.create_body(-1)), 400, "model_seq_id")
    bad_path = {"session_id": api.session, "model_seq_id": 6, "path": "tinker://../weights/x", "optimizer": True}
    assert_refused(api.post("load_weights", json=bad_path), 400, "not a valid training run id")
    four = {
        "session_id": api.session,
        "model_seq_id": 6,
        "path": f"tinker://{api.model}/weights/a/b",
        "optimizer": True,
    }
    assert_refused(api.post("load_weights", json=four), 400, "exactly 3")
    assert_refused(api.http.delete(f"training_runs/{api.model}/checkpoints/weights/..%2F..%2Fx"), 400, "checkpoint")
    assert_refused(api.http.delete(f"training_runs/{api.model}/checkpoints/other/x"), 400, "checkpoint_id")
    assert_refused(api.http.get("training_runs", params={"limit": 0}), 400, "limit")


def _nan_weights() -> np.ndarray:
    w = np.ones(6, np.float32)
    w[2] = math.nan
    return w


CONTENT_ERRORS = [
    ("weights of the wrong length", {"weights": np.ones(5, np.float32)}, "cross_entropy", "expected [6]"),
    ("NaN weight", {"weights": _nan_weights()}, "cross_entropy", "not finite"),
    ("float targets", {"target_tokens": np.ones(6, np.float32)}, "cross_entropy", "target_tokens"),
    ("target out of vocab", {"target_tokens": np.full(6, 500, np.int64)}, "cross_entropy", "[0, 96)"),
    ("unknown loss", {}, "hinge", "not a supported loss"),
    ("stable_reinforce without provenance", {}, "stable_reinforce", "needs provenance"),
    ("a server-set key", {"sampled_mask": np.ones(6, np.float32)}, "cross_entropy", "set by the server"),
    ("missing RL inputs", {}, "ppo", "lacks"),
    ("unknown input key", {"bonus": np.ones(6, np.float32)}, "cross_entropy", "unknown loss_fn_inputs key"),
]


def test_bad_content_fails_the_future_and_changes_nothing(api):
    before = api.forward()
    for what, inputs, loss, words in CONTENT_ERRORS:
        response = api.submit_fwd(api.fwd_message(api.next_seq(), loss, forward_only=False, **inputs))
        assert response.status_code == 200, (what, response.text)
        outcome = api.result(response.json()["request_id"])
        assert outcome["category"] == "user" and words in outcome["error"], (what, outcome)
    tweaks = {
        "int32 dtype": lambda m: setattr(m.data[0].loss_fn_inputs["weights"], "dtype", pb.DTYPE_INT32),
        "byte count": lambda m: setattr(m.data[0].loss_fn_inputs["weights"], "dense", b"\0" * 7),
        "image chunk": lambda m: setattr(m.data[0].model_input.add().image, "data", b"png"),
        "token out of vocab": lambda m: setattr(
            m.data[0].model_input[0].encoded_text, "tokens", np.full(6, 999, "<i4").tobytes()
        ),
        "text config": lambda m: setattr(m.loss_fn_config_v2["beta"], "text", "high"),
        "no datums": lambda m: m.ClearField("data"),
    }
    for what, tweak in tweaks.items():
        msg = api.fwd_message(api.next_seq(), forward_only=False)
        tweak(msg)
        outcome = api.result(api.submit_fwd(msg).json()["request_id"])
        assert outcome["category"] == "user", (what, outcome)
    optim_errors = [
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"beta1": 1.5}, "beta1"),
        ({"eps": math.nan}, "eps"),
        ({"learning_rate": "fast"}, "must be a number"),
        ({"momentum": 0.9}, "unknown field"),
    ]
    for adam, words in optim_errors:
        outcome = api.result(api.optim(api.next_seq(), **adam).json()["request_id"])
        assert outcome["category"] == "user" and words in outcome["error"], (adam, outcome)
    dimuon = {
        "model_id": api.model,
        "seq_id": api.next_seq(),
        "optimizer_params": {"type": "dimuon", "learning_rate": 1},
    }
    outcome = api.result(api.post("optim_step", json=dimuon).json()["request_id"])
    assert outcome["category"] == "user" and "adam" in outcome["error"], outcome
    for name in ("../evil", "a/b", ".hidden", "", "x" * 200):
        body = {"model_id": api.model, "path": name, "seq_id": api.next_seq(), "type": "save_weights"}
        outcome = api.result(api.post("save_weights", json=body).json()["request_id"])
        assert outcome["category"] == "user" and "not a valid checkpoint name" in outcome["error"], (name, outcome)
    assert not (api.root / "evil").exists() and not (api.root / "checkpoints" / "evil").exists()
    after = api.forward()
    assert np.array_equal(before, after)  # nothing above reached the weights


def test_out_of_order_submits_run_in_seq_order(api):
    base = api.seq
    api.seq += 3
    later = api.submit_fwd(api.fwd_message(base + 3)).json()["request_id"]
    step = api.optim(base + 2, learning_rate=0.05).json()["request_id"]
    time.sleep(0.2)
    assert api.post("retrieve_future", json={"request_id": later}).json()["type"] == "try_again"
    first = api.submit_fwd(api.fwd_message(base + 1, forward_only=False)).json()["request_id"]
    again = api.optim(base + 2, learning_rate=0.05).json()["request_id"]
    assert again == step  # a resubmit of a known seq_id gets the original request_id
    before, stepped, after = api.result(first), api.result(step), api.result(later)
    assert stepped["metrics"]["step:max"] == 1.0
    lp_before = before.loss_fn_outputs[0]["logprobs"].to_numpy()
    lp_after = after.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert not np.array_equal(lp_before, lp_after)  # seq 3 saw the step of seq 2, seq 1 did not
    assert np.array_equal(lp_after, api.forward())


def test_a_missing_seq_id_is_skipped_after_the_gap_timeout(api):
    base = api.seq
    api.seq += 2
    waiting = api.submit_fwd(api.fwd_message(base + 2)).json()["request_id"]
    start = time.monotonic()
    outcome = api.result(waiting)  # base + 1 never comes: skipped after GAP_TIMEOUT_S (checked once a second)
    assert outcome.metrics["num_tokens:sum"] == 6.0
    assert time.monotonic() - start >= GAP_TIMEOUT_S * 0.5
    assert_refused(api.submit_fwd(api.fwd_message(base + 1)), 400, "too late")


def test_sessions_finish_and_limits(api):
    other = Api(api.url)  # the second live run: the limit is 2
    assert_refused(other.post("create_model", json=other.create_body(1)), 400, "the limit is 2")
    assert other.post("sessions/" + other.session + "/finish", json={"reason": {"type": "success"}}).status_code == 200
    assert_refused(other.post("session_heartbeat", json={"session_id": other.session}), 410, "finished")
    assert_refused(other.submit_fwd(other.fwd_message(1)), 400, "not live")
    assert_refused(other.post("create_model", json=other.create_body(1)), 410, "finished")
    info = other.post("get_info", json={"model_id": other.model}).json()  # records outlive the session
    assert info["model_data"]["model_name"] == MODEL_NAME
    third = Api(api.url)  # finishing the session freed its run
    third.http.close()
    other.http.close()
