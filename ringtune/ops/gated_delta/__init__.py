"""GatedDeltaNet ops over packed THD rows, single process: a plain reference beside each fast version.

- :func:`naive_gated_delta_rule` (per token) and :func:`chunk_gated_delta_rule` (chunked WY), one signature:
  ``fn(q, k, v, cu_seqlens, *, g, beta, initial_state=None, scale=None, use_qk_l2norm=False) -> (o, final_state)``;
  ``g`` and ``beta`` are keyword-only (fla's two naive references take them in different orders).
- :data:`CHUNK_SCANS`: the chunked rule's two scans (``recompute``, the default, keeps only inputs and segment
  states and recomputes in the backward; ``autograd`` keeps every intermediate), one signature, same values.
- :func:`gated_delta_affine_summary`: per segment ``(M, h_local)`` with ``final = M · initial + h_local``,
  folded by :func:`compose_affine_summaries` and applied by :func:`apply_affine_summary` (chunkwise CP).
- :func:`naive_causal_conv1d` / :func:`causal_conv1d`: the short causal conv, reset at ``cu_seqlens``,
  with an optional per-sequence context (the CP conv halo).
- :func:`l2norm`, :func:`gated_rms_norm`, :func:`gdn_gates`: Qwen3.5's q/k norm, output norm and gates.
"""

from ringtune.ops.gated_delta.chunk_scan import CHUNK_SIZE, gated_delta_chunk_scan
from ringtune.ops.gated_delta.chunk_scan_recompute import recomputing_chunk_scan
from ringtune.ops.gated_delta.chunked import CHUNK_SCANS, DEFAULT_CHUNK_SCAN, chunk_gated_delta_rule, chunk_scan_fn
from ringtune.ops.gated_delta.conv import causal_conv1d, naive_causal_conv1d
from ringtune.ops.gated_delta.gates import gdn_gates
from ringtune.ops.gated_delta.inputs import (
    check_cu_seqlens,
    check_gated_delta_inputs,
    compute_dtype,
    prepare_gated_delta_inputs,
)
from ringtune.ops.gated_delta.naive import naive_gated_delta_rule
from ringtune.ops.gated_delta.norm import gated_rms_norm, l2norm
from ringtune.ops.gated_delta.summary import (
    apply_affine_summary,
    compose_affine_summaries,
    gated_delta_affine_summary,
)

__all__ = [
    "CHUNK_SCANS",
    "CHUNK_SIZE",
    "DEFAULT_CHUNK_SCAN",
    "apply_affine_summary",
    "causal_conv1d",
    "check_cu_seqlens",
    "check_gated_delta_inputs",
    "chunk_gated_delta_rule",
    "chunk_scan_fn",
    "compose_affine_summaries",
    "compute_dtype",
    "gated_delta_affine_summary",
    "gated_delta_chunk_scan",
    "gated_rms_norm",
    "gdn_gates",
    "l2norm",
    "naive_causal_conv1d",
    "naive_gated_delta_rule",
    "prepare_gated_delta_inputs",
    "recomputing_chunk_scan",
]
