"""The settings of ``ringtune demo`` (one frozen dataclass, mirrored by its flags)."""

from __future__ import annotations

from dataclasses import dataclass

from ringtune.errors import UserInputError
from ringtune.models.checkpoints.load import EMBEDDED_DEFAULT


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """What ``ringtune demo`` does (mirrored by its flags).

    Attributes:
        steps: optimizer steps (each one ``forward_backward`` + ``optim_step`` of ``batch_size`` conversations).
        cp: context-parallel size passed to ``ringtune serve --cp``.
        out: output directory (created).
        port: server port; 0 picks a free one.
        model: ``ringtune serve --model`` (the embedded SmolLM2-135M by default; tests pass a tiny HF dir).
        batch_size: conversations per step.
        learning_rate, grad_clip_norm: AdamW settings (betas 0.9/0.95, eps 1e-8, no weight decay).
        context_length: ``ringtune serve --context-length`` (a step's batch fits one row of it).
        held_out_every: every n-th conversation is held out (never trained on).
        eval_every: held-out NLL (a ``forward``) every this many steps too (0: only before and after).
        data_path: a conversation JSONL instead of the packaged ``chat.jsonl``.
        seed: batch order.
        sample_tokens: most tokens of the greedy sample shown before and after fine-tuning.
        lora_rank: 0 = full fine-tuning (the default); R > 0 = a LoRA run of rank R on the shared frozen base
            (``create_lora_training_client(base, rank=R)``, every target group; docs/lora.md).
    """

    steps: int = 20
    cp: int = 2
    out: str = "runs/demo"
    port: int = 0
    model: str = EMBEDDED_DEFAULT
    batch_size: int = 8
    learning_rate: float = 4e-5
    grad_clip_norm: float = 1.0
    context_length: int = 512
    held_out_every: int = 8
    eval_every: int = 5
    data_path: str | None = None
    seed: int = 0
    sample_tokens: int = 32
    lora_rank: int = 0

    def validate(self) -> None:
        """UserInputError naming the field, its value and the limit."""
        checks = (
            ("steps", self.steps, self.steps >= 1, ">= 1"),
            ("cp", self.cp, self.cp >= 1, ">= 1"),
            ("port", self.port, 0 <= self.port <= 65535, "in [0, 65535] (0 = any free port)"),
            ("batch_size", self.batch_size, self.batch_size >= 1, ">= 1"),
            ("sample_tokens", self.sample_tokens, 1 <= self.sample_tokens <= 512, "in [1, 512]"),
            ("learning_rate", self.learning_rate, 0 < self.learning_rate < 1, "in (0, 1)"),
            ("grad_clip_norm", self.grad_clip_norm, self.grad_clip_norm >= 0, ">= 0 (0 = no clipping)"),
            ("context_length", self.context_length, self.context_length >= 64, ">= 64"),
            ("held_out_every", self.held_out_every, self.held_out_every >= 2, ">= 2"),
            ("eval_every", self.eval_every, self.eval_every >= 0, ">= 0 (0 = only before and after)"),
            ("lora_rank", self.lora_rank, 0 <= self.lora_rank <= 1024, "in [0, 1024] (0 = full fine-tuning)"),
        )
        for name, value, ok, limit in checks:
            if not ok:
                raise UserInputError(f"demo setting {name}={value!r} must be {limit}")


LORA_LEARNING_RATE = 4e-4
"""The demo's learning rate for a LoRA run when ``--lr`` is not given: 10x the full fine-tuning one, the ratio
the cookbook's ``get_lora_lr_over_full_finetune_lr`` gives for models of this size (alpha 32)."""
