"""A ``stable_reinforce`` datum's provenance spans resolved against the sampler's records.

``Datum.with_provenance`` attaches two lists of runs (:class:`~ringtune.gateway.proto.ProvenanceSpan`): one tiling
the datum's input tokens, one tiling its loss rows (``target_tokens``). Each run claims that its positions are
positions ``[offset, offset + length)`` of a recorded sequence's prompt (a prompt run) or of its sampled tokens (a
sampled run). :func:`resolve_provenance` checks the claims against :mod:`ringtune.gateway.stability_records`
and gives the engine what the loss needs; any failed check is a :class:`~ringtune.errors.UserInputError` naming
the datum, the position and the sequence, raised before anything is sent to a rank.

Rules (ringtune's; the SDK documents the spans, not the server's checks):

- Every datum of a ``stable_reinforce`` request carries provenance (the cookbook refuses to send one without);
  the runs of each list tile their field exactly (lengths sum to N); every named sequence is recorded (sampled
  with ``record_stability_info=True``, not evicted, not expired) and every run lies inside it.
- Input tokens: a prompt run's tokens equal the recorded prompt's, a sampled run's the recorded sampled tokens.
- Loss rows: a sampled run's ``target_tokens`` equal the recorded sampled tokens; those rows are the *sampled
  rows* (``sampled_mask`` 1) and their ``logprobs`` become the recorded sampler log-probs (whatever the client
  sent there). A prompt run's rows are attribution only: their targets are not checked (``rl_loop`` sends 0
  there) and the loss gives them 0.
- MoE routing: where the records hold routing (``--routing-replay`` on a MoE model), each input position takes
  the experts its recorded token was fed with (a prompt run: the prompt position; a sampled run: the sampled
  token, whose routing exists for every sampled token but the last); other positions keep −1 (router's choice).

Other losses ignore provenance (the cookbook attaches it to every RL datum whose actions have a ``sequence_id``,
which every sequence this server returns has).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from ringtune.engine.batch import TrainDatum
from ringtune.errors import UserInputError
from ringtune.gateway.proto import ProvenanceSpan, WireDatum
from ringtune.gateway.stability_records import SequenceRecord, StabilityRecords

LOSS_WITH_PROVENANCE = "stable_reinforce"
"""The loss that reads provenance."""


def _record(records: StabilityRecords, sequence_id: str, where: str) -> SequenceRecord:
    record = records.get(sequence_id)
    if record is None:
        raise UserInputError(
            f"{where}: sequence_id={sequence_id!r} has no stability record on this server (sample with "
            f"record_stability_info=True; records are evicted beyond {records.max_tokens} tokens and expire "
            f"{records.ttl_s / 3600:g} h after their session's last use)"
        )
    return record


def _check_tiling(spans: tuple[ProvenanceSpan, ...], n: int, field: str, i: int) -> None:
    total = sum(span.length for span in spans)
    if total != n or any(span.length < 0 or span.offset < 0 for span in spans):
        raise UserInputError(
            f"data[{i}].{field}: the runs cover {total} positions but the field has {n}; they must tile it exactly "
            f"(lengths and offsets >= 0)"
        )


def _recorded(record: SequenceRecord, span: ProvenanceSpan, where: str) -> tuple[int, ...]:
    """The recorded tokens the run claims: ``prompt`` or ``tokens`` ``[offset, offset + length)``."""
    source = record.tokens if span.sampled else record.prompt
    if span.offset + span.length > len(source):
        what = "sampled tokens" if span.sampled else "prompt"
        raise UserInputError(
            f"{where}: positions [{span.offset}, {span.offset + span.length}) of sequence {span.sequence_id!r}'s "
            f"{what}, which holds {len(source)}"
        )
    return source[span.offset : span.offset + span.length]


def _mismatch(i: int, field: str, pos: int, got: int, span: ProvenanceSpan, at: int, want: int) -> UserInputError:
    what = "sampled token" if span.sampled else "prompt token"
    return UserInputError(
        f"data[{i}].{field}[{pos}]={got} does not match sequence {span.sequence_id!r}: its recorded {what} "
        f"{at} is {want} (provenance must name the tokens that were sampled)"
    )


def resolve_datum(i: int, wire: WireDatum, datum: TrainDatum, records: StabilityRecords) -> tuple[TrainDatum, int]:
    """Datum ``i`` with ``logprobs`` and ``sampled_mask`` resolved (and ``routing`` where recorded), and how
    many input tokens got a recorded routing; UserInputError on any failed check (module docstring)."""
    if wire.model_input_spans is None or wire.loss_fn_input_spans is None:
        raise UserInputError(
            f"data[{i}]: loss_fn='stable_reinforce' needs provenance (Datum.with_provenance) naming sequences "
            f"sampled with record_stability_info=True; this datum has none"
        )
    tokens = wire.tokens
    targets = wire.inputs.get("target_tokens")
    if targets is None or targets.ndim != 1 or targets.shape[0] != tokens.shape[0]:
        shape = None if targets is None else list(targets.shape)
        raise UserInputError(f"data[{i}].loss_fn_inputs['target_tokens']: shape {shape}, expected [{len(tokens)}]")
    n = int(tokens.shape[0])
    _check_tiling(wire.model_input_spans, n, "model_input_spans", i)
    _check_tiling(wire.loss_fn_input_spans, n, "loss_fn_input_spans", i)
    routing: torch.Tensor | None = None
    pos = 0
    for j, span in enumerate(wire.model_input_spans):
        where = f"data[{i}].model_input_spans[{j}]"
        record = _record(records, span.sequence_id, where)
        for k, want in enumerate(_recorded(record, span, where)):
            if int(tokens[pos + k]) != want:
                raise _mismatch(i, "model_input", pos + k, int(tokens[pos + k]), span, span.offset + k, want)
        if record.routing is not None and span.length:
            if routing is None:
                routing = torch.full((n, *record.routing.shape[1:]), -1, dtype=torch.int64, device="cpu")
            first = span.offset + (len(record.prompt) if span.sampled else 0)
            rows = record.routing[first : first + span.length].to(torch.int64)
            routing[pos : pos + rows.shape[0]] = rows
        pos += span.length
    logprobs = wire.inputs.get("logprobs")
    q = np.zeros(n, np.float32) if logprobs is None else logprobs.astype(np.float32).reshape(-1).copy()
    if q.shape[0] != n:
        raise UserInputError(f"data[{i}].loss_fn_inputs['logprobs']: shape {list(logprobs.shape)}, expected [{n}]")
    sampled = np.zeros(n, np.float32)
    pos = 0
    for j, span in enumerate(wire.loss_fn_input_spans):
        where = f"data[{i}].loss_fn_input_spans[{j}]"
        record = _record(records, span.sequence_id, where)
        recorded = _recorded(record, span, where)
        if span.sampled:
            for k, want in enumerate(recorded):
                got = int(targets[pos + k])
                if got != want:
                    raise _mismatch(i, "loss_fn_inputs['target_tokens']", pos + k, got, span, span.offset + k, want)
            q[pos : pos + span.length] = record.logprobs[span.offset : span.offset + span.length]
            sampled[pos : pos + span.length] = 1.0
        pos += span.length
    inputs = {**datum.inputs, "logprobs": torch.from_numpy(q), "sampled_mask": torch.from_numpy(sampled)}
    replayed = 0
    out = replace(datum, inputs=inputs)
    if routing is not None:
        replayed = int((routing[:, 0, 0] >= 0).sum())
        out = replace(out, routing=routing)
    return out, replayed


def resolve_provenance(
    wire: list[WireDatum], data: list[TrainDatum], records: StabilityRecords
) -> tuple[list[TrainDatum], int]:
    """Every datum resolved by :func:`resolve_datum` (all or none: the first failure raises), and the input
    tokens given a recorded routing."""
    out, replayed = [], 0
    for i, (w, d) in enumerate(zip(wire, data, strict=True)):
        resolved, n = resolve_datum(i, w, d, records)
        out.append(resolved)
        replayed += n
    return out, replayed
