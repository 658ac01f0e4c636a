"""Sampling sessions as the SDK makes them and the REST surface of tinker 0.38, through the real SDK.

One gateway (a LocalBackend over a tiny random Qwen3.5, float32) serves the whole module; its reaper passes
every 0.2 s. Log-prob comparisons are exact: every sampler here reads float32 weights that are copies of the
same tensors (an HF export, an in-memory snapshot), run by the same code in this process.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import timedelta

import httpx
import pytest
import tinker
from gateway_fixtures import API_KEY, MODEL_NAME, start_gateway, tiny_model_dir

from ringtune.gateway.sdk_routes import SDK_ROUTES, refusal_message
from ringtune.gateway.state import now_utc
from ringtune.gateway.tokenizer_id import remote_tokenizer_id

ADAM = tinker.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
PROMPT = tinker.ModelInput.from_ints([3, 17, 42, 8, 5, 61])


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("gateway-rest")
    model_dir = tiny_model_dir(root / "models" / "tiny")
    server = start_gateway(root / "checkpoints", model_dir, max_live_runs=8, reap_every_s=0.2)
    yield {"url": server.url, "root": root / "checkpoints", "server": server, "model_dir": model_dir}
    server.stop()


def clients(gateway) -> tuple[tinker.ServiceClient, tinker.RestClient]:
    return (
        tinker.ServiceClient(base_url=gateway["url"], api_key=API_KEY),
        tinker.RestClient(base_url=gateway["url"], api_key=API_KEY),
    )


def train_step(tc: tinker.TrainingClient, seed: int) -> None:
    """One cross-entropy step on a fixed little batch (the weights change)."""
    tokens = [(seed * 7 + i * 13) % 96 for i in range(9)]
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 8},
    )
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(ADAM).result()


def logprobs(sampler: tinker.SamplingClient) -> list[float | None]:
    return sampler.compute_logprobs(PROMPT).result()


def test_sampling_sessions_from_paths_and_both_fields(gateway):
    sc, rest = clients(gateway)
    with sc:
        tc = sc.create_lora_training_client(MODEL_NAME, rank=0).result()
        base = logprobs(sc.create_sampling_client(base_model=MODEL_NAME).result())
        train_step(tc, 1)
        weights = tc.save_state("w1").result().path
        export = tc.save_weights_for_sampler("s1").result().path
        from_export = logprobs(sc.create_sampling_client(model_path=export).result())
        assert from_export != base
        # both fields, agreeing (the SDK and the recipes send both); a weights/ path samples that checkpoint
        both = sc.create_sampling_client(model_path=weights, base_model=MODEL_NAME).result()
        assert logprobs(both) == from_export
        assert both.get_base_model() == MODEL_NAME
        sampler_info = rest.get_sampler(both._sampling_session_id).result()
        assert sampler_info.model_path == weights and sampler_info.base_model == MODEL_NAME
        exports = list((gateway["root"] / tc.model_id / "weights_export").iterdir())
        assert len(exports) == 1 and exports[0].name.startswith("w1.")
        again = sc.create_sampling_client(model_path=weights).result()  # the export is reused, not made again
        assert logprobs(again) == from_export
        assert list((gateway["root"] / tc.model_id / "weights_export").iterdir()) == exports
        with pytest.raises(tinker.BadRequestError, match=r"base_model='other/model'.*model_path="):
            sc.create_sampling_client(model_path=weights, base_model="other/model").result()
        with pytest.raises(tinker.NotFoundError, match="no such checkpoint"):
            sc.create_sampling_client(model_path=f"tinker://{tc.model_id}/weights/missing").result()
        # deleting the checkpoint deletes its sampling export
        rest.delete_checkpoint(tc.model_id, "weights/w1").result()
        assert not exports[0].exists()


def test_inflight_samplers_share_the_newest_published_weights(gateway):
    sc, _ = clients(gateway)
    pool = gateway["server"].backend.executor.executors[MODEL_NAME].samplers
    with sc:
        tc = sc.create_lora_training_client(MODEL_NAME, rank=0).result()
        first = tc.save_weights_and_get_sampling_client(kind="inflight").result()
        snapshot = tc.save_weights_and_get_sampling_client().result()
        w1 = logprobs(first)
        train_step(tc, 2)
        assert logprobs(first) == w1  # not published yet
        second = tc.save_weights_and_get_sampling_client(kind="inflight").result()
        w2 = logprobs(second)
        assert w2 != w1
        assert logprobs(first) == w2  # the earlier inflight sampler adopted the newer weights
        assert logprobs(snapshot) == w1  # a snapshot keeps its weights
        third = tc.save_weights_and_get_sampling_client(kind="inflight").result()  # no step: nothing copied
        assert logprobs(third) == w2
        held = [key for key in pool.snapshots if key[:2] == ("inflight", tc.model_id)]
        assert held == [("inflight", tc.model_id)]  # one shared target per run, however many saves
    body = {"model_id": tc.model_id, "path": "named", "kind": "inflight", "seq_id": 99}
    answer = httpx.post(f"{gateway['url']}/api/v1/save_weights_for_sampler", json=body, headers={"X-API-Key": API_KEY})
    assert answer.status_code in (400, 404) and answer.json()["category"] == "user"


def test_ttl_reaper_publish_copy_and_sessions(gateway):
    sc, rest = clients(gateway)
    service = gateway["server"].service
    with sc:
        tc = sc.create_lora_training_client(MODEL_NAME, rank=0, user_metadata={"k": "v"}).result()
        run_id = tc.model_id
        session_id = run_id.split(":train:")[0]
        train_step(tc, 3)
        kept = tc.save_state("kept").result().path
        tc.save_weights_for_sampler("doomed").result()
        used = tc.save_weights_for_sampler("used").result().path
        tc.save_state("newest").result()
        sampler = sc.create_sampling_client(model_path=used).result()
        # TTL: stored and listed; out of range refused; None removes it
        rest.set_checkpoint_ttl_from_tinker_path(kept, 7200).result()
        listed = {c.checkpoint_id: c for c in rest.list_checkpoints(run_id).result().checkpoints}
        assert listed["weights/kept"].expires_at is not None and listed["weights/newest"].expires_at is None
        with pytest.raises(tinker.BadRequestError, match="ttl_seconds=10"):
            rest.set_checkpoint_ttl_from_tinker_path(kept, 10).result()
        rest.set_checkpoint_ttl_from_tinker_path(kept, None).result()
        assert rest.list_checkpoints(run_id).result().checkpoints[0].expires_at is None
        # publish / unpublish: the recorded flag (idempotent)
        rest.publish_checkpoint_from_tinker_path(kept).result()
        rest.publish_checkpoint_from_tinker_path(kept).result()
        assert {c.checkpoint_id: c.public for c in rest.list_checkpoints(run_id).result().checkpoints}["weights/kept"]
        rest.unpublish_checkpoint_from_tinker_path(kept).result()
        assert not any(c.public for c in rest.list_checkpoints(run_id).result().checkpoints)
        # the reaper: expired checkpoints go, except one a live sampler reads and a live run's newest weights
        for name in ("sampler_weights/doomed", "sampler_weights/used", "weights/newest"):
            rest.set_checkpoint_ttl_from_tinker_path(f"tinker://{run_id}/{name}", 3600).result()
            service.registry.runs[run_id].checkpoints[name].expires_at = now_utc() - timedelta(seconds=1)
        deadline = time.monotonic() + 10
        while (gateway["root"] / run_id / "sampler_weights" / "doomed").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        names = sorted(c.checkpoint_id for c in rest.list_checkpoints(run_id).result().checkpoints)
        assert names == ["sampler_weights/used", "weights/kept", "weights/newest"]
        assert not (gateway["root"] / run_id / "sampler_weights" / "doomed").exists()
        assert json.loads((gateway["root"] / run_id / "run.json").read_text())["checkpoints"][0]["name"] == "kept"
        assert (gateway["root"] / run_id / "sampler_weights" / "used" / "config.json").is_file()
        assert len(logprobs(sampler)) == PROMPT.length  # the sampler on the kept export still samples
        # copy_weights: a new, not trainable run whose files are hard links of the source's
        copy = rest.copy_weights(kept, "proj-archive", ttl_seconds=3600).result()
        copy_run = copy.removeprefix("tinker://").split("/")[0]
        assert copy == f"tinker://{copy_run}/weights/kept" and copy_run != run_id
        copied = rest.list_checkpoints(copy_run).result().checkpoints
        assert [c.checkpoint_id for c in copied] == ["weights/kept"] and copied[0].expires_at is not None
        assert rest.get_training_run(copy_run).result().user_metadata == {
            "copied_from": kept,
            "project_id": "proj-archive",
        }
        source_files = sorted((gateway["root"] / run_id / "weights" / "kept").resolve().iterdir())
        copy_files = sorted((gateway["root"] / copy_run / "weights" / "kept").iterdir())
        assert [f.name for f in source_files] == [f.name for f in copy_files]
        assert all(a.stat().st_ino == b.stat().st_ino for a, b in zip(source_files, copy_files, strict=True))
        loaded = sc.create_training_client_from_state(copy).result()
        probe = tinker.Datum(
            model_input=tinker.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
        )
        from_source = sc.create_training_client_from_state(kept).result()
        assert (
            loaded.forward([probe], "cross_entropy").result().metrics
            == from_source.forward([probe], "cross_entropy").result().metrics
        )
        # sessions: list and get
        assert session_id in rest.list_sessions(limit=100).result().sessions
        got = rest.get_session(session_id).result()
        assert got.training_run_ids[0] == run_id and sampler._sampling_session_id in got.sampler_ids
        with pytest.raises(tinker.NotFoundError, match="no such session"):
            rest.get_session("s-missing").result()


def test_every_sdk_route_is_answered_in_json_naming_it(gateway):
    headers = {"X-API-Key": API_KEY}
    with httpx.Client(base_url=gateway["url"], headers=headers, timeout=30) as http:
        for route in SDK_ROUTES:
            path = route.path.format(session_id="s-none", sampler_id="x", run_id="r-none", checkpoint_id="weights/none")
            body = None if route.method in ("GET", "DELETE") else {}
            answer = http.request(route.method, f"/api/v1{path}", json=body)
            assert answer.headers["content-type"].startswith("application/json"), route
            error = answer.json().get("error", "") if answer.status_code >= 400 else ""
            if route.refused is not None:
                assert answer.status_code == 404 and error == refusal_message(route), route
            else:
                assert "Not Found (404)" not in error and "Method Not Allowed" not in error, (route, error)
        unknown = http.get("/api/v1/no_such_route")
        assert unknown.status_code == 404 and unknown.json()["error"].startswith("GET /api/v1/no_such_route")
        cancel = http.post("/api/v1/cancel_future", json={"request_id": "sample-none"})
        assert cancel.status_code == 404 and "sample-none" in cancel.json()["error"]


def test_tokenizer_id_remote_clients_can_load(gateway, tmp_path):
    sc, _ = clients(gateway)
    with sc:
        tc = sc.create_lora_training_client(MODEL_NAME, rank=0).result()
        # the tiny model says no hub id: its local directory (a client on this machine loads it)
        assert tc.get_info().model_data.tokenizer_id == str(gateway["model_dir"].resolve())
    assert remote_tokenizer_id("org/override", str(gateway["model_dir"])) == "org/override"
    named = tmp_path / "named"
    named.mkdir()
    (named / "tokenizer_config.json").write_text(json.dumps({"name_or_path": "Qwen/Qwen3.5-0.8B"}))
    assert remote_tokenizer_id(None, str(named)) == "Qwen/Qwen3.5-0.8B"
    (named / "tokenizer_config.json").write_text(json.dumps({"name_or_path": str(named)}))
    (named / "config.json").write_text(json.dumps({"_name_or_path": "HuggingFaceTB/SmolLM2-135M"}))
    assert remote_tokenizer_id(None, str(named)) == "HuggingFaceTB/SmolLM2-135M"
    cached = tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / "abc123"
    cached.mkdir(parents=True)
    assert remote_tokenizer_id(None, str(cached)) == "Qwen/Qwen3-8B"
    assert remote_tokenizer_id(None, None) is None
