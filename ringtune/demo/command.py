"""The ``ringtune demo`` subcommand: its flags (mirroring :class:`~ringtune.demo.run.DemoConfig`) and entry."""

from __future__ import annotations

import argparse

from ringtune.demo.config import LORA_LEARNING_RATE, DemoConfig


def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``demo`` to the ``ringtune`` subcommands."""
    d = DemoConfig()
    p = sub.add_parser(
        "demo",
        help="full fine-tuning of the embedded SmolLM2-135M through the tinker SDK against `ringtune serve --cp N`",
    )
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    p.add_argument("--cp", type=int, default=d.cp, help="context-parallel size passed to `ringtune serve --cp`")
    p.add_argument("--out", default=d.out, help="output dir: loss_curve.png, metrics.json, config.json, server.log")
    p.add_argument("--port", type=int, default=d.port, help="server port (0: a free one)")
    p.add_argument("--model", default=d.model, help="what `ringtune serve --model` loads")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="conversations per step")
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"AdamW learning rate (default {d.learning_rate:g}; {LORA_LEARNING_RATE:g} with --lora-rank)",
    )
    p.add_argument(
        "--lora-rank", type=int, default=d.lora_rank, help="0: full fine-tuning (default); R > 0: a LoRA run of rank R"
    )
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="held-out NLL every N steps (0: ends only)")
    p.add_argument("--data", default=None, help="a conversation JSONL instead of the packaged chat.jsonl")
    p.add_argument("--seed", type=int, default=d.seed, help="batch order")


def run_demo_command(args: argparse.Namespace) -> int:
    """Build the config from the parsed flags and run it (exit code of :func:`~ringtune.demo.run.main_demo`)."""
    from ringtune.demo.run import main_demo

    d = DemoConfig()
    config = DemoConfig(
        steps=args.steps,
        cp=args.cp,
        out=args.out,
        port=args.port,
        model=args.model,
        batch_size=args.batch_size,
        learning_rate=args.lr if args.lr is not None else (LORA_LEARNING_RATE if args.lora_rank else d.learning_rate),
        lora_rank=args.lora_rank,
        eval_every=args.eval_every,
        data_path=args.data,
        seed=args.seed,
    )
    return main_demo(config)
