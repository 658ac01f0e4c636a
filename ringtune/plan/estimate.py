"""One layout's predicted per-rank peak memory of a training step (forward_backward + optim_step), by term.

The step's memory is static (parameters, gradients, AdamW moments, a bf16 compute copy) plus what lives
at the step's worst moment. :func:`estimate` walks the step's phases and takes the largest:

- ``head``: the start of the backward: every layer's kept activations, the final norm's and the head's,
  and the head's backward tile (:func:`head_transient`);
- ``layer i``: the backward of decoder layer i (last to first): the kept activations of layers 0..i, what
  layer i's recomputation rebuilds, its backward working set (:data:`BACKWARD_WORK`) and its CP buffers;
- ``optimizer``: the AdamW step (foreach temporaries, one parameter-sized list);
- ``reduced gradients`` (replicated, DP·CP > 1): the reduced copy of the gradients held from the request's end to
  ``optim_step`` (:mod:`ringtune.plan.grad_overlap`, which also adds its buckets to the layer phases).

A vision-language config adds its vision tower (:mod:`ringtune.plan.vision`): its parameters (sharded, copied
and updated like the decoder's; the tower counted as one FSDP unit) and, for ``image_tokens`` image tokens per
row, the activations of the patches this rank encodes, kept through the whole backward, and a last phase
``vision`` (the tower's backward).

Beside the step, a rank holds its sampler snapshots (``sampler_snapshots``, :func:`snapshot_bytes` each: the
sampler pool keeps whole inference copies of run weights, :mod:`ringtune.engine.snapshot`), counted in every
phase. Every term is bytes on one rank; ``tokens`` is the rank's share of the packed row (its zigzag shard).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ringtune.engine.sharding import SHARDINGS as SHARD_NAMES
from ringtune.errors import UserInputError
from ringtune.models.config import DecoderConfig
from ringtune.models.logprob_tiles import tile_shape
from ringtune.plan import activations as act
from ringtune.plan import grad_overlap as overlap
from ringtune.plan import moe
from ringtune.plan import vision as vis

PRECISIONS: dict[str, tuple[int, int, int, int]] = {
    # name: (compute bytes e, parameter bytes, gradient bytes, AdamW moment bytes per parameter)
    "bf16-mixed": (2, 4, 4, 8),
    "bfloat16": (2, 2, 2, 4),
    "float32": (4, 4, 4, 8),
}
"""Precision options: bf16-mixed = bf16 compute, fp32 master weights, fp32 gradients and moments."""

NOT_PLANNED: dict[str, str] = {
    "float64": "a checking precision (parity references), not one to size GPUs for",
    "bf16-exact": "a CPU precision (bf16 values in float64 arithmetic, for RL numerics; docs/memory.md) whose float64 "
    "layer activations and per-use weight copies the planner does not model",
}
"""Precisions ``ringtune serve --dtype`` takes that the planner does not plan, and why."""


def check_precision_planned(precision: str, field: str = "precision") -> str:
    """``precision`` if the planner plans it, else UserInputError naming the field, the value and the choices."""
    if precision in PRECISIONS:
        return precision
    why = f" ({precision} is {NOT_PLANNED[precision]})" if precision in NOT_PLANNED else ""
    raise UserInputError(f"{field}={precision!r}: choose one of {', '.join(PRECISIONS)}{why}")


BACKWARD_WORK = 0.08
"""A layer's backward working set beyond its saved tensors, as a fraction of its ``none`` inventory:
gradients of its intermediates alive at once (the [C, C] products' gradients in the GatedDeltaNet scan,
the MLP's). EMPIRICAL: read from one measured step (docs/memory.md, 8K tokens, recompute full: 502.5 MiB =
gradients + kept inputs + the rebuilt GDN layer + its gradient in and out + 0.08 of
the rebuilt layer), then checked at other CP sizes, modes and lengths by
benchmarks/plan_check.py."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One way to run: CP·DP ranks, a parameter sharding, recompute, precision.

    ``shard``: a name of :data:`ringtune.engine.sharding.SHARDINGS` (``ringtune serve --shard-params``):
    ``none`` (replicated), ``dp`` (FSDP2 over DP, replicated over CP), ``dp_cp`` (FSDP2 over all DP·CP ranks).
    ``ep``: expert parallelism of a MoE model (``--ep``; routed experts ÷ EP; with ``shard="none"`` or
    ``"dp_cp"``, which shards each EP rank's experts again over its (DP·CP)/EP expert replicas).
    """

    cp: int
    dp: int
    shard: str
    recompute: str
    precision: str
    ep: int = 1

    @property
    def shard_ways(self) -> int:
        """How many ranks split each parameter, gradient and moment (1: replicated)."""
        return {"none": 1, "dp": self.dp, "dp_cp": self.dp * self.cp}[self.shard]


@dataclass(frozen=True)
class Estimate:
    """Predicted per-rank bytes by term; ``peak`` = their sum at the worst phase (``phase``); ``snapshots``: the
    sampler snapshots held beside the step (0 unless asked for)."""

    layout: Layout
    tokens: int
    parameters: float
    gradients: float
    moments: float
    activations: float
    constants: float
    communication: float
    phase: str
    detail: dict[str, float] = field(default_factory=dict)
    snapshots: float = 0.0

    @property
    def peak(self) -> float:
        step = self.parameters + self.gradients + self.moments + self.activations + self.constants
        return step + self.communication + self.snapshots

    def as_dict(self) -> dict:
        return {**asdict(self), "peak": self.peak}


def layer_parameters(cfg: DecoderConfig, layer_type: str, index: int | None = None) -> int:
    """Parameters of one decoder layer (mixer, MLP, two norms), as the modules in ``models/layers`` define them;
    with ``index`` a MoE layer's MLP is its router and shared expert (its routed experts: :mod:`ringtune.plan.moe`)."""
    d = cfg.hidden_size
    mlp = 3 * d * cfg.intermediate_size if index is None else moe.dense_mlp_parameters(cfg, index)
    common = mlp + 2 * d
    if layer_type == "linear_attention":
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        channels = 2 * hk * dk + hv * dv
        mixer = d * channels + d * hv * dv + 2 * d * hv + channels * cfg.linear_conv_kernel_dim + 2 * hv + dv
        return common + mixer + hv * dv * d
    q = cfg.num_heads * cfg.head_dim * (2 if cfg.family == "qwen3_5" else 1)
    kv = cfg.num_kv_heads * cfg.head_dim
    mixer = d * (q + 2 * kv) + cfg.num_heads * cfg.head_dim * d
    if cfg.attention_bias:
        mixer += q + 2 * kv + d
    if cfg.qk_norm is not None:
        mixer += 2 * cfg.head_dim
    return common + mixer


def largest_parameter(cfg: DecoderConfig, layout: Layout) -> float:
    """Elements of the largest parameter tensor this rank holds (its local shard under FSDP): the embedding or
    untied head [V, d], a layer's widest projection, or a MoE layer's fused routed experts [E/EP, 2·I, d]."""
    d = cfg.hidden_size
    widest = max(
        cfg.intermediate_size,
        cfg.num_heads * cfg.head_dim * (2 if cfg.family == "qwen3_5" else 1),
        2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim,
    )
    dense = max(cfg.vocab_size, widest) * d
    experts = cfg.num_experts * 2 * cfg.moe_intermediate_size * d if cfg.has_moe else 0
    ways = layout.shard_ways
    return max(dense / ways, experts / ways) if ways > 1 else max(dense, experts / layout.ep)


def root_parameters(cfg: DecoderConfig) -> int:
    """Embeddings, the untied ``lm_head`` and the final norm (FSDP2's root unit)."""
    return cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2) + cfg.hidden_size


