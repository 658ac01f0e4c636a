"""Pydantic bodies of the JSON routes, as SDK 0.38 sends them (docs/protocol.md, "Routes").

Unknown fields are ignored (the SDK adds fields over time); only what the gateway reads is declared, with
the SDK's defaults. Values are checked further in :mod:`ringtune.gateway.translate`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Body(BaseModel):
    """A request body: extra fields ignored, ``model_`` prefixed fields allowed."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSessionBody(Body):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None


class SessionBody(Body):
    """``session_heartbeat``."""

    session_id: str


class ProbeBody(Body):
    """``POST /api/v1/ringtune/probe`` (ringtune's own route, not Tinker's): which served probe to run."""

    name: str


class FinishReason(Body):
    type: str = "success"


class FinishSessionBody(Body):
    reason: FinishReason = FinishReason()
    detail: str | None = None


class LoraConfigBody(Body):
    rank: int
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModelBody(Body):
    session_id: str
    model_seq_id: int
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfigBody | None = None
    optimizer_config: dict[str, Any] | None = None


class ModelBody(Body):
    """``get_info``."""

    model_id: str


class OptimStepBody(Body):
    model_id: str
    seq_id: int | None = None
    adam_params: dict[str, Any] | None = None
    optimizer_params: dict[str, Any] | None = None
    optim_params: dict[str, Any] | None = None


class SaveWeightsBody(Body):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, Any] | None = None


class SaveWeightsForSamplerBody(Body):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"
    seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, Any] | None = None


class SaveWeightsExternalBody(Body):
    """``save_weights_external`` (SDK 0.38's ``SaveWeightsExternalRequest``)."""

    model_id: str
    path: str
    seq_id: int | None = None
    ttl_seconds: int | None = None
    age_encryption_recipients: list[str] | None = None


class LoadWeightsBody(Body):
    """Create-via-load (``session_id`` + ``model_seq_id``) or legacy (``model_id`` + ``seq_id``)."""

    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool = False
    optimizer_config: dict[str, Any] | None = None


class RetrieveFutureBody(Body):
    request_id: str
    allow_metadata_only: bool = False


class WeightsInfoBody(Body):
    tinker_path: str
