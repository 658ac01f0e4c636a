"""The reduced copy of the replicated gradients that :mod:`ringtune.engine.grad_overlap` holds, by phase of the step.

When a replicated layout (``shard="none"``, EP 1, DP·CP > 1) runs a step's only ``forward_backward``, its
gradients are packed into flat buckets and all-reduced while the last microbatch's backward runs, last bucket
first, and the reduced buffers are held until ``optim_step`` copies them in (then freed, before AdamW). So a rank
holds, beside its own gradients:

- during the backward of decoder layer i: the buckets of everything after it (layers i+1.., the final norm and an
  untied ``lm_head``; a bucket is packed and launched once all its members are ready, so layer i's own bucket
  is not held yet; buckets of :data:`~ringtune.engine.gradients.BUCKET_BYTES` may reach one layer earlier, not
  modelled);
- from the request's end to ``optim_step``: one whole copy of the trainable parameters' gradients (phase
  ``reduced gradients``), in the parameters' dtype (float32 masters under bf16-mixed).

Sharded layouts (FSDP reduce-scatters during backward) and EP > 1 (reduced at ``optim_step``) hold none.
"""

from __future__ import annotations

REDUCED_PHASE = "reduced gradients"
"""The phase between the request's end and ``optim_step``: static terms plus the whole reduced copy."""


def overlap_applies(shard: str, ep: int, ranks: int) -> bool:
    """Whether the step's gradients are reduced during backward (:class:`~ringtune.engine.grad_sync.ReplicatedSync`
    with a DP×CP group of more than one rank)."""
    return shard == "none" and ep == 1 and ranks > 1


def add_reduced_gradients(
    phases: dict[str, tuple[float, float, float]],
    *,
    shard: str,
    ep: int,
    ranks: int,
    layer_params: list[float],
    after_layers: float,
    whole: float,
    param_bytes: int,
) -> None:
    """Add the reduced copy to ``phases`` (name -> (activations, constants, communication) bytes, as
    :func:`~ringtune.plan.estimate.estimate` builds them), in place: to each ``layer i`` phase's communication the
    buckets after layer i (``layer_params[j]`` elements of layer j, ``after_layers`` those of the final norm and an
    untied head); a phase :data:`REDUCED_PHASE` holding ``whole`` elements (every
    trainable parameter of this rank). ``param_bytes``: bytes per element. Nothing where it does not apply."""
    if not overlap_applies(shard, ep, ranks):
        return
    for i in range(len(layer_params)):
        name = f"layer {i}"
        if name in phases:
            held = (sum(layer_params[i + 1 :]) + after_layers) * param_bytes
            activations, constants, communication = phases[name]
            phases[name] = (activations, constants, communication + held)
    phases[REDUCED_PHASE] = (0.0, 0.0, whole * param_bytes)