def head_transient(cfg: DecoderConfig, tokens: int, e: int, a: int, weight_bytes: int) -> float:
    """The head's backward beyond its inputs: one logits tile, ``p @ weight`` of the tile, d_hidden in ``a``,
    and for a weight narrower than ``a`` its float block and that block's d_weight (the head's own
    :func:`~ringtune.models.logprob_tiles.tile_shape`, sized from the rank's ``tokens``)."""
    vocab, d = cfg.vocab_size, cfg.hidden_size
    plan = tile_shape(tokens, vocab, d, acc_bytes=a, weight_bytes=weight_bytes)
    chunk_tokens = min(plan.tokens, tokens)
    tile = chunk_tokens * plan.vocab * a
    blocks = 2 * plan.vocab * d * a if weight_bytes < a else 0
    return tile + chunk_tokens * d * a + tokens * d * a + blocks


def comm_per_token(cfg: DecoderConfig, layer_type: str, cp: int, e: int, a: int) -> float:
    """Send and receive buffers of a layer's backward collectives at CP > 1, per token (0 at CP 1).

    GatedDeltaNet (headwise all-to-all or chunkwise relayout): q/k/v/β out and in, and the log decay g in
    ``a``. Ring attention's backward: the incoming K/V, the partial dK/dV sent and received (``a``), dq and
    the rank's own dK/dV accumulators (``a``).
    """
    if cp == 1:
        return 0.0
    if layer_type == "linear_attention":
        channels = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
        channels += cfg.linear_num_value_heads * cfg.linear_value_head_dim
        return 2 * (channels + cfg.linear_num_value_heads) * e + 2 * cfg.linear_num_value_heads * a
    kv = cfg.num_kv_heads * cfg.head_dim
    return 2 * kv * e + 2 * 2 * kv * a + cfg.num_heads * cfg.head_dim * a + 2 * kv * a


