"""The gateway's settings (one frozen dataclass, mirrored by ``ringtune serve``)."""

from __future__ import annotations

from dataclasses import dataclass

from ringtune.errors import UserInputError


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """Settings of one gateway.

    Attributes:
        checkpoint_root: directory of every run's checkpoints and records (``<root>/<run_id>/...``).
        api_key: when set, every request but ``/api/v1/healthz`` must carry it as ``X-API-Key``.
        max_body_bytes: larger request bodies get 413 (before they are read in full).
        poll_timeout_s: how long ``retrieve_future`` holds a pending future (well under the SDK's 45 s).
        max_live_runs: the memory training runs of each served model may hold, in full fine-tuning runs of that
            model: a create that would exceed it is refused (user error); a LoRA run costs its adapters' state
            (:mod:`ringtune.gateway.run_memory`).
        model_live_runs: ``(model name, N)`` pairs: that model's budget instead of ``max_live_runs`` (N >= 0; 0:
            the model is only sampled), ``--model-live-runs`` (:mod:`ringtune.worker.model_set`).
        session_timeout_s: a session without heartbeat this long is finished (its live runs freed); 0 = never.
        gap_timeout_s: how long later ops wait for a missing ``seq_id`` before it is skipped.
        max_done_futures, future_max_age_s, retrieved_keep_s: bounds of finished futures (count, age unretrieved,
            age after retrieval).
        fwdbwd_max_chunk_len, fwdbwd_max_chunk_bytes: the SDK's chunking limits, sent in ``/client/config``.
        use_pyqwest_transport: the flag sent in ``/client/config`` (False keeps the SDK on plain httpx).
        autosave_every: save each live run as ``weights/autosave-<step>`` after every this many optimizer steps
            (0 = never); autosave_minutes: also after an optimizer step once this many minutes passed since the
            run's last save (0 = never); autosave_keep: autosaves kept per run (older ones are deleted).
        restore_live_runs: at start-up, open the sessions the previous server left open and bring their live runs
            back from their newest checkpoints (:mod:`ringtune.gateway.restore`); else they are forgotten.
        routing_replay: keep the MoE routing of sampled sequences and replay it for training datums that match one
            (:mod:`ringtune.gateway.routing_records`; the backend must record it: ``ModelSpec.record_routing``).
        sample_slice_s: a sampling request decodes for about this long per turn on the backend thread, then
            waits behind the other clients' queued ops for its next turn (0 = to the end in one turn).
        lora_pass_runs: the most LoRA runs whose waiting forward(_backward) requests run as one pass over the
            shared base (:mod:`ringtune.gateway.passes`); 1 (the default) = each request alone. Off by
            default because on CPU it does not pay (docs/lora.md: the matmuls of one run's request are already
            large enough, and a joined pass holds every run's merged unembedding at once).
        tokenizer_id: ``get_info``'s ``model_data.tokenizer_id`` (e.g. a hub id), overriding the one found from the
            served tokenizer (:mod:`ringtune.gateway.tokenizer_id`); None: found.
        reap_every_s: seconds between two passes of the checkpoint reaper (expired TTLs,
            :mod:`ringtune.gateway.checkpoint_reaper`).
    """

    checkpoint_root: str
    api_key: str | None = None
    max_body_bytes: int = 256 * 2**20
    poll_timeout_s: float = 25.0
    max_live_runs: int = 4
    model_live_runs: tuple[tuple[str, int], ...] = ()
    session_timeout_s: float = 900.0
    gap_timeout_s: float = 30.0
    max_done_futures: int = 10_000
    future_max_age_s: float = 3600.0
    retrieved_keep_s: float = 120.0
    fwdbwd_max_chunk_len: int = 4096
    fwdbwd_max_chunk_bytes: int = 100_000_000
    use_pyqwest_transport: bool = False
    autosave_every: int = 0
    autosave_minutes: float = 0.0
    autosave_keep: int = 2
    sample_slice_s: float = 0.5
    restore_live_runs: bool = False
    routing_replay: bool = False
    lora_pass_runs: int = 1
    tokenizer_id: str | None = None
    reap_every_s: float = 30.0

    def live_runs_of(self, model_name: str) -> int:
        """The budget of served model ``model_name`` in its full fine-tuning runs (``model_live_runs``, else
        ``max_live_runs``)."""
        return dict(self.model_live_runs).get(model_name, self.max_live_runs)

    def validate(self) -> None:
        """UserInputError naming the setting, its value and the limit."""
        checks = (
            ("max_body_bytes", self.max_body_bytes, self.max_body_bytes >= 1024, ">= 1024"),
            ("poll_timeout_s", self.poll_timeout_s, 0 < self.poll_timeout_s <= 40, "in (0, 40] (SDK timeout 45 s)"),
            ("max_live_runs", self.max_live_runs, self.max_live_runs >= 1, ">= 1"),
            ("session_timeout_s", self.session_timeout_s, self.session_timeout_s >= 0, ">= 0 (0 = never)"),
            ("gap_timeout_s", self.gap_timeout_s, self.gap_timeout_s > 0, "> 0"),
            ("fwdbwd_max_chunk_bytes", self.fwdbwd_max_chunk_bytes, self.fwdbwd_max_chunk_bytes >= 1, ">= 1"),
            ("autosave_every", self.autosave_every, self.autosave_every >= 0, ">= 0 (0 = never)"),
            ("autosave_minutes", self.autosave_minutes, self.autosave_minutes >= 0, ">= 0 (0 = never)"),
            ("autosave_keep", self.autosave_keep, self.autosave_keep >= 1, ">= 1"),
            ("sample_slice_s", self.sample_slice_s, self.sample_slice_s >= 0, ">= 0 (0 = no slicing)"),
            ("lora_pass_runs", self.lora_pass_runs, self.lora_pass_runs >= 1, ">= 1 (1 = each request alone)"),
            ("reap_every_s", self.reap_every_s, self.reap_every_s > 0, "> 0"),
        )
        for name, value, ok, limit in checks:
            if not ok:
                raise UserInputError(f"gateway setting {name}={value!r} must be {limit}")
        if self.fwdbwd_max_chunk_bytes > self.max_body_bytes:
            raise UserInputError(
                f"fwdbwd_max_chunk_bytes={self.fwdbwd_max_chunk_bytes} exceeds max_body_bytes={self.max_body_bytes}; "
                "the SDK would send bodies the server refuses"
            )
        if self.api_key is not None and not self.api_key.startswith(("tml-", "eyJ")):
            raise UserInputError(
                f"api_key must start with 'tml-' (the SDK refuses other keys); got {self.api_key[:4]!r}..."
            )
