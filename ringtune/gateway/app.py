"""FastAPI routes of the Tinker API (docs/protocol.md, "Routes" and "Errors"); routes only.

Every error is JSON ``{"error", "category", "detail"}`` with a 4xx status for what the client got wrong
(never an empty-body 400, never 402 or 409, never 5xx for a deterministic user error). An ASGI guard in
front checks the API key (``X-API-Key``, constant-time) and the body size (413 before the app sees it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ringtune.errors import UserInputError
from ringtune.gateway import rest
from ringtune.gateway.checkpoint_admin import CopyWeightsBody, TtlBody
from ringtune.gateway.downloads import DOWNLOAD_PREFIX
from ringtune.gateway.refusal import RefusedError
from ringtune.gateway.sampling import CreateSamplingSessionBody, SampleBody
from ringtune.gateway.sdk_routes import SDK_ROUTES, SdkRoute, refusal_message
from ringtune.gateway.service import GatewayService
from ringtune.gateway.wire import (
    CreateModelBody,
    CreateSessionBody,
    FinishSessionBody,
    LoadWeightsBody,
    ModelBody,
    OptimStepBody,
    ProbeBody,
    RetrieveFutureBody,
    SaveWeightsBody,
    SaveWeightsExternalBody,
    SaveWeightsForSamplerBody,
    SessionBody,
    WeightsInfoBody,
)

log = logging.getLogger(__name__)

PREFIX = "/api/v1"
PROTO = "application/x-protobuf"
OPEN_PATHS = {f"{PREFIX}/healthz"}
OPEN_PREFIXES = (DOWNLOAD_PREFIX,)
"""Routes without ``X-API-Key``: healthz, and downloads (their signed URLs are the credential)."""


def problem(status: int, message: str, category: str = "user") -> JSONResponse:
    """The JSON error every refusal uses."""
    return JSONResponse({"error": message, "category": category, "detail": message}, status_code=status)


async def _send_problem(send, status: int, message: str) -> None:
    body = json.dumps({"error": message, "category": "user", "detail": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware: API key (401) and body size (413); the body is buffered (at most ``max_body_bytes``)."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        path = scope["path"]
        if self.api_key is not None and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES):
            given = headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(given, self.api_key.encode()):
                await _send_problem(send, 401, "missing or wrong X-API-Key")
                return
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await _send_problem(send, 413, f"body of {int(length)} bytes exceeds the limit of {self.max_body_bytes}")
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _send_problem(send, 413, f"body exceeds the limit of {self.max_body_bytes} bytes")
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        buffered = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return buffered
            return await receive()

        await self.app(scope, replay, send)


def _decompress(request: Request, body: bytes, limit: int) -> bytes:
    encoding = request.headers.get("content-encoding", "").lower()
    if encoding in ("", "identity"):
        return body
    if encoding != "zstd":
        raise RefusedError(415, f"Content-Encoding {encoding!r} is not supported (identity or zstd)")
    import zstandard

    try:
        return zstandard.ZstdDecompressor().decompress(body, max_output_size=limit)
    except zstandard.ZstdError as exc:
        raise RefusedError(400, f"zstd body does not decompress within {limit} bytes: {exc}") from None


def json_route(name: str, body_type: type, handle: Callable[[Any], dict[str, Any]]) -> Callable[..., Any]:
    """A POST endpoint named ``name`` whose JSON body FastAPI parses into ``body_type`` (a pydantic model: a 422 in
    our shape when it does not fit) and hands to ``handle``; it answers ``handle``'s dict."""

    async def route(body: Any) -> dict[str, Any]:
        return handle(body)

    route.__name__ = route.__qualname__ = name
    body = inspect.Parameter("body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=body_type)
    route.__signature__ = inspect.Signature([body], return_annotation=dict[str, Any])  # type: ignore[attr-defined]
    return route


def refusing(route: SdkRoute) -> Callable[..., Any]:
    """The endpoint of an SDK route this server refuses: a JSON 404 naming the route and why
    (:mod:`ringtune.gateway.sdk_routes`)."""

    async def refuse() -> dict[str, Any]:
        raise RefusedError(404, refusal_message(route))

    refuse.__name__ = refuse.__qualname__ = f"refuse {route.method} {route.path}"
    return refuse


def create_app(service: GatewayService) -> Guard:
    """The ASGI app of ``service`` (with the :class:`Guard` in front). Its lifespan binds the service to the
    loop, runs ``service.tick`` every second, and closes the service at shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        service.dispatcher.bind_loop(asyncio.get_running_loop())

        async def ticker() -> None:
            while True:
                await asyncio.sleep(1.0)
                try:
                    await service.tick()
                except Exception:
                    log.exception("gateway tick failed")

        task = asyncio.create_task(ticker())
        try:
            yield
        finally:
            task.cancel()
            await asyncio.to_thread(service.close)

    app = FastAPI(title="ringtune Tinker gateway", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    config = service.config

    @app.exception_handler(RefusedError)
    async def _problem(_: Request, exc: RefusedError) -> JSONResponse:
        return problem(exc.status, exc.message, exc.category)

    @app.exception_handler(UserInputError)
    async def _user(_: Request, exc: UserInputError) -> JSONResponse:
        return problem(400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own refusals (unknown route 404, wrong method 405, an unparsable body 400) in our shape,
        # naming the route
        route = f"{request.method} {request.url.path}"
        if exc.status_code >= 500:
            return problem(exc.status_code, f"{route}: internal error: {exc.detail}", "server")
        return problem(exc.status_code, f"{route}: {exc.detail} ({exc.status_code})")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()]
        return problem(422, "invalid request: " + "; ".join(parts))

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return problem(500, f"internal error: {type(exc).__name__}: {exc}", "server")

    @app.post(f"{PREFIX}/client/config")
    async def client_config() -> dict[str, Any]:
        return {
            "pjwt_auth_enabled": False,
            "credential_default_source": "api_key",
            "use_pyqwest_transport": config.use_pyqwest_transport,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
            "proto_compress_fwdbwd": False,
            "sample_join_sampling_session": False,
            "fwdbwd_max_chunk_len": config.fwdbwd_max_chunk_len,
            "fwdbwd_max_chunk_bytes_count": config.fwdbwd_max_chunk_bytes,
        }

    @app.post(f"{PREFIX}/client/dynamic_config")
    async def dynamic_config() -> dict[str, Any]:
        return {}

    json_routes: dict[str, tuple[type, Callable[[Any], dict[str, Any]]]] = {
        "create_session": (CreateSessionBody, lambda b: service.runs.create_session(b.user_metadata, b.tags)),
        "session_heartbeat": (SessionBody, lambda b: service.runs.heartbeat(b.session_id)),
        "create_model": (CreateModelBody, service.creation.create_model),
        "get_info": (ModelBody, lambda b: service.runs.get_info(b.model_id)),
        "optim_step": (OptimStepBody, service.training.optim_step),
        "save_weights": (SaveWeightsBody, service.checkpoints.save_weights),
        "load_weights": (LoadWeightsBody, service.checkpoints.load_weights),
        "save_weights_for_sampler": (SaveWeightsForSamplerBody, service.checkpoints.save_weights_for_sampler),
        "save_weights_external": (SaveWeightsExternalBody, service.checkpoints.save_weights_external),
    }
    for name, (body_type, handle) in json_routes.items():
        app.post(f"{PREFIX}/{name}")(json_route(name, body_type, handle))

    @app.post(f"{PREFIX}/sessions/{{session_id}}/finish")
    async def finish_session(session_id: str, body: FinishSessionBody | None = None) -> dict[str, Any]:
        return service.runs.finish_session(session_id, (body or FinishSessionBody()).reason.type)

    @app.post(f"{PREFIX}/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        body = _decompress(request, await request.body(), config.max_body_bytes)
        return service.training.forward_backward(body)

    @app.post(f"{PREFIX}/telemetry")
    async def telemetry() -> dict[str, Any]:
        return {"status": "accepted"}

    @app.post(f"{PREFIX}/create_sampling_session")
    async def create_sampling_session(body: CreateSamplingSessionBody) -> dict[str, Any]:
        return await service.create_sampling_session(body)

    @app.post(f"{PREFIX}/asample")
    async def asample(body: SampleBody) -> dict[str, Any]:
        return await service.sampling.asample_decoding_images(body)

    @app.post(f"{PREFIX}/retrieve_future")
    async def retrieve_future(body: RetrieveFutureBody) -> Response:
        outcome = await service.retrieve(body.request_id)
        if outcome.kind == "proto":
            assert isinstance(outcome.body, bytes)
            return Response(content=outcome.body, media_type=PROTO)
        return JSONResponse(outcome.body)

    @app.get(f"{PREFIX}/training_runs")
    async def training_runs(limit: int = 20, offset: int = 0) -> dict[str, Any]:
        return rest.list_training_runs(service, limit, offset)

    @app.get(f"{PREFIX}/training_runs/{{run_id}}")
    async def training_run(run_id: str) -> dict[str, Any]:
        return rest.get_training_run(service, run_id)

    @app.get(f"{PREFIX}/training_runs/{{run_id}}/checkpoints")
    async def run_checkpoints(run_id: str) -> dict[str, Any]:
        return rest.list_checkpoints(service, run_id)

    # before the routes whose {checkpoint_id:path} would swallow their last segment
    @app.put(f"{PREFIX}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/ttl")
    async def checkpoint_ttl(run_id: str, checkpoint_id: str, body: TtlBody) -> dict[str, Any]:
        service.admin.set_ttl(run_id, checkpoint_id, body.ttl_seconds)
        return {}

    @app.post(f"{PREFIX}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/publish")
    async def publish_checkpoint(run_id: str, checkpoint_id: str) -> dict[str, Any]:
        service.admin.set_public(run_id, checkpoint_id, True)
        return {}

    @app.delete(f"{PREFIX}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/publish")
    async def unpublish_checkpoint(run_id: str, checkpoint_id: str) -> dict[str, Any]:
        service.admin.set_public(run_id, checkpoint_id, False)
        return {}

    @app.delete(f"{PREFIX}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str) -> dict[str, Any]:
        return await rest.delete_checkpoint(service, run_id, checkpoint_id)

    @app.get(f"{PREFIX}/checkpoints")
    async def user_checkpoints(limit: int = 100, offset: int = 0) -> dict[str, Any]:
        return rest.list_user_checkpoints(service, limit, offset)

    @app.post(f"{PREFIX}/weights_info")
    async def weights_info(body: WeightsInfoBody) -> dict[str, Any]:
        return rest.weights_info(service, body.tinker_path)

    @app.get(f"{PREFIX}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/external_weights_urls")
    async def external_weights_urls(run_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
        return rest.external_weights_urls(service, run_id, checkpoint_id, str(request.base_url))

    @app.get(DOWNLOAD_PREFIX + "{run_id}/{name}/{file:path}")
    async def download(run_id: str, name: str, file: str, expires: str = "", sig: str = "") -> FileResponse:
        return FileResponse(rest.download_file(service, run_id, name, file, expires, sig))

    @app.post(f"{PREFIX}/ringtune/probe")
    async def probe(body: ProbeBody) -> dict[str, Any]:
        return await service.probe(body.name)

    @app.get(f"{PREFIX}/get_server_capabilities")
    async def server_capabilities() -> dict[str, Any]:
        return rest.server_capabilities(service)

    @app.get(f"{PREFIX}/samplers/{{sampler_id}}")
    async def sampler(sampler_id: str) -> dict[str, Any]:
        return rest.get_sampler(service, sampler_id)

    @app.post(f"{PREFIX}/copy_weights")
    async def copy_weights(body: CopyWeightsBody, request: Request) -> dict[str, Any]:
        return await service.admin.copy_weights(body, request.headers.get("x-idempotency-key"))

    @app.get(f"{PREFIX}/sessions")
    async def sessions(limit: int = 20, offset: int = 0) -> dict[str, Any]:
        return rest.list_sessions(service, limit, offset)

    @app.post(f"{PREFIX}/cancel_future")
    async def cancel_future(body: RetrieveFutureBody) -> dict[str, Any]:
        rest.cancel_future(service, body.request_id)
        return {}

    for refused in (r for r in SDK_ROUTES if r.refused is not None):
        app.add_api_route(f"{PREFIX}{refused.path}", refusing(refused), methods=[refused.method])

    @app.get(f"{PREFIX}/sessions/{{session_id}}")
    async def session(session_id: str) -> dict[str, Any]:
        return rest.get_session(service, session_id)

    @app.get(f"{PREFIX}/healthz")
    async def healthz() -> JSONResponse:
        health = service.backend.health()
        if health.ok:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "error": health.detail, "category": "server"}, status_code=503)

    return Guard(app, api_key=config.api_key, max_body_bytes=config.max_body_bytes)
