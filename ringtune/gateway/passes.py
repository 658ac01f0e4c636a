"""A ``forward_backward`` / ``forward`` request run as one pass: a single run's, or several LoRA runs' joined
into one pass over their shared base (multi-adapter batching).

:func:`run_pass` is the job body of every such request (one part: :meth:`Backend.forward_backward`). Each
LoRA run's ``forward_backward`` / ``forward`` is queued on the backend thread under its run's key as a
*joinable* job (:meth:`~ringtune.gateway.scheduler.FairExecutor.submit_joinable`) of kind :func:`pass_kind`:
the loss function, its config and ``forward_only``. When one comes up, the requests of the same kind at the
head of other runs' queues (up to ``--lora-pass-runs``) run with it as one backend call
(:meth:`~ringtune.gateway.backend.Backend.forward_backward_many`). Only a run's *next* op can join, so each
run's ops keep their ``seq_id`` order, and a request waits for nobody: it joins whatever is waiting when its
turn comes.

A ``stable_reinforce`` request's provenance is resolved here, before the backend call
(:mod:`ringtune.gateway.provenance`): a datum whose spans do not match the records fails its request alone
with ``category: user``, and nothing of that request reaches a rank. Its answer carries the loss's metrics
(:func:`~ringtune.losses.stable_reinforce_metrics`) beside the engine's.

Each request still gets exactly its own answer: its outputs and loss, its own error for a bad request
(decoded here, checked per run on the ranks), and its metrics line. A rank failure fails every request of
the pass with ``category: server``, as it would fail each alone.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from ringtune.errors import RankFailedError, UserInputError
from ringtune.gateway import proto, translate
from ringtune.gateway.backend import Backend
from ringtune.gateway.futures import Outcome
from ringtune.gateway.images import image_decoder
from ringtune.gateway.provenance import LOSS_WITH_PROVENANCE, resolve_provenance
from ringtune.gateway.routing_records import RoutingRecords, attach_routing
from ringtune.gateway.stability_records import StabilityRecords
from ringtune.losses import parse_loss_config, stable_reinforce_metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PassPart:
    """One run's request in a pass: its run id and its parsed protobuf ``ForwardBackwardRequest``."""

    run_id: str
    msg: Any


def pass_kind(msg: Any) -> Hashable | None:
    """Requests of equal kind may share a pass: ``("lora_pass", loss_fn, forward_only, loss config)``; None
    when the config cannot be read here (the request then runs alone and gets its own error)."""
    try:
        call_config = proto.decode_loss_config(msg)
    except UserInputError:
        return None
    return ("lora_pass", msg.loss_fn, bool(msg.forward_only), tuple(sorted(call_config.items())))


def run_pass(
    backend: Backend,
    parts: list[PassPart],
    routing: RoutingRecords | None,
    stability: StabilityRecords | None = None,
) -> list[tuple[Outcome, None]]:
    """Decode each part (resolving ``stable_reinforce`` provenance against ``stability``), run the good ones in
    one backend call (one alone: :meth:`Backend.forward_backward`), and encode each answer. Never raises: every
    part gets its outcome."""
    outcomes: list[Outcome | None] = [None] * len(parts)
    ready: list[tuple[int, list, int]] = []  # (part index, engine datums, tokens given replayed routing)
    loss_fn, forward_only, config = parts[0].msg.loss_fn, bool(parts[0].msg.forward_only), None
    images = image_decoder(backend.info())  # the first served model's (single-model servers take images)
    data_of: dict[int, list] = {}
    for i, part in enumerate(parts):
        try:
            call = proto.decode_request(part.msg, accept_images=images is not None)
            data = translate.train_data(call, images)
            config = translate.loss_config(call.loss_config)
            replayed = 0
            if call.loss_fn == LOSS_WITH_PROVENANCE:
                if stability is None:
                    raise UserInputError("loss_fn='stable_reinforce': this server keeps no stability records")
                data, replayed = resolve_provenance(call.data, data, stability)
            if routing is not None:  # R3: the experts the sampler used, where a datum matches a sample
                data, matched = attach_routing(data, routing)
                replayed += matched
            ready.append((i, data, replayed))
            data_of[i] = data
        except UserInputError as exc:
            outcomes[i] = Outcome.error(str(exc), "user")
    try:
        if len(ready) == 1:
            i, data, _ = ready[0]
            results: list[Any] = [backend.forward_backward(parts[i].run_id, data, loss_fn, config, forward_only)]
        elif ready:
            run_ids = [parts[i].run_id for i, _, _ in ready]
            results = backend.forward_backward_many(run_ids, [d for _, d, _ in ready], loss_fn, config, forward_only)
        else:
            results = []
    except RankFailedError as exc:  # a rank failed or died: every request of the pass failed with it
        log.error("LoRA pass of %s failed: %s", [parts[i].run_id for i, _, _ in ready], exc)
        results = [Outcome.error(str(exc), "server")] * len(ready)
    except UserInputError as exc:  # one request alone: its own error
        results = [Outcome.error(str(exc), "user")]
    except Exception as exc:
        log.exception("LoRA pass of %s failed", [parts[i].run_id for i, _, _ in ready])
        results = [Outcome.error(f"internal error: {type(exc).__name__}: {exc}", "server")] * len(ready)
    for (i, _, replayed), result in zip(ready, results, strict=True):
        if isinstance(result, Outcome):
            outcomes[i] = result
        elif isinstance(result, UserInputError):
            outcomes[i] = Outcome.error(str(result), "user")
        elif isinstance(result, Exception):  # this run's own server error (a restored run's notice)
            outcomes[i] = Outcome.error(str(result), "server")
        else:
            outputs, metrics = result
            if routing is not None:
                metrics = {**metrics, "routing_replay_tokens:sum": float(replayed)}
            if loss_fn == LOSS_WITH_PROVENANCE and outputs:
                metrics = {**metrics, **_stable_metrics(parts[i].msg, data_of[i], outputs)}
            try:
                arrays = [{k: v.detach().cpu().numpy() for k, v in o.items()} for o in outputs]
                outcomes[i] = Outcome("proto", proto.encode_output(arrays, metrics))
            except Exception as exc:
                log.exception("encoding the answer of %s failed", parts[i].run_id)
                outcomes[i] = Outcome.error(f"internal error: {type(exc).__name__}: {exc}", "server")
    return [(outcome, None) for outcome in outcomes]  # type: ignore[misc]


def _stable_metrics(msg: Any, data: list, outputs: list) -> dict[str, float]:
    """stable_reinforce's metrics of one answered request (its resolved datums, its per-datum outputs)."""
    config = parse_loss_config(msg.loss_fn, translate.loss_config(proto.decode_loss_config(msg)))
    logprobs = [o["logprobs"].detach().cpu().double() for o in outputs]
    inputs = [
        {k: torch.as_tensor(d.inputs[k], device="cpu").double() for k in ("logprobs", "sampled_mask")} for d in data
    ]
    return stable_reinforce_metrics(config, logprobs, inputs)
