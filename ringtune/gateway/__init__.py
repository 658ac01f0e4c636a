"""The Tinker HTTP gateway: the SDK's wire protocol in front of a :class:`~ringtune.gateway.backend.Backend`.

Files, in the order a request passes them: ``app.py`` (FastAPI routes only) → ``wire.py`` (JSON bodies) /
``proto.py`` (the SDK's protobuf) → ``service.py`` (the pieces that turn a request into a job: ``runs.py``,
``run_creation.py``, ``training_ops.py``, ``checkpoint_ops.py``, ``sampling*.py``) → ``dispatch.py`` (per-run
order, the backend thread, futures) → ``translate.py`` (wire → engine types) → ``backend.py`` (the Backend
protocol, also the one table of verbs; its implementations live in :mod:`ringtune.worker`, which the gateway never
imports). ``state.py`` keeps sessions, runs and checkpoint records, ``futures.py`` the futures and per-run
``seq_id`` order, ``paths.py`` the checkpoint directory layout, ``server.py`` starts uvicorn. See docs/gateway.md.
"""
