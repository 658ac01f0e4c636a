"""The Tinker HTTP gateway: the SDK's wire protocol in front of a :class:`~ringtune.gateway.backend.Backend`.

Files, in the order a request passes them: ``app.py`` (FastAPI routes only) → ``wire.py`` (JSON bodies) /
``proto.py`` (the SDK's protobuf) → ``service.py`` (the Tinker verbs: validation, ordering, futures) →
``translate.py`` (wire → engine types) → ``backend.py`` (the Backend protocol; ``local.py`` runs one
:class:`~ringtune.engine.trainer.Trainer` per run in this process). ``state.py`` keeps sessions, runs and
checkpoint records, ``futures.py`` the futures and per-run ``seq_id`` order, ``paths.py`` the checkpoint
directory layout, ``server.py`` starts uvicorn. See docs/gateway.md.
"""
