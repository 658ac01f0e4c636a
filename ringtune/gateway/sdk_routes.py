"""Every HTTP route the tinker 0.38 SDK can call, and whether this gateway serves it or refuses it (and why).

Enumerated from the SDK's source: ``tinker/resources/*.py`` (the generated resources),
``tinker/lib/public_interfaces/{rest,service,sampling,admin}_client.py``, ``tinker/lib/internal_client_holder.py``,
``tinker/lib/_jwt_auth.py`` and ``tinker/cli/auth_api.py``. The app (:mod:`ringtune.gateway.app`) answers every
refused route with a JSON 404 ``{"error", "category": "user"}`` naming the method, the route and the reason
(:func:`refusal_message`); docs/gateway.md carries this table. ``tests/test_gateway_sdk_rest.py`` checks that
each route is answered in JSON (served: not a 404 of an unknown route; refused: the message below).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SdkRoute:
    """One route: HTTP ``method``, ``path`` under ``/api/v1`` (``{x}`` = a path parameter), the SDK call that
    reaches it, and ``refused``: None when served, else why not (the error names it)."""

    method: str
    path: str
    caller: str
    refused: str | None = None


NOT_ENABLED = "the SDK calls it only when /client/config enables {flag}, which this server sends as false"

SDK_ROUTES: tuple[SdkRoute, ...] = (
    SdkRoute("POST", "/client/config", "every client, at start"),
    SdkRoute("POST", "/client/dynamic_config", "every client, periodically"),
    SdkRoute("GET", "/healthz", "ServiceClient health check"),
    SdkRoute("GET", "/get_server_capabilities", "get_server_capabilities"),
    SdkRoute("POST", "/create_session", "ServiceClient()"),
    SdkRoute("POST", "/session_heartbeat", "ServiceClient heartbeat"),
    SdkRoute("POST", "/sessions/{session_id}/finish", "ServiceClient close"),
    SdkRoute("POST", "/telemetry", "telemetry (accepted, discarded)"),
    SdkRoute("POST", "/create_model", "create_lora_training_client"),
    SdkRoute("POST", "/get_info", "TrainingClient.get_info / get_tokenizer"),
    SdkRoute("POST", "/forward_backward", "forward, forward_backward (protobuf)"),
    SdkRoute("POST", "/optim_step", "optim_step"),
    SdkRoute("POST", "/save_weights", "save_state"),
    SdkRoute("POST", "/load_weights", "load_state, create_training_client_from_state"),
    SdkRoute("POST", "/save_weights_for_sampler", "save_weights_for_sampler, save_weights_and_get_sampling_client"),
    SdkRoute("POST", "/save_weights_external", "save_weights_external"),
    SdkRoute("POST", "/retrieve_future", "every future"),
    SdkRoute("POST", "/cancel_future", "a cancelled sampling future (the result is dropped; decoding goes on)"),
    SdkRoute("POST", "/create_sampling_session", "create_sampling_client"),
    SdkRoute("POST", "/asample", "SamplingClient.sample / compute_logprobs"),
    SdkRoute("GET", "/samplers/{sampler_id}", "RestClient.get_sampler, SamplingClient.get_base_model"),
    SdkRoute("POST", "/copy_weights", "RestClient.copy_weights"),
    SdkRoute("GET", "/training_runs", "list_training_runs"),
    SdkRoute("GET", "/training_runs/{run_id}", "get_training_run"),
    SdkRoute("GET", "/training_runs/{run_id}/checkpoints", "list_checkpoints"),
    SdkRoute("DELETE", "/training_runs/{run_id}/checkpoints/{checkpoint_id}", "delete_checkpoint"),
    SdkRoute("PUT", "/training_runs/{run_id}/checkpoints/{checkpoint_id}/ttl", "set_checkpoint_ttl_from_tinker_path"),
    SdkRoute(
        "POST", "/training_runs/{run_id}/checkpoints/{checkpoint_id}/publish", "publish_checkpoint_from_tinker_path"
    ),
    SdkRoute(
        "DELETE", "/training_runs/{run_id}/checkpoints/{checkpoint_id}/publish", "unpublish_checkpoint_from_tinker_path"
    ),
    SdkRoute(
        "GET", "/training_runs/{run_id}/checkpoints/{checkpoint_id}/external_weights_urls", "get_external_weights_urls"
    ),
    SdkRoute("GET", "/checkpoints", "list_user_checkpoints"),
    SdkRoute("POST", "/weights_info", "get_weights_info_by_tinker_path"),
    SdkRoute("GET", "/sessions", "list_sessions"),
    SdkRoute("GET", "/sessions/{session_id}", "get_session"),
    SdkRoute(
        "POST", "/retrieve_futures", "session futures poller", NOT_ENABLED.format(flag="sample_use_retrieve_futures")
    ),
    SdkRoute(
        "POST", "/join_sampling_session", "SamplingClient", NOT_ENABLED.format(flag="sample_join_sampling_session")
    ),
    SdkRoute(
        "POST",
        "/create_custom_loss",
        "forward_backward_custom",
        NOT_ENABLED.format(flag="custom_loss_server_side") + "; forward_backward_custom runs its loss on the client",
    ),
    SdkRoute("POST", "/auth/token", "JWT exchange", NOT_ENABLED.format(flag="pjwt_auth_enabled")),
    SdkRoute(
        "GET",
        "/auth/apikey/me",
        "tinker CLI (auth)",
        "API keys are not managed here: the server has one key, set by ringtune serve --api-key",
    ),
    SdkRoute(
        "DELETE",
        "/auth/apikey/me",
        "tinker CLI (auth)",
        "API keys are not managed here: the server has one key, set by ringtune serve --api-key",
    ),
    SdkRoute("PUT", "/sessions/{session_id}/project", "assign_session_project", "a self-hosted server has no projects"),
    SdkRoute(
        "GET",
        "/sessions/{session_id}/trace_export",
        "export_session_trace",
        "no request traces are kept; the server's log and /ringtune/probe are its diagnostics",
    ),
    SdkRoute(
        "POST",
        "/sessions/search",
        "search_sessions",
        "no session search index; use GET /sessions and GET /sessions/{session_id}",
    ),
    SdkRoute("GET", "/audit", "AdminClient.get_audit_log", "no audit log: a self-hosted server has one key, no users"),
    SdkRoute("GET", "/billing/usage/events", "AdminClient.get_billing_usage", "no billing on a self-hosted server"),
    SdkRoute(
        "GET",
        "/billing/usage/checkpoints/current",
        "AdminClient.get_current_checkpoint_storage_usage",
        "no billing on a self-hosted server; list_user_checkpoints gives each checkpoint's size_bytes",
    ),
)
"""The table (served routes first)."""


def refusal_message(route: SdkRoute) -> str:
    """The error of a refused route: method, route and reason."""
    return f"{route.method} /api/v1{route.path} is not served by this ringtune server: {route.refused}"
