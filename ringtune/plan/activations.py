"""What autograd keeps per token of a rank's shard, per layer type and recompute mode (bytes per token).

Every figure here is an inventory of the tensors the code saves for the backward, read from the code and
checked against autograd's own saved tensors on a tiny model (``tests/test_plan.py`` walks the graph and
counts the storages): no constant is fitted to a memory measurement. ``e`` is the bytes of the compute
dtype (4 float32, 2 bfloat16, 8 float64), ``a`` those of the accumulator the ops compute norms, gates, the
GatedDeltaNet scan and attention statistics in (float32; float64 for float64). When ``e == a`` a cast is a
no-op and the saved copy is the tensor itself, which is why some terms read ``2a + e`` rather than ``3a``.

Per-sequence edge terms (the conv's first K-1 tokens, the chunk scan's first step, padding of the last chunk
of each sequence) are left out: on rows of thousands of tokens they are below 0.5% (measured by the test).
The GatedDeltaNet scan's inventory is in one place, :func:`gdn_scan`, for both scans of
``ops/gated_delta/chunked.py``'s ``CHUNK_SCANS``: ``recompute`` (the default: keeps its inputs and one state
per segment) and ``autograd`` (every intermediate, :data:`GDN_SCAN_SAVED`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ringtune.errors import UserInputError
from ringtune.models.config import DecoderConfig
from ringtune.models.recompute import RECOMPUTE_MODES
from ringtune.ops.gated_delta import CHUNK_SIZE, DEFAULT_CHUNK_SCAN
from ringtune.ops.gated_delta.chunk_scan_recompute import SEGMENT_BYTES, segment_chunks_for

INDEX_BYTES = 8
"""int64 index tensors the ops save (gather / scatter indices), per token."""

GDN_SCAN_SAVED: dict[str, tuple[float, str]] = {
    "cc": (5, "[C, C] per chunk and value head: decay D, K·Kᵀ, A, Q·Kᵀ before and after ⊙ D"),
    "key": (9, "Dk per value head: chunked k and q, k·β, four contiguous copies matmul makes, decayed q and k"),
    "wy": (1, "Dk + Dv per value head: the solved [U | W]"),
    "value": (2, "Dv per value head: chunked v, and v' = U - W·S of every step"),
    "gate": (4, "one per value head: chunked β, exp(G) twice, exp(G_C - G)"),
    "state": (1, "Dk·Dv per value head per chunk: the state entering each step"),
    "index": (2, "int64 per token: the chunk slot map and the output's inverse order"),
}
"""The ``autograd`` scan's saved tensors (``ops/gated_delta/chunk_scan.py``): name -> (count, what), all in ``a``."""


@dataclass(frozen=True)
class Widths:
    """Bytes of one element: ``e`` compute dtype, ``a`` accumulator (see the module docstring)."""

    e: int
    a: int

    @property
    def narrow(self) -> bool:
        return self.e < self.a


