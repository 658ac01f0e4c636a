"""Start ``ringtune serve`` as a subprocess on a free loopback port (the parity matrix and its tests), and build
the tiny random Qwen3.5 checkpoint the CPU matrix serves."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from ringtune.gateway.serve_process import ServeProcess

API_KEY = "tml-parity"


@dataclass(frozen=True, kw_only=True)
class ServeSpec:
    """One server of the matrix: the ``ringtune serve`` flags that matter for parity."""

    model: str
    cp: int = 1
    dp: int = 1
    dtype: str = "float32"
    linear_cp_mode: str = "headwise"
    attention: str = "ring"
    max_tokens_per_rank: int = 512
    debug_fault: str | None = None
    ep: int = 1

    @property
    def name(self) -> str:
        fault = f"-fault-{self.debug_fault}" if self.debug_fault else ""
        mode = f"-{self.linear_cp_mode}" if self.cp > 1 else ""
        ep = f"-ep{self.ep}" if self.ep > 1 else ""
        return f"cp{self.cp}{mode}-dp{self.dp}{ep}-{self.dtype}{fault}"

    def arguments(self) -> list[str]:
        args = ["--model", self.model, "--cp", str(self.cp), "--dp", str(self.dp), "--dtype", self.dtype]
        args += ["--linear-cp-mode", self.linear_cp_mode, "--attention", self.attention]
        args += ["--max-tokens-per-rank", str(self.max_tokens_per_rank)]
        if self.ep > 1:
            args += ["--ep", str(self.ep)]
        if self.debug_fault:
            args += ["--debug-fault", self.debug_fault]
        return args


@contextmanager
def running_server(spec: ServeSpec, workdir: Path, *, timeout_s: float = 300.0) -> Iterator[str]:
    """``ringtune serve`` with ``spec`` on 127.0.0.1 (log in ``workdir/serve-<name>.log``); yields its URL.

    A :class:`~ringtune.gateway.serve_process.ServeProcess`: waits for ``/api/v1/healthz`` (ServerStartError, a
    RuntimeError with the log's tail, if the server exits or does not come up within ``timeout_s``) and stops
    the server and the ranks it spawned on exit.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    server = ServeProcess(
        spec.model,
        checkpoint_root=workdir / f"ckpt-{spec.name}",
        log_path=workdir / f"serve-{spec.name}.log",
        api_key=API_KEY,
        extra_args=[*spec.arguments(), "--collective-timeout", "60"],
    )
    server.start(timeout_s)
    try:
        yield server.url
    finally:
        server.stop()


BF16_EXACT_MARK = "bf16-exact-weights"
"""File in the tiny model's folder saying its float32 weights are bfloat16 values (see :func:`tiny_qwen35_dir`)."""


def tiny_qwen35_dir(dest: Path, *, seed: int = 0, family: str = "qwen3_5") -> Path:
    """A random tiny Qwen3.5 (``ringtune.testing.tiny_models.hf_model``; ``family="qwen3_5_moe"``: the MoE hybrid,
    routers that differ per token) saved to ``dest`` with a 96-word word-level tokenizer (``w0`` .. ``w95``);
    reused when ``dest`` already holds one.

    Its float32 weights are rounded to bfloat16 once, so a bfloat16 server loads exactly the weights a float32 or
    float64 server holds (every dtype of the matrix computes from the same model).
    """
    if all((dest / name).is_file() for name in ("config.json", "tokenizer.json", BF16_EXACT_MARK)):
        return dest
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    from ringtune.testing.tiny_models import hf_model

    model = hf_model(family, seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
    model.save_pretrained(dest)
    (dest / BF16_EXACT_MARK).write_text("every weight is a bfloat16 value stored as float32\n")
    tokenizer = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(96)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(dest / "tokenizer.json"))
    config = {"tokenizer_class": "TokenizersBackend", "eos_token": "w95", "pad_token": "w94", "unk_token": "w0"}
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


MAX_MATRIX_RANKS = 4
"""Most ranks (DP·CP) of one matrix server: the matrix runs on a CPU machine, several ranks per core."""


def moe_specs(model: str, *, layouts: Sequence[tuple[int, int, int]], dtype: str, row_tokens: int) -> list[ServeSpec]:
    """The MoE model's DP=1, CP=1, EP=1 reference, then each (DP, CP, EP) of ``layouts`` (chunkwise GDN at CP > 1),
    all at the same packed-row budget ``row_tokens`` (``max_tokens_per_rank · CP``)."""
    specs = [ServeSpec(model=model, cp=1, dtype=dtype, max_tokens_per_rank=row_tokens)]
    for dp, cp, ep in layouts:
        if dp * cp > MAX_MATRIX_RANKS or (dp * cp) % ep:
            raise ValueError(f"MoE layout DP{dp} CP{cp} EP{ep}: DP·CP <= {MAX_MATRIX_RANKS} and EP | DP·CP")
        mode = "chunkwise" if cp > 1 else "headwise"
        spec = ServeSpec(model=model, cp=cp, dp=dp, ep=ep, dtype=dtype, linear_cp_mode=mode)
        specs.append(replace(spec, max_tokens_per_rank=row_tokens // cp))
    return specs


def row_budget_specs(
    model: str, *, cps: Sequence[int], modes: Sequence[str], dtype: str, row_tokens: int, dps: Sequence[int] = (1,)
) -> list[ServeSpec]:
    """DP=1, CP=1 first (the reference), then every (DP, CP) other than (1, 1) with DP·CP <= MAX_MATRIX_RANKS,
    DP=1 first, × each GDN mode when CP > 1; all with ``row_tokens / CP`` tokens per rank: the same packed row
    budget (``max_tokens_per_rank · CP``, what ``compare`` requires of a reference and its candidate). At DP > 1
    the rows of a request are spread over the DP replicas and the gradients summed over DP×CP."""
    specs = [ServeSpec(model=model, cp=1, dtype=dtype, max_tokens_per_rank=row_tokens)]
    for dp in sorted(set(dps)):
        for cp in cps:
            if (dp, cp) == (1, 1) or dp * cp > MAX_MATRIX_RANKS:
                continue
            if row_tokens % (cp * 8):
                raise ValueError(f"row_tokens={row_tokens} must be a multiple of 8·CP={8 * cp}")
            for mode in modes if cp > 1 else modes[:1]:
                specs.append(
                    ServeSpec(
                        model=model,
                        cp=cp,
                        dp=dp,
                        dtype=dtype,
                        linear_cp_mode=mode,
                        max_tokens_per_rank=row_tokens // cp,
                    )
                )
    return specs
