"""The ``ringtune`` command line."""

from __future__ import annotations

import argparse
import sys

from ringtune.debug_faults import DEBUG_FAULTS
from ringtune.ops.cp_modes import ALL_GATED_DELTA_MODES, ATTENTION_MODES
from ringtune.parallel.mesh import DEFAULT_TIMEOUT_S
from ringtune.probes.attention_parity import AttentionShape
from ringtune.probes.attention_parity_run import AttentionParityConfig, run_attention_parity
from ringtune.probes.layer_probe import ProbeSizes
from ringtune.probes.layer_probe_run import LayerProbeConfig, run_layer_probe
from ringtune.probes.scenarios import SCENARIOS


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part for part in text.split(",") if part)


def build_parser() -> argparse.ArgumentParser:
    """The ``ringtune`` parser: one subcommand per tool (attention-parity, probe, serve, demo, parity, plan)."""
    parser = argparse.ArgumentParser(prog="ringtune", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = AttentionParityConfig()
    p = sub.add_parser("attention-parity", help="CP attention variants vs the single-process reference (gloo, CPU)")
    p.add_argument("--cp", type=int, default=d.cp, help="CP size (ranks spawned on this host)")
    p.add_argument("--modes", type=_csv, default=d.modes, help="comma list of ring,allgather,alltoall")
    p.add_argument("--dtype", default=d.dtype, choices=["float64", "float32", "bfloat16"])
    p.add_argument("--scenarios", type=_csv, default=d.scenarios, help=f"comma list of {','.join(SCENARIOS)}")
    p.add_argument("--heads", type=int, default=d.shape.heads)
    p.add_argument("--kv-heads", type=int, default=d.shape.kv_heads)
    p.add_argument("--head-dim", type=int, default=d.shape.head_dim)
    p.add_argument("--scale", type=float, default=d.shape.scale)
    p.add_argument("--sharpness", type=float, default=d.shape.sharpness)
    p.add_argument("--seed", type=int, default=d.seed)
    _add_probe_parser(sub)
    _add_serve_parser(sub)
    _add_demo_parser(sub)
    _add_parity_parser(sub)  # parity client (issue 11)
    _add_plan_parser(sub)  # memory planner (issue 12)
    return parser


def _add_parity_parser(sub: argparse._SubParsersAction) -> None:
    from ringtune.parity.command import add_parity_parser

    add_parity_parser(sub)


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from ringtune.plan.command import add_plan_parser

    add_plan_parser(sub)


def _add_demo_parser(sub: argparse._SubParsersAction) -> None:
    from ringtune.demo.command import add_demo_parser

    add_demo_parser(sub)


GATEWAY_OPTIONS = (
    (
        "--max-live-runs",
        int,
        "max_live_runs",
        "memory for training runs, in full fine-tuning runs of the model (a LoRA run costs its adapters' state)",
    ),
    ("--autosave-every", int, "autosave_every", "autosave each run every N optimizer steps (0: off)"),
    (
        "--autosave-minutes",
        float,
        "autosave_minutes",
        "autosave a run after a step once M minutes passed since its last save (0: off)",
    ),
    (
        "--sample-slice",
        float,
        "sample_slice_s",
        "seconds a generation decodes per turn before other clients' ops run (0: each runs to its end)",
    ),
    (
        "--lora-pass-runs",
        int,
        "lora_pass_runs",
        "join the waiting forward(_backward) requests of up to N LoRA runs into one pass over the shared base "
        "(1, the default: each alone; slower on CPU, see docs/lora.md)",
    ),
)
"""``serve`` options that set a :class:`~ringtune.gateway.config.GatewayConfig` field: (flag, type, field, help);
the default is the field's."""


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from ringtune.gateway.config import GatewayConfig
    from ringtune.models.checkpoints.load import EMBEDDED_DEFAULT

    d = GatewayConfig(checkpoint_root="")
    p = sub.add_parser("serve", help="the Tinker API (HTTP gateway) over DPxCP worker ranks")
    p.add_argument(
        "--model",
        action="append",
        default=None,
        help=f"HF checkpoint dir, .gguf file, or {EMBEDDED_DEFAULT} (the default), or NAME=SOURCE; give it once per "
        "base model to serve several on the same ranks (docs/operations.md)",
    )
    p.add_argument("--model-name", default=None, help="base_model name clients pass (one --model; default: --model)")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer dir of the first model (default: the model dir if it has one)"
    )
    p.add_argument(
        "--model-live-runs",
        action="append",
        default=None,
        metavar="NAME=N",
        help="model NAME's memory budget in its full fine-tuning runs instead of --max-live-runs (0: only sampled)",
    )
    p.add_argument(
        "--memory-per-rank",
        default=None,
        help="memory a rank may use (e.g. 80GiB): start-up refuses a model set that does not fit (default: the "
        "device's; with one model checked only when given)",
    )
    p.add_argument(
        "--tokenizer-id",
        default=None,
        help="get_info's tokenizer_id for remote clients, e.g. a hub id (default: the tokenizer's hub id if known, "
        "else its local dir)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--checkpoint-root", default="ringtune-checkpoints", help="where runs and checkpoints live")
    p.add_argument("--api-key", default=None, help="require this X-API-Key (must start with tml-)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--max-tokens-per-rank", type=int, default=None, help="per-rank token budget")
    budget.add_argument("--context-length", type=int, default=None, help="longest datum (default 8192)")
    from ringtune.models.precision import DEFAULT_PRECISION, PRECISIONS

    p.add_argument(
        "--dtype",
        default=None,
        choices=list(PRECISIONS),
        help="precision: parameters and compute in one dtype, bf16-mixed (float32 masters, bfloat16 layers) or "
        "bf16-exact (bf16-mixed's values with float64 arithmetic: sampler and trainer agree to the bit; slower); "
        f"default {DEFAULT_PRECISION} on CPU, bf16-mixed on CUDA (docs/gpu.md)",
    )
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (ranks per packed row)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (rows in parallel)")
    p.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size for MoE models (divides dp x cp; docs/moe.md)"
    )
    p.add_argument(
        "--router-aux-loss-coef",
        type=float,
        default=0.0,
        help="MoE load-balancing auxiliary loss weight (0: none, as Tinker's losses; docs/moe.md)",
    )
    p.add_argument(
        "--attention", default=None, choices=ATTENTION_MODES, help="CP attention mode (default: the first that fits)"
    )
    p.add_argument(
        "--linear-cp-mode",
        default=None,
        choices=ALL_GATED_DELTA_MODES,
        help="CP GatedDeltaNet mode (default: the first that fits the model's heads)",
    )
    p.add_argument(
        "--freeze-vision",
        action="store_true",
        help="full fine-tuning of a VL model leaves its vision tower as loaded (LoRA never adapts it; docs/vision.md)",
    )
    from ringtune.models.recompute import RECOMPUTE_MODES

    p.add_argument(
        "--recompute", default=RECOMPUTE_MODES[0], choices=RECOMPUTE_MODES, help="activation recomputation per layer"
    )
    from ringtune.engine.sharding import SHARDINGS

    p.add_argument(
        "--shard-params",
        default=SHARDINGS[0],
        choices=SHARDINGS,
        help="FSDP2 sharding of parameters, gradients and AdamW state: none (replicated), dp (over DP, replicated "
        "over CP) or dp_cp (over all DP x CP ranks, least memory; with --ep the experts over their replicas)",
    )
    p.add_argument(
        "--mesh-prompt-tokens",
        type=int,
        default=None,
        help="max_tokens=1 sampling (compute_logprobs) of prompts this long runs on all ranks (default: the budget)",
    )
    p.add_argument(
        "--collective-timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds a rank waits for a failed peer"
    )
    from ringtune.parallel.liveness import DEFAULT_TIMEOUT_S as LIVENESS_TIMEOUT_S

    p.add_argument(
        "--liveness-timeout",
        type=float,
        default=LIVENESS_TIMEOUT_S,
        help="seconds without a heartbeat before a rank on another host is dead (ranks on this host: the OS says)",
    )
    for flag, kind, name, text in GATEWAY_OPTIONS:
        p.add_argument(flag, type=kind, default=getattr(d, name), help=text)
    p.add_argument(
        "--shared-decode",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode every sampling request on one base model in one batch per rank, LoRA adapters of several runs "
        "included (--no-shared-decode: each request's rows decode in a batch of their own)",
    )
    p.add_argument(
        "--routing-replay",
        action="store_true",
        help="MoE models: record the experts the sampler chose and replay them when a training datum matches a "
        "sampled sequence (R3; docs/moe.md)",
    )
    p.add_argument(
        "--restore-live-runs",
        action="store_true",
        help="bring back the runs that were live when the previous server on this --checkpoint-root stopped, from "
        "their newest checkpoints (always on when torchrun restarts the server)",
    )
    p.add_argument("--autosave-keep", type=int, default=d.autosave_keep, help="autosaves kept per run (older deleted)")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="times rank 0 restarts dead worker ranks and restores the live runs (one machine; under torchrun use "
        "torchrun's --max-restarts)",
    )
    p.add_argument("--max-body-mb", type=int, default=d.max_body_bytes // 2**20)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    from ringtune.worker.vllm_options import add_sampler_options

    add_sampler_options(p)  # --sampler builtin|vllm and the engine's --vllm-* options
    # Parity negative controls only (ringtune.debug_faults): hidden from --help, never for real training.
    p.add_argument("--debug-fault", default=None, choices=DEBUG_FAULTS, help=argparse.SUPPRESS)


def _add_probe_parser(sub: argparse._SubParsersAction) -> None:
    d, z = LayerProbeConfig(), ProbeSizes()
    p = sub.add_parser(
        "probe",
        help="GDN, gated attention, MoE MLP and vision tower: CP 2/4/8 vs no CP, cosines and norm ratios (gloo, CPU)",
    )
    p.add_argument("--cp", type=int, nargs="+", default=list(d.cps), help="CP sizes (one world each)")
    p.add_argument("--layers", type=_csv, default=d.layers, help="comma list of gdn,attention,moe,vision")
    p.add_argument("--gdn-modes", type=_csv, default=d.gdn_modes, help="comma list of headwise,chunkwise")
    p.add_argument("--attention-modes", type=_csv, default=d.attention_modes, help="ring,allgather,alltoall")
    p.add_argument("--moe-modes", type=_csv, default=d.moe_modes, help="replicated,expert_parallel")
    p.add_argument("--dtype", default=d.dtype, choices=["float64", "float32", "bfloat16"])
    p.add_argument("--tokens", type=int, default=d.tokens, help="tokens of the packed row")
    p.add_argument("--scale", type=int, default=z.scale, help="divide hidden size and head dims by this")
    p.add_argument("--hidden", type=int, default=z.hidden)
    p.add_argument("--gdn-k-heads", type=int, default=z.gdn_k_heads)
    p.add_argument("--gdn-v-heads", type=int, default=z.gdn_v_heads)
    p.add_argument("--gdn-head-dim", type=int, default=z.gdn_head_dim)
    p.add_argument("--attn-heads", type=int, default=z.attn_heads)
    p.add_argument("--attn-kv-heads", type=int, default=z.attn_kv_heads)
    p.add_argument("--attn-head-dim", type=int, default=z.attn_head_dim)
    p.add_argument("--no-attention-gate", action="store_true", help="drop the attention output gate")
    p.add_argument("--attention-sharpness", type=float, default=None, help="target attention logit std")
    p.add_argument("--seed", type=int, default=d.seed)


def _probe_config(args: argparse.Namespace) -> LayerProbeConfig:
    sizes = ProbeSizes(
        hidden=args.hidden,
        gdn_k_heads=args.gdn_k_heads,
        gdn_v_heads=args.gdn_v_heads,
        gdn_head_dim=args.gdn_head_dim,
        attn_heads=args.attn_heads,
        attn_kv_heads=args.attn_kv_heads,
        attn_head_dim=args.attn_head_dim,
        attention_gate=not args.no_attention_gate,
        scale=args.scale,
    )
    return LayerProbeConfig(
        cps=tuple(args.cp),
        layers=args.layers,
        gdn_modes=args.gdn_modes,
        attention_modes=args.attention_modes,
        moe_modes=args.moe_modes,
        dtype=args.dtype,
        tokens=args.tokens,
        sizes=sizes,
        attention_sharpness=args.attention_sharpness,
        seed=args.seed,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand ``argv`` names (default: ``sys.argv``); its exit code (2: a bad option or setting)."""
    args = build_parser().parse_args(argv)
    if args.command == "attention-parity":
        unknown = [s for s in args.scenarios if s not in SCENARIOS]
        if unknown:
            print(f"error: --scenarios {unknown} unknown; choose from {list(SCENARIOS)}", file=sys.stderr)
            return 2
        config = AttentionParityConfig(
            cp=args.cp,
            modes=args.modes,
            dtype=args.dtype,
            scenarios=args.scenarios,
            shape=AttentionShape(
                heads=args.heads,
                kv_heads=args.kv_heads,
                head_dim=args.head_dim,
                scale=args.scale,
                sharpness=args.sharpness,
            ),
            seed=args.seed,
        )
        return 0 if run_attention_parity(config) else 1
    if args.command == "probe":
        return 0 if run_layer_probe(_probe_config(args)) else 1
    if args.command == "serve":
        from ringtune.errors import UserInputError
        from ringtune.worker.serve_command import run_serve

        try:
            return run_serve(args)
        except UserInputError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.command == "demo":
        from ringtune.demo.command import run_demo_command

        return run_demo_command(args)
    if args.command == "plan":
        from ringtune.plan.command import run_plan_command

        return run_plan_command(args)
    if args.command == "parity":
        from ringtune.parity.command import run_parity_command

        return run_parity_command(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