def check_mode(mode: str) -> str:
    if mode not in RECOMPUTE_MODES:
        raise UserInputError(f"recompute={mode!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
    return mode


def rms_norm(cfg: DecoderConfig, dim: int, w: Widths, *, zero_centered: bool) -> float:
    """One RMSNorm over ``dim``: the float input (or its float copy), the normalised value, the output, rsqrt.

    Zero-centred (Qwen3.5): ``xf`` and ``normed`` in ``a``, the output (next op's input) in ``e``. Plain
    (Llama, Qwen3): ``xf`` in ``a``, ``normed.to(e)`` and the output in ``e``.
    """
    per = 2 * w.a + w.e if zero_centered else w.a + 2 * w.e
    return per * dim + w.a


def mlp(cfg: DecoderConfig, w: Widths) -> float:
    """SwiGLU: gate and up projections (kept by ``silu_mul``, which recomputes the SiLU in its backward) and their
    product (down's input); a MoE model's MLP: :func:`ringtune.plan.moe.mlp_activations` (every layer taken as
    MoE)."""
    if cfg.has_moe:
        from ringtune.plan.moe import mlp_activations

        return mlp_activations(cfg, w.e)
    return 3 * cfg.intermediate_size * w.e


def attention_core(cfg: DecoderConfig, w: Widths) -> float:
    """What the CP attention op saves (ring, and the local kernel at CP 1): q, stacked k/v, output, lse."""
    q = cfg.num_heads * cfg.head_dim
    return (2 * q + 2 * cfg.num_kv_heads * cfg.head_dim) * w.e + cfg.num_heads * w.a


def attention_parts(cfg: DecoderConfig, w: Widths) -> dict[str, float]:
    """A full-attention decoder layer under ``none``, by part (bytes per token)."""
    zero = cfg.family == "qwen3_5"
    gate = cfg.family == "qwen3_5"  # Qwen3.5's output gate doubles q_proj's output
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qk = 0.0
    if cfg.qk_norm is not None:
        # The norm saves its float input: the q_proj / k_proj output itself when e == a (the q view keeps
        # the whole [q | gate] storage), a float copy of q or k otherwise; then normed (zero-centred: in a,
        # plain: cast to e) and one rsqrt per head.
        normed = w.a if zero else w.e
        q_in = (2 if gate else 1) * q * w.e if not w.narrow else q * w.a
        k_in = kv * w.e if not w.narrow else kv * w.a
        qk = q_in + k_in + (q + kv) * normed + (cfg.num_heads + cfg.num_kv_heads) * w.a
    rotary = 2 * int(cfg.head_dim * cfg.partial_rotary_factor) * w.e  # cos and sin, computed per layer call
    output = (3 if gate else 1) * q * w.e  # sigmoid(gate), attention output, their product (o_proj's input)
    return {
        "norms": 2 * rms_norm(cfg, cfg.hidden_size, w, zero_centered=zero),
        "qk_norm": qk,
        "rotary": rotary,
        "core": attention_core(cfg, w),
        "output": output,
        "mlp": mlp(cfg, w),
    }


def gdn_parts(cfg: DecoderConfig, w: Widths) -> dict[str, float]:
    """A GatedDeltaNet decoder layer under ``none``, by part (bytes per token)."""
    hk, hv, dk, dv = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )
    channels = 2 * hk * dk + hv * dv
    # conv input and SiLU input in a; then the q/k L2 norm's float input: the whole SiLU output when e == a
    # (the q, k views keep it), float copies of q and k otherwise; and one sqrt per key head for q and k.
    l2_in = channels * w.a if not w.narrow else 2 * hk * dk * w.a
    conv = 2 * channels * w.a + l2_in + 2 * hk * w.a
    gates = 2 * hv * w.a + hv * w.e  # softplus input and output (a), sigmoid output (e)
    scan = gdn_scan(cfg, w, DEFAULT_CHUNK_SCAN)
    # gated output norm: float input, z's float copy and SiLU(z) in a; normed, normed·weight, product in e
    # (all six in a when e == a), one rsqrt per value head.
    output = 3 * (w.a + w.e) * hv * dv + hv * w.a
    return {
        "norms": 2 * rms_norm(cfg, cfg.hidden_size, w, zero_centered=True),
        "gates": gates,
        "conv": conv,
        "scan": scan,
        "output": output,
        "mlp": mlp(cfg, w),
    }


def gdn_scan(cfg: DecoderConfig, w: Widths, scan: str) -> float:
    """Bytes per token the chunked scan itself keeps (beyond the conv and gates above), for ``scan``.

    ``recompute``: its prepared inputs, q and k (L2-normed, expanded to value heads) in ``a``; v, β in ``a``
    (when ``e == a`` these are the conv output's and the gate's own storages, counted above; float copies
    otherwise); the log decay g in ``a``; one state [Hv, Dk, Dv] per segment of ``segment_chunks`` chunks.
    ``autograd``: :data:`GDN_SCAN_SAVED`.
    """
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if scan == "recompute":
        chunks = segment_chunks_for(hv, CHUNK_SIZE, dk, dv, w.a, SEGMENT_BYTES)
        copies = (hv * dv + hv) * w.a if w.narrow else 0
        return 2 * hv * dk * w.a + hv * w.a + copies + hv * dk * dv * w.a / (chunks * CHUNK_SIZE)
    s = {k: v for k, (v, _) in GDN_SCAN_SAVED.items()}
    return (
        s["cc"] * hv * CHUNK_SIZE * w.a
        + s["key"] * hv * dk * w.a
        + s["wy"] * hv * (dk + dv) * w.a
        + s["value"] * hv * dv * w.a
        + s["gate"] * hv * w.a
        + s["state"] * hv * dk * dv * w.a / CHUNK_SIZE
        + s["index"] * INDEX_BYTES
    )


