"""The HTTP surface as an attacker sees it, through a real server on 127.0.0.1 (one for the module).

The routes are enumerated from the FastAPI app, so a new route is attacked without editing this file. Each is
hit with a missing and a wrong API key, malformed and oversized bodies, bodies of the wrong JSON type, every
declared field set to junk (wrong types, unicode, huge numbers, ``..`` and absolute paths), junk path and
query parameters. Every answer must be JSON with ``error`` and ``category: user`` and a 4xx status (or a
200 whose future, if any, resolves with a result or a ``user`` error), within the client timeout: never a
5xx, never a hang. Afterwards nothing is half-applied: the run's weights and checkpoints, the list of runs
and the files under the checkpoint root are what the good requests made.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import httpx
import pytest
from fastapi.routing import APIRoute
from gateway_fixtures import API_KEY, MODEL_NAME, start_gateway, tiny_model_dir
from pydantic import BaseModel

from ringtune.gateway.downloads import DOWNLOAD_PREFIX

MAX_BODY = 1 << 20
PREFIX = "/api/v1"
OPEN = {f"{PREFIX}/healthz"}
"""Routes without a key; downloads (DOWNLOAD_PREFIX) are open too but need a signed URL."""
JUNK: list[Any] = [None, True, -1, 2**70, "", "💥\u202e\x00", "../../etc/passwd", "/etc/passwd", [], {}]
"""Values every body field is set to in turn (a JSON-encodable catalogue of wrong types and hostile strings)."""


class Target:
    """The module's server, raw HTTP client and the ids of one session, run, checkpoint and sampling session."""

    def __init__(self, server, root: Path) -> None:
        self.server, self.root = server, root
        self.url = f"{server.url}{PREFIX}"
        self.http = httpx.Client(base_url=self.url, headers={"X-API-Key": API_KEY}, timeout=60)
        self.session = self.ok("create_session", {"tags": [], "user_metadata": None})["session_id"]
        body = {"session_id": self.session, "model_seq_id": 0, "base_model": MODEL_NAME, "lora_config": {"rank": 0}}
        self.model = self.result(self.ok("create_model", body)["request_id"])["model_id"]
        self.seq = 0
        saved = self.ok("save_weights", {"model_id": self.model, "path": "good", "seq_id": self.next()})
        self.weights_path = self.result(saved["request_id"])["path"]
        sampler = {"model_id": self.model, "path": "good_s", "seq_id": self.next()}
        self.sampler_path = self.result(self.ok("save_weights_for_sampler", sampler)["request_id"])["path"]
        body = {"session_id": self.session, "sampling_session_seq_id": 1, "model_path": self.sampler_path}
        self.sampling = self.ok("create_sampling_session", body)["sampling_session_id"]
        self.spare_session = self.ok("create_session", {"tags": []})["session_id"]  # finished by the attacks

    def next(self) -> int:
        self.seq += 1
        return self.seq

    def post_in_order(self, route: str, body: dict[str, Any]) -> httpx.Response:
        """POST ``body`` with the run's next ``seq_id``, consumed only if the op was accepted (no gap to wait on)."""
        response = self.http.post(route, json={**body, "seq_id": self.seq + 1})
        if response.status_code == 200:
            self.seq += 1
        return response

    def ok(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.http.post(path, json=body)
        assert response.status_code == 200, (path, response.text)
        return response.json()

    def result(self, request_id: str, timeout_s: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            response = self.http.post("retrieve_future", json={"request_id": request_id})
            assert response.status_code == 200, response.text
            if response.headers["content-type"] != "application/json":
                return {"type": "proto"}
            body = response.json()
            if body.get("type") != "try_again":
                return body
        raise AssertionError(f"future {request_id} did not resolve in {timeout_s} s")

    def valid_bodies(self) -> dict[str, dict[str, Any]]:
        """A body each JSON route accepts (the base that the field attacks mutate); seq ids left to ``fresh``."""
        session, model = self.session, self.model
        prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
        return {
            "create_session": {"tags": [], "user_metadata": {"a": "b"}},
            "session_heartbeat": {"session_id": session},
            "create_model": {"session_id": session, "model_seq_id": 90, "base_model": MODEL_NAME},
            "get_info": {"model_id": model},
            "optim_step": {"model_id": model, "seq_id": 0, "adam_params": {"learning_rate": 0.0}},
            "save_weights": {"model_id": model, "path": "attack", "seq_id": 0},
            "save_weights_for_sampler": {"model_id": model, "path": "attack_s", "seq_id": 0},
            "load_weights": {"model_id": model, "seq_id": 0, "path": self.weights_path, "optimizer": True},
            "create_sampling_session": {"session_id": session, "sampling_session_seq_id": 50, "base_model": MODEL_NAME},
            "asample": {
                "sampling_session_id": self.sampling,
                "seq_id": 0,
                "num_samples": 1,
                "prompt": prompt,
                "sampling_params": {"max_tokens": 2, "temperature": 0.0},
            },
            "retrieve_future": {"request_id": "nope"},
            "cancel_future": {"request_id": "nope"},
            "copy_weights": {"source_path": self.weights_path, "destination_project_id": "proj-attack"},
            "weights_info": {"tinker_path": self.weights_path},
            "ringtune/probe": {"name": "ring_accumulation"},
            "save_weights_external": {"model_id": model, "path": "attack_x", "seq_id": 0},
            f"sessions/{self.spare_session}/finish": {"reason": {"type": "success"}},
        }


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Iterator[Target]:
    root = tmp_path_factory.mktemp("gateway-attack")
    model_dir = tiny_model_dir(root / "models" / "tiny")
    server = start_gateway(
        root / "checkpoints",
        model_dir,
        max_body_bytes=MAX_BODY,
        fwdbwd_max_chunk_bytes=MAX_BODY // 2,
        poll_timeout_s=1.0,
        gap_timeout_s=2.0,
        max_live_runs=64,  # the field attacks create runs (a junk user_metadata is still a good create)
    )
    t = Target(server, root / "checkpoints")
    yield t
    t.http.close()
    server.stop()


def routes(target: Target) -> list[tuple[str, str, APIRoute]]:
    """(method, path template, route) of every route of the served FastAPI app."""
    app = target.server.server.config.app.app  # uvicorn's app is the Guard; its .app is FastAPI
    found = [(m, r.path, r) for r in app.routes if isinstance(r, APIRoute) for m in sorted(r.methods)]
    assert len(found) >= 25, found
    return found


def filled(template: str, value: str = "nope") -> str:
    """``template`` with every ``{param}`` / ``{param:path}`` replaced by ``value``, relative to the prefix."""
    out, depth = "", 0
    for ch in template:
        if ch == "{":
            depth += 1
            out += value
        elif ch == "}":
            depth -= 1
        elif depth == 0:
            out += ch
    return out.removeprefix(PREFIX + "/")


def names(message: str, field: str | tuple[str, ...] | None) -> bool:
    """Whether ``message`` names ``field`` (or one of several: a junk value that is valid gets refused for
    another field of the same body, e.g. a save whose name exists already)."""
    fields = (field,) if isinstance(field, str) else field or ()
    return not fields or any(f in message for f in fields)


def assert_refused(response: httpx.Response, *context: object, field: str | tuple[str, ...] | None = None) -> None:
    """A JSON 4xx ``{"error", "category": "user"}`` naming ``field`` when given."""
    assert 400 <= response.status_code < 500, (context, response.status_code, response.text[:300])
    body = response.json()
    assert body.get("category") == "user" and isinstance(body.get("error"), str), (context, body)
    assert names(body["error"], field), (context, field, body["error"][:300])


def assert_not_server_fault(
    target: Target, response: httpx.Response, *context: object, field: str | tuple[str, ...] | None = None
) -> None:
    """A JSON 4xx naming ``field``, or a 200 whose future (if any) ends in a result or a ``user`` error."""
    if response.status_code != 200:
        assert_refused(response, *context, field=field)
        return
    body = response.json()
    if isinstance(body, dict) and "request_id" in body and not str(context[0]).endswith("retrieve_future"):
        outcome = target.result(body["request_id"])
        assert outcome.get("category", "user") == "user", (context, outcome)
        if "error" in outcome:
            assert names(outcome["error"], field), (context, field, outcome["error"][:300])


def test_every_route_needs_the_key(target):
    anonymous = httpx.Client(timeout=30)
    for method, template, _ in routes(target):
        url = f"{target.url}/{filled(template)}"
        for headers in ({}, {"X-API-Key": "tml-wrong"}, {"X-API-Key": API_KEY + "x"}, {"X-API-Key": b"\xe9\xff"}):
            response = anonymous.request(method, url, headers=headers, content=b"{}")
            if template in OPEN:
                assert response.status_code == 200, (method, template, response.text)
            elif template.startswith(DOWNLOAD_PREFIX):  # open: its signed URL is the credential, none here
                assert response.status_code == 403 and response.json()["category"] == "user", response.text
            else:
                assert response.status_code == 401, (method, template, headers, response.text)
                assert_refused(response, method, template, field="X-API-Key")
    anonymous.close()


def test_unknown_routes_and_methods_are_json_4xx(target):
    assert_refused(target.http.post("no_such_route", json={}), "unknown route")
    assert_refused(target.http.get("create_model"), "GET on a POST route")
    assert_refused(target.http.put("training_runs"), "PUT on a GET route")
    assert_refused(httpx.get(f"{target.server.url}/", headers={"X-API-Key": API_KEY}), "root")


MALFORMED = {
    "not json": b"{not json",
    "a list": b"[]",
    "null": b"null",
    "a string": b'"s"',
    "a huge number": b"1e999999",
    "bad utf-8": b'{"session_id": "\xff\xfe"}',
    "lone surrogate": b'{"session_id": "\\ud800"}',
    "deep nesting": b"[" * 100_000 + b"]" * 100_000,
    "nul bytes": b"\0" * 64,
}


def test_malformed_and_oversized_bodies_on_every_post_route(target):
    for method, template, _ in routes(target):
        if method != "POST":
            continue
        path = filled(template)
        for what, body in MALFORMED.items():
            for ctype in ("application/json", "application/x-protobuf"):
                response = target.http.post(path, content=body, headers={"Content-Type": ctype})
                if response.status_code != 200:
                    assert_refused(response, template, what, ctype)
        big = target.http.post(path, content=b" " * (MAX_BODY + 1), headers={"Content-Type": "application/json"})
        assert_refused(big, template, "oversized", field="exceeds the limit")

        def chunks() -> Iterator[bytes]:  # no Content-Length: the guard counts the streamed bytes
            for _ in range(MAX_BODY // 65536 + 2):
                yield b" " * 65536

        streamed = target.http.post(path, content=chunks(), headers={"Content-Type": "application/json"})
        assert_refused(streamed, template, "oversized stream", field="exceeds the limit")


def test_every_body_field_with_junk(target):
    """Each declared field of each JSON route's body, set to each junk value on an otherwise good body."""
    bodies = target.valid_bodies()
    attacked, failures = 0, []
    for method, template, route in routes(target):
        if method != "POST" or route.body_field is None:
            continue
        name = filled(template, target.spare_session)
        assert name in bodies, f"route {template} takes a body: add a valid one to Target.valid_bodies"
        annotation = route.body_field.field_info.annotation
        models = [a for a in (*get_args(annotation), annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        fields = models[0].model_fields
        for field in fields:
            for junk in JUNK:
                body = dict(bodies[name])
                if "seq_id" in body and field != "seq_id":  # the next one; consumed only if the op is accepted
                    body["seq_id"] = target.seq + 1
                body[field] = junk
                start = time.monotonic()
                response = target.http.post(name, json=body)
                if response.status_code == 200 and body.get("seq_id") == target.seq + 1 and "model_id" in body:
                    target.seq += 1
                try:
                    named = (field, *fields) if junk is None or junk in ([], {}) or isinstance(junk, bool) else field
                    assert_not_server_fault(target, response, name, field, junk, field=named)
                except AssertionError as exc:
                    failures.append(str(exc)[:400])
                attacked += 1
                if time.monotonic() - start > 0.5:
                    print(
                        "SLOW", round(time.monotonic() - start, 2), name, field, repr(junk)[:30], response.status_code
                    )
    assert attacked > 300
    assert not failures, "\n".join(failures)


PATH_JUNK = [
    "nope",
    "%2e%2e",  # a bare ".." is resolved by the client itself
    "..%2F..%2Fetc",
    "%2Fetc%2Fpasswd",
    "💥",
    "a" * 5000,
    "%00",
    "x%0Ay",
    "%ff",
]


def test_path_and_query_parameters(target):
    for method, template, _ in routes(target):
        if "{" not in template:
            continue
        for value in PATH_JUNK:
            response = target.http.request(method, filled(template, value), json={})
            assert_refused(response, method, template, value)
        if template.endswith("checkpoints/{checkpoint_id:path}"):
            for checkpoint in (
                "weights/%2e%2e",
                "weights/%2e%2e%2F%2e%2e%2Fx",
                "sampler_weights/%2Fetc",
                "weights/" + "a" * 300,
            ):
                response = target.http.delete(f"training_runs/{target.model}/checkpoints/{checkpoint}")
                assert_refused(response, template, checkpoint, field="checkpoint")
    for route in ("training_runs", "checkpoints"):
        for params in ({"limit": -1}, {"limit": "x"}, {"offset": -5}, {"limit": 2**70}, {"offset": 1.5}):
            assert_refused(target.http.get(route, params=params), route, params)


def test_tinker_paths_cannot_leave_their_run(target):
    """``..``, absolute paths, unknown runs, wrong kinds and other schemes in every field that takes a path."""
    run, other = target.model, "someone:train:0"
    paths = [
        f"tinker://{run}/weights/../../../etc",
        f"tinker://{run}/weights/..",
        "tinker:///etc/passwd",
        "/etc/passwd",
        "file:///etc/passwd",
        f"tinker://{other}/weights/good",
        f"tinker://{run}/weights/missing",
        f"tinker://{run}/ephemeral/good",
        target.sampler_path,  # a sampler checkpoint where training state is needed
        f"tinker://{run}/weights/good/extra",
        "tinker://" + "a" * 5000,
    ]
    before = set(target.root.rglob("*"))
    runs = target.http.get("training_runs").json()["cursor"]["total_count"]
    for path in paths:
        for route, body in (
            ("load_weights", {"model_id": run, "path": path}),
            ("load_weights", {"session_id": target.session, "model_seq_id": 700, "path": path, "optimizer": True}),
            ("weights_info", {"tinker_path": path}),
            (
                "create_sampling_session",
                {"session_id": target.session, "sampling_session_seq_id": 9, "model_path": path},
            ),
            ("save_weights", {"model_id": run, "path": path}),
            ("save_weights_for_sampler", {"model_id": run, "path": path}),
        ):
            ordered = "model_id" in body
            response = target.post_in_order(route, body) if ordered else target.http.post(route, json=body)
            if path == target.sampler_path and route in ("weights_info", "create_sampling_session"):
                assert response.status_code == 200, (route, response.text)  # a sampler checkpoint is right here
                continue
            if response.status_code == 200 and "request_id" in response.json():
                outcome = target.result(response.json()["request_id"])
                if route == "load_weights" and path == target.sampler_path:
                    assert outcome.get("category") == "user", (route, path, outcome)
                assert outcome.get("category", "user") == "user", (route, path, outcome)
                continue
            assert_refused(response, route, path)
    assert target.http.get("training_runs").json()["cursor"]["total_count"] == runs  # no half-made run
    made = {p for p in set(target.root.rglob("*")) - before if ".tokenizers" not in p.parts}
    assert all(target.root in p.parents for p in made), made
    names = {c["checkpoint_id"] for c in target.http.get(f"training_runs/{run}/checkpoints").json()["checkpoints"]}
    assert not [n for n in names if ".." in n or n.startswith("/")], names


def test_still_healthy_and_unchanged(target):
    """After every attack: healthz 200, the run trains, its good checkpoint still loads."""
    assert target.http.get("healthz").json() == {"status": "ok"}
    body = {"model_id": target.model, "seq_id": target.next(), "path": target.weights_path, "optimizer": True}
    assert target.result(target.ok("load_weights", body)["request_id"]).get("type") == "load_weights"
    info = target.ok("get_info", {"model_id": target.model})
    assert info["model_data"]["arch"] and json.dumps(info)


def test_forward_backward_protobuf_fuzz(target):
    """A valid ForwardBackwardRequest with bytes flipped, truncated or a shape inflated (on a run of its own):
    never a server fault; the decoder is reached (each variant carries the run's next seq_id)."""
    import numpy as np
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    body = {"session_id": target.session, "model_seq_id": 500, "base_model": MODEL_NAME}
    run = target.result(target.ok("create_model", body)["request_id"])["model_id"]
    fields = {"target_tokens": np.arange(1, 7, dtype=np.int64), "weights": np.ones(6, np.float32)}
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8, 9, 10]), loss_fn_inputs=fields)
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=run,
        seq_id=1,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = True
    rng = np.random.default_rng(0)
    headers = {"Content-Type": "application/x-protobuf"}
    seq, outcomes = 1, {"accepted": 0, "refused": 0}
    for n in range(61):
        msg.seq_id = seq
        if n == 0:
            inflated = type(msg)()
            inflated.CopyFrom(msg)
            inflated.data[0].loss_fn_inputs["weights"].shape[:] = [2**40]
            variant = inflated.SerializeToString()
        else:
            raw = bytearray(msg.SerializeToString())
            for i in rng.integers(0, len(raw), size=int(rng.integers(1, 4))):
                raw[i] = int(rng.integers(0, 256))
            variant = bytes(raw[: int(rng.integers(len(raw) // 2, len(raw)))] if n % 4 == 0 else raw)
        response = target.http.post("forward_backward", content=variant, headers=headers)
        outcomes["accepted" if response.status_code == 200 else "refused"] += 1
        seq += response.status_code == 200
        assert_not_server_fault(target, response, "forward_backward", variant[:40])
    assert outcomes["accepted"] >= 10, outcomes  # enough variants got past the framing to the decoder