ADAMW_TRANSIENT: dict[str, str] = {
    "fused": "the larger of the finite guard's exact trial update (three copies of the largest local parameter; it "
    "runs only where the guard's bound fails, engine/update_guard.py, and is counted as the worst case) and the "
    "global grad norm's float64 square of the largest gradient (two float64 copies), one parameter at a time",
    "torch_default": "one parameter-sized list (torch's foreach AdamW on CUDA)",
}
"""The optimizer phase's transient by the trainer's AdamW kernel (``ringtune.engine.optimizer.ADAMW_KERNELS``):
``fused`` is its CUDA default, so the planner (for GPUs) counts that; ``torch_default`` is what
``benchmarks/plan_check.py`` measures on CPU."""


def snapshot_bytes(cfg: DecoderConfig, layout: Layout) -> float:
    """One sampler snapshot on a rank (:func:`ringtune.engine.snapshot.snapshot_of`): the whole model, gathered
    (FSDP shards and EP experts alike), its decoder layers in the compute dtype under bf16-mixed (the sampler
    computes as the trainer does) and everything else in the parameter dtype."""
    e, pb, _, _ = PRECISIONS[layout.precision]
    types = cfg.layer_types
    layers = sum(layer_parameters(cfg, t, i) + moe.expert_parameters(cfg, i) for i, t in enumerate(types))
    tower = vis.vision_shape(cfg)
    layers += vis.vision_parameters(tower) if tower is not None else 0
    layer_bytes = e if layout.precision == "bf16-mixed" else pb
    return layers * layer_bytes + root_parameters(cfg) * pb