def gdn_scan_transient(cfg: DecoderConfig, w: Widths, tokens: int, scan: str = DEFAULT_CHUNK_SCAN) -> float:
    """Bytes the ``recompute`` scan's backward holds at once beyond the layer's saved tensors: one segment
    (``segment_chunks`` chunks, at most the row) rerun under autograd, i.e. the ``autograd`` scan's inventory
    for that segment's tokens. 0 for the ``autograd`` scan (its intermediates are in the layer's inventory)."""
    if scan != "recompute":
        return 0.0
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    segment_tokens = segment_chunks_for(hv, CHUNK_SIZE, dk, dv, w.a, SEGMENT_BYTES) * CHUNK_SIZE
    return gdn_scan(cfg, w, "autograd") * min(segment_tokens, tokens)


def layer_saved(cfg: DecoderConfig, layer_type: str, w: Widths) -> float:
    """Bytes per token a decoder layer keeps under ``none`` (also what a recomputed layer rebuilds)."""
    parts = gdn_parts(cfg, w) if layer_type == "linear_attention" else attention_parts(cfg, w)
    return sum(parts.values())


def layer_kept(cfg: DecoderConfig, layer_type: str, mode: str, w: Widths) -> float:
    """Bytes per token a decoder layer keeps from its forward to its backward under recompute ``mode``.

    ``full``: its input. ``selective``: GatedDeltaNet layers their input; attention layers their input, the
    attention op's saved tensors, its output and the output gate (the arguments of the recomputed tail).
    """
    check_mode(mode)
    if mode == "none":
        return layer_saved(cfg, layer_type, w)
    x = cfg.hidden_size * w.e
    if mode == "full" or layer_type == "linear_attention":
        return x
    q = cfg.num_heads * cfg.head_dim
    gate = q * w.e if cfg.family == "qwen3_5" else 0
    return x + attention_core(cfg, w) + q * w.e + gate


def layer_recomputed(cfg: DecoderConfig, layer_type: str, mode: str, w: Widths) -> float:
    """Bytes per token a layer's backward rebuilds before it runs (0 under ``none``).

    The rebuilt tensors are the ``none`` inventory, less what is kept anyway: the layer input when ``e == a``
    (the first norm saves the input itself), and the attention core under ``selective``.
    """
    if check_mode(mode) == "none":
        return 0.0
    rebuilt = layer_saved(cfg, layer_type, w) - (0 if w.narrow else cfg.hidden_size * w.e)
    if mode == "selective" and layer_type == "full_attention":
        rebuilt -= attention_core(cfg, w)
    return rebuilt


HEAD_BOOKKEEPING = 48
"""Bytes per token the trainer and loss hold through the step besides the model (token ids, targets, the
log-probs, per-token loss terms, the datum map, the embedding's saved ids): counted from
``engine/trainer.py`` (int64 ids, targets, datum index, embedding indices = 32; float32 log-probs and
loss terms = 8, rounded up for the loss's own float64 sums = 48). Empirical only in its rounding."""


def head_kept(cfg: DecoderConfig, w: Widths) -> float:
    """Final norm and the log-prob head (scored indices and targets int64, lse in a, entry mask), per token."""
    final = rms_norm(cfg, cfg.hidden_size, w, zero_centered=cfg.family == "qwen3_5")
    return final + 2 * INDEX_BYTES + w.a + 1 + HEAD_BOOKKEEPING
