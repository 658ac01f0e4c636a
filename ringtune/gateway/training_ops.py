"""The Tinker verbs that train a run: ``forward_backward`` / ``forward`` and ``optim_step``.

Each is an op of its run, in ``seq_id`` order (:meth:`~ringtune.gateway.dispatch.Dispatcher.ordered`). A LoRA
run's forward(_backward) may share one pass over the base with other LoRA runs' waiting requests
(:mod:`ringtune.gateway.passes`); an optimizer step may be followed by an autosave (:mod:`ringtune.gateway.autosave`)
in the same job. Every method runs on the event loop thread.
"""

from __future__ import annotations

from typing import Any

from ringtune.errors import UserInputError
from ringtune.gateway import proto, translate
from ringtune.gateway.autosave import Autosaver
from ringtune.gateway.backend import Backend
from ringtune.gateway.dispatch import Commit, Dispatcher
from ringtune.gateway.futures import Outcome
from ringtune.gateway.passes import PassPart, pass_kind, run_pass
from ringtune.gateway.refusal import refusing_bad_input
from ringtune.gateway.routing_records import RoutingRecords
from ringtune.gateway.runs import RunBook
from ringtune.gateway.stability_records import StabilityRecords
from ringtune.gateway.wire import OptimStepBody


class TrainingOps:
    """The training verbs over ``runs`` (lookups), ``backend``, ``dispatcher`` (per-run order, joined LoRA passes
    when its executor joins more than one run), ``autosave``, ``routing`` (MoE routing replay, or None) and
    ``stability`` (the sampler's records that ``stable_reinforce`` provenance resolves against, or None)."""

    def __init__(
        self,
        runs: RunBook,
        backend: Backend,
        dispatcher: Dispatcher,
        autosave: Autosaver,
        routing: RoutingRecords | None,
        stability: StabilityRecords | None = None,
    ) -> None:
        self.runs, self.backend, self.dispatcher = runs, backend, dispatcher
        self.autosave, self.routing, self.stability = autosave, routing, stability

    def forward_backward(self, body: bytes) -> dict[str, Any]:
        """Protobuf ``ForwardBackwardRequest`` (``forward_only`` for forward); result: protobuf output.
        RefusedError 400 for a body that does not decode."""
        with refusing_bad_input():
            msg = proto.parse_request(body)
        record = self.runs.run(msg.model_id)
        run_id, backend, routing, stability = record.run_id, self.backend, self.routing, self.stability

        def job() -> tuple[Outcome, Commit | None]:  # the request alone: a pass of one part
            return run_pass(backend, [PassPart(run_id, msg)], routing, stability)[0]

        join = None
        kind = pass_kind(msg) if record.lora is not None and self.dispatcher.executor.max_join > 1 else None
        if kind is not None:  # a LoRA run: may share one pass over the base with other runs' waiting requests
            join = (kind, PassPart(run_id, msg), lambda parts: run_pass(backend, parts, routing, stability))
        op = "forward" if msg.forward_only else "forward_backward"
        return self.dispatcher.ordered(record, msg.seq_id, op, job, join)

    def optim_step(self, body: OptimStepBody) -> dict[str, Any]:
        """AdamW on the run's accumulated gradients (``adam_params`` only), then an autosave if one is due;
        result: the step's metrics."""
        record = self.runs.run(body.model_id)
        run_id = record.run_id

        def job() -> tuple[Outcome, Commit | None]:
            if body.adam_params is None and (body.optimizer_params or body.optim_params):
                other = body.optimizer_params or body.optim_params or {}
                raise UserInputError(
                    f"optimizer_params.type={other.get('type')!r}: only adam_params (AdamW) is supported"
                )
            adam = translate.adam_params(body.adam_params)
            metrics = self.backend.optim_step(run_id, adam)
            commit = self.autosave.after_step(record, int(metrics.get("step:max", 0)))
            return Outcome("json", {"metrics": {k: float(v) for k, v in metrics.items()}, "type": "optim_step"}), commit

        return self.dispatcher.ordered(record, body.seq_id, "optim_step", job)
