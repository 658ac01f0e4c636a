"""One training step (forward, backward, AdamW) of a Qwen3.5-shaped model, ringtune or transformers (``gpu_check.py``).

``python benchmarks/gpu_step.py --impl ringtune|transformers --tokens N [--model 4b|smoke] [--layers L] [--steps 3]``
(``--layers``: the model's first L layers, a shape that fits a smaller GPU) prints one
JSON line: tokens/s (median of the timed steps after one warm-up), model FLOPs utilisation against the chip's bf16
peak, peak device memory, the first loss. Both implementations take the same random weights' *shapes* (not the same
values: each initialises its own), one sequence of N tokens per row, bf16-mixed (float32 masters, bfloat16 compute):

- ``ringtune``: ``CausalLM`` with ``set_compute_dtype(bfloat16)``, selective recompute, the tiled head's one-pass
  cross-entropy; kernels by the registries (on CUDA: ``cuda_varlen`` attention, fla scan and conv if installed);
- ``transformers``: ``Qwen3_5ForCausalLM`` under ``torch.autocast(bfloat16)`` with gradient checkpointing and sdpa
  attention (it uses fla's kernels for its GatedDeltaNet layers when fla is installed: what a user would pick).

Model FLOPs per step (the usual convention): ``6·P·T`` for the matmul parameters P (decoder layers and the head; the
embedding lookup is free) plus ``6·T²·Hq·Dh`` per attention layer (QKᵀ and PV, causal half, forward + backward);
recomputation is not counted, nor the GatedDeltaNet state math beyond its projections. Peak: ``--peak-tflops``
(default: :func:`peak_bf16_tflops` of the device's name, e.g. 989.4 for an H200 or H100 SXM).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from ringtune.plan.models import KNOWN_MODELS

SMOKE_MODEL: dict[str, Any] = {
    **KNOWN_MODELS["Qwen3.5-4B"],
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
"""A tiny model of the same family and layer pattern for ``--smoke`` on CPU."""

MODELS = {"4b": KNOWN_MODELS["Qwen3.5-4B"], "smoke": SMOKE_MODEL}
H200_BF16_TFLOPS = 989.4

PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    # (substring of torch.cuda.get_device_name, dense bf16 TFLOP/s from NVIDIA's datasheets), first match wins
    ("H200", 989.4),
    ("H100 PCIe", 756.5),
    ("H100 NVL", 835.5),
    ("H100", 989.4),  # SXM5
    ("H800", 989.4),
    ("A100", 312.0),
)
"""Dense (no sparsity) bf16 tensor-core peaks; a device not listed is measured against the H200's figure."""


def peak_bf16_tflops(device_name: str) -> float:
    """The dense bf16 peak of a device by its CUDA name (:data:`PEAK_BF16_TFLOPS`; the H200's if not listed)."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return H200_BF16_TFLOPS


def model_flops(cfg: dict[str, Any], tokens: int, matmul_params: int) -> float:
    """Model FLOPs of one forward + backward over one sequence of ``tokens`` (module docstring)."""
    layers = cfg["num_hidden_layers"]
    attn_layers = sum(1 for i in range(layers) if (i + 1) % cfg.get("full_attention_interval", 4) == 0)
    return 6.0 * matmul_params * tokens + 6.0 * tokens**2 * cfg["num_attention_heads"] * cfg["head_dim"] * attn_layers


def _ringtune(cfg: dict[str, Any], device: torch.device):
    from ringtune.models.config import DecoderConfig
    from ringtune.models.decoder import CausalLM
    from ringtune.models.precision import set_compute_dtype
    from ringtune.models.recompute import set_recompute

    with device:
        model = CausalLM(DecoderConfig.from_hf(cfg))
    with torch.no_grad():  # transformers' initialisation scale (N(0, 0.02) matrices), so both start alike
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    set_compute_dtype(model, torch.bfloat16)
    set_recompute(model, "selective")
    return model


def _transformers(cfg: dict[str, Any], device: torch.device):
    import transformers

    config = transformers.Qwen3_5TextConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    with device:
        model = transformers.Qwen3_5ForCausalLM(config)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    return model


def matmul_params(model: torch.nn.Module, cfg: dict[str, Any]) -> int:
    """Parameters of every 2-D weight but the embedding table, plus the head's [V, D] when it is the tied table."""
    embed = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    total = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in embed)
    return total + (cfg["vocab_size"] * cfg["hidden_size"] if cfg.get("tie_word_embeddings") else 0)


def run_step(
    impl: str,
    model_name: str,
    tokens: int,
    steps: int,
    device: torch.device,
    peak_tflops: float,
    layers: int | None = None,
) -> dict:
    """Build the model (``layers``: its first N layers only, None: all), run ``steps`` steps (the first a warm-up),
    return the figures (module docstring)."""
    cfg = dict(MODELS[model_name])
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    torch.manual_seed(0)
    model = _ringtune(cfg, device) if impl == "ringtune" else _transformers(cfg, device)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab_size"], (tokens,), generator=gen).to(device)
    labels = torch.cat([ids[1:], torch.full((1,), -100, device=device)])
    n = tokens - 1

    if impl == "ringtune":
        from ringtune.models.shard import shard_of

        shard = shard_of([tokens])
        upstream = torch.where(labels != -100, -1.0 / n, 0.0)

        def loss_fn() -> torch.Tensor:
            return -model(ids, shard, labels, upstream).sum() / n
    else:

        def loss_fn() -> torch.Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(input_ids=ids[None]).logits[0]
            return torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times, first_loss = [], None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(steps):
        sync()
        start = time.perf_counter()
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i:
            times.append(time.perf_counter() - start)
        first_loss = float(loss.detach()) if first_loss is None else first_loss
    step_s = statistics.median(times) if times else float("nan")
    flops = model_flops(cfg, tokens, matmul_params(model, cfg))
    return {
        "impl": impl,
        "model": model_name,
        "layers": cfg["num_hidden_layers"],
        "tokens": tokens,
        "device": str(device),
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "mfu": flops / step_s / (peak_tflops * 1e12),
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "first_loss": first_loss,
        "status": "ok",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--impl", choices=["ringtune", "transformers"], required=True)
    p.add_argument("--model", choices=sorted(MODELS), default="4b")
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=None, help="the model's first N layers (default: all)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--peak-tflops", type=float, default=None, help="default: by the device's name")
    a = p.parse_args()
    device = torch.device(a.device)
    if a.peak_tflops is None:
        a.peak_tflops = peak_bf16_tflops(torch.cuda.get_device_name(device) if device.type == "cuda" else "")
    try:
        result = run_step(a.impl, a.model, a.tokens, a.steps, device, a.peak_tflops, a.layers)
    except torch.OutOfMemoryError as exc:
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        result = {"impl": a.impl, "model": a.model, "layers": a.layers, "tokens": a.tokens, "status": "OOM"}
        result["peak_mem_gib"] = peak
        result["error"] = str(exc).splitlines()[0][:300]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