def estimate(
    cfg: DecoderConfig,
    layout: Layout,
    tokens: int,
    *,
    adamw: str = "fused",
    sampler_snapshots: int = 0,
    image_tokens: int = 0,
) -> Estimate:
    """Predicted per-rank peak of one training step of ``tokens`` tokens per rank under ``layout``, the trainer's
    AdamW run by kernel ``adamw`` (:data:`ADAMW_TRANSIENT`), with ``sampler_snapshots`` whole sampler snapshots
    held beside it (:func:`snapshot_bytes` each; 0: the step alone); ``image_tokens``: image-pad tokens of the
    packed row (the whole row, all CP ranks; a vision-language config only)."""
    if adamw not in ADAMW_TRANSIENT:
        raise UserInputError(f"adamw={adamw!r}: choose one of {', '.join(ADAMW_TRANSIENT)}")
    if isinstance(sampler_snapshots, bool) or not isinstance(sampler_snapshots, int) or sampler_snapshots < 0:
        raise UserInputError(f"--sampler-snapshots={sampler_snapshots!r}: must be an integer >= 0")
    check_precision_planned(layout.precision)
    act.check_mode(layout.recompute)
    tower = vis.check_image_tokens(cfg, image_tokens)
    e, pb, gb, mb = PRECISIONS[layout.precision]
    a = 8 if e == 8 else 4
    w = act.Widths(e=e, a=a)
    types = cfg.layer_types
    per_layer = [layer_parameters(cfg, t, i) for i, t in enumerate(types)]
    root = root_parameters(cfg)
    tower_params = vis.vision_parameters(tower) if tower is not None else 0
    total = sum(per_layer) + root + tower_params
    layer_experts = [moe.expert_parameters(cfg, i) / layout.ep for i in range(len(types))]  # this rank's, unsharded
    experts = sum(moe.expert_parameters(cfg, i) for i in range(len(types)))
    if layout.ep < 1 or (experts and cfg.num_experts % layout.ep) or (not experts and layout.ep > 1):
        raise UserInputError(f"ep={layout.ep} must divide the model's num_experts={cfg.num_experts} (1 without MoE)")
    if layout.ep > 1 and layout.shard not in ("none", "dp_cp"):
        raise UserInputError(f"ep={layout.ep} with shard={layout.shard!r}: under EP only shard='dp_cp' (or none)")
    if layout.shard not in SHARD_NAMES:
        raise UserInputError(f"shard={layout.shard!r}: choose one of {', '.join(SHARD_NAMES)}")
    ways = layout.shard_ways
    if layout.ep > 1 and ways > 1 and (cfg.num_experts // layout.ep) % (ways // layout.ep):
        raise UserInputError(
            f"ep={layout.ep} with shard='dp_cp': each rank's {cfg.num_experts // layout.ep} experts must split "
            f"evenly over its {ways // layout.ep} expert replicas"
        )
    # routed experts: ÷ EP; FSDP (dp_cp) shards each EP rank's experts again over its (DP·CP)/EP replicas, so
    # either way a sharded rank holds 1/ways of every expert (engine/expert_sharding.py)
    local_experts = experts / ways if ways > 1 else experts / layout.ep
    mixed = layout.precision == "bf16-mixed"
    detail: dict[str, float] = {"parameter_count": float(total + experts), "expert_parameters_here": local_experts}
    if tower is not None:
        detail["vision_parameters"] = float(tower_params)
        detail["vision_patches_here"] = float(vis.rank_patches(tower, image_tokens, layout.cp))
    if ways > 1:
        shard = total / ways + local_experts
        # the unsharded copy of one layer: its own parameters and this rank's E/EP experts
        biggest = max((n + x for n, x in zip(per_layer, layer_experts, strict=True)), default=0)
        biggest = max(biggest, tower_params)  # the tower as one FSDP unit
        # FSDP2 (over DP or over DP·CP alike): own shards (fp32 masters under bf16-mixed) plus unsharded
        # compute-dtype copies of the root (kept after forward) and of two layers (the current one's all-gather
        # buffer and the prefetched next).
        parameters = shard * pb + (root + 2 * biggest) * e
        # Sharded gradients, plus one layer's unsharded gradient before its reduce-scatter (fp32 reduce
        # under bf16-mixed) and the root's, reduced at the end of the backward.
        gradients = shard * gb + (biggest + root) * (4 if mixed else e)
        moments = shard * mb
    else:
        # bf16-mixed: the decoder layers' bf16 compute copy and its bf16 gradients before the fp32 cast (the
        # root, embeddings and head, computes in float32: no copy)
        parameters = total * pb + ((total - root) * e if mixed else 0)
        gradients = total * gb + ((total - root) * e if mixed else 0)
        moments = total * mb
        parameters += local_experts * (pb + (e if mixed else 0))
        gradients += local_experts * (gb + (e if mixed else 0))
        moments += local_experts * mb
    static_grads = gradients
    kept = [act.layer_kept(cfg, t, layout.recompute, w) * tokens for t in types]
    # the final norm and the head compute in the parameters' dtype (float32 under bf16-mixed)
    head_w = act.Widths(e=pb, a=a) if mixed else w
    head = act.head_kept(cfg, head_w) * tokens
    # the tower's kept activations live from the forward to the end of the backward (it runs first, backs up last)
    tower_kept = vis.kept_per_patch(tower, e, a) * vis.rank_patches(tower, image_tokens, layout.cp) if tower else 0.0
    phases: dict[str, tuple[float, float, float]] = {}  # name -> (activations, constants, communication)
    phases["head"] = (sum(kept) + head + tower_kept, head_transient(cfg, tokens, head_w.e, a, head_w.e), 0.0)
    bookkeeping = act.HEAD_BOOKKEEPING * tokens
    for i in reversed(range(len(types))):
        t = types[i]
        rebuilt = act.layer_recomputed(cfg, t, layout.recompute, w) * tokens
        transient = BACKWARD_WORK * act.layer_saved(cfg, t, w) * tokens + 2 * cfg.hidden_size * e * tokens
        if t == "linear_attention":
            transient += act.gdn_scan_transient(cfg, w, tokens)
        comm = comm_per_token(cfg, t, layout.cp, e, a) * tokens
        if moe.is_moe(cfg, i):
            comm += moe.dispatch_per_token(cfg, layout.ep, e) * tokens
        phases[f"layer {i}"] = (sum(kept[: i + 1]) + rebuilt + bookkeeping + tower_kept, transient, comm)
    if tower_kept:
        phases["vision"] = (tower_kept, BACKWARD_WORK * tower_kept, 0.0)
    if adamw == "fused":  # ADAMW_TRANSIENT: max(trial copies, the norm's float64 .double() and .pow(2))
        optimizer_transient = largest_parameter(cfg, layout) * max(3 * pb, 2 * 8)
    else:
        optimizer_transient = (total / ways + local_experts) * pb  # local_experts: already ÷ ways when sharded
    phases["optimizer"] = (0.0, optimizer_transient, 0.0)
    head_side = cfg.hidden_size + (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    overlap.add_reduced_gradients(
        phases, shard=layout.shard, ep=layout.ep, ranks=layout.dp * layout.cp, param_bytes=pb,
        layer_params=[n + x for n, x in zip(per_layer, layer_experts, strict=True)], after_layers=head_side,
        whole=total + local_experts,
    )  # fmt: skip
    phase = max(phases, key=lambda k: sum(phases[k]))
    activations, constants, communication = phases[phase]
    detail.update({f"phase {k}": sum(v) for k, v in phases.items() if not k.startswith("layer") or k == phase})
    return Estimate(
        layout=layout,
        tokens=tokens,
        parameters=parameters,
        gradients=static_grads,
        moments=moments,
        activations=activations,
        constants=constants,
        communication=communication,
        phase=phase,
        detail=detail,
        snapshots=sampler_snapshots * snapshot_bytes(cfg, layout),
    )
