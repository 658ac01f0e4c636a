"""The product on the device: ``ringtune serve`` driven by the unmodified tinker SDK (part of ``gpu_check.py``).

A Qwen3.5-shaped model (the 4B's layer pattern, vocabulary and head sizes, fewer and narrower layers: random
weights written by transformers' ``save_pretrained``, with a word-level tokenizer of its vocabulary) is served
by ``ringtune serve`` (:class:`~ringtune.gateway.serve_process.ServeProcess`, as ``sampler_kl_depth.py`` starts
its servers) at CP=1, then CP=2 on the same device, ``--dtype bf16-mixed``. Against each server, through the SDK:

1. ``create_lora_training_client(rank=0)``; ``--steps`` x (``forward_backward`` cross_entropy on a batch of random
   datums + ``optim_step``): each step's wall time, loss and the server's reported peak memory
   (``peak_memory_gib:max`` of ``optim_step``'s metrics: CUDA's max allocated bytes on a GPU, the peak RSS on CPU);
   on CUDA also the GPU memory in use (``nvidia-smi``) above what it was before the server started;
2. ``save_weights_and_get_sampling_client`` and one ``sample`` (time, tokens);
3. ``compute_logprobs`` of a prompt on the sampler against the trainer's ``forward`` of the same tokens (max |Δ|);
4. KL(sampler ‖ trainer) by depth: for each prompt depth D a temperature-1 sample, scored by the trainer
   (``forward``); the cookbook's v1/v2 (``sampler_kl_depth.kl_stats``);
5. ``save_state``, then a load: ``create_training_client_from_state_with_optimizer`` (the SDK's successor of the
   deprecated ``load_state``; times); a ``forward`` of the loaded run equals the saved run's.

Every SDK error, a server that exits, and (on CUDA) a server whose processes never put the model's weights on the
GPU fail the part with the reason. ``python benchmarks/gpu_service.py --device cuda|cpu --out DIR`` runs it alone
and writes ``DIR/gpu_service.json``. NOT YET RUN ON A GPU: on CPU the suite runs it at tiny sizes (``--smoke``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# the step benchmark beside this file (on sys.path when run as a script, as gpu_check runs it)
from gpu_step import SMOKE_MODEL

from ringtune.plan.models import KNOWN_MODELS

API_KEY = "tml-gpu-check"


@dataclass(frozen=True, kw_only=True)
class ServiceShape:
    """The served model (``hf``: transformers ``Qwen3_5TextConfig`` fields) and the SDK workload against it."""

    hf: dict[str, Any]
    context_length: int
    datums: int
    datum_tokens: int
    steps: int
    sample_tokens: int
    depths: tuple[int, ...]
    kl_tokens: int
    cps: tuple[int, ...] = (1, 2)
    dtype: str = "bf16-mixed"
    ready_timeout_s: float = 300.0
    collective_timeout_s: float = 60.0
    extra_args: tuple[str, ...] = field(default=("--max-restarts", "0"))


GPU_SHAPE = ServiceShape(
    hf={
        **KNOWN_MODELS["Qwen3.5-4B"],  # vocabulary 248320, head dim 256, GDN heads of 128, every 4th layer attention
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "linear_num_key_heads": 8,
        "linear_num_value_heads": 16,
    },  # 0.39 B parameters: 6.3 GB of float32 weights, gradients and moments per rank
    context_length=20480,
    datums=4,
    datum_tokens=2048,
    steps=3,
    sample_tokens=32,
    depths=(1024, 4096, 16384),
    kl_tokens=64,
)
SMOKE_SHAPE = ServiceShape(
    hf=SMOKE_MODEL,  # the step part's smoke model (same family and layer pattern)
    context_length=128,
    datums=2,
    datum_tokens=24,
    steps=2,
    sample_tokens=4,
    depths=(16, 48),
    kl_tokens=8,
    ready_timeout_s=600.0,
)


def write_model(dest: Path, hf: dict[str, Any], seed: int = 0) -> int:
    """A random ``Qwen3_5ForCausalLM`` of config ``hf`` (transformers' N(0, 0.02) initialisation, float32) saved to
    ``dest`` by ``save_pretrained``, with a word-level tokenizer ``w0`` .. ``w{V-1}``; returns its parameter count."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    config = transformers.Qwen3_5TextConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    model = transformers.Qwen3_5ForCausalLM(config)
    model.save_pretrained(dest)
    vocab = {f"w{i}": i for i in range(hf["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(dest / "tokenizer.json"))
    last = hf["vocab_size"] - 1
    config = {"tokenizer_class": "TokenizersBackend", "eos_token": f"w{last}", "pad_token": f"w{last - 1}"}
    (dest / "tokenizer_config.json").write_text(json.dumps(config | {"unk_token": "w0"}))
    return sum(p.numel() for p in model.parameters())


def gpu_used_gib() -> float | None:
    """GPU memory in use on device 0 by every process (``nvidia-smi``), GiB; None without nvidia-smi."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        return float(out.split()[0]) / 1024
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _tokens(rng, vocab: int, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, n)]


class GpuWatch:
    """GPU memory in use above the level before the server started (``nvidia-smi``); a no-op on CPU.

    ``weights_bytes``: the least a server that placed the model on the GPU adds there: its ranks' float32 weights
    (each CP rank holds a whole replica), well above what CUDA contexts and NCCL buffers alone take (~0.5 GiB each).
    """

    def __init__(self, cuda: bool, weights_bytes: int) -> None:
        self.cuda = cuda
        self.weights_gib = weights_bytes / 2**30
        self.base = gpu_used_gib() if cuda else None
        self.peak = 0.0

    def sample(self) -> float | None:
        """The GPU memory the server adds now, GiB (None on CPU or without nvidia-smi); kept in ``peak``."""
        now = gpu_used_gib() if self.cuda else None
        if now is None or self.base is None:
            return None
        self.peak = max(self.peak, now - self.base)
        return now - self.base

    def check_placed(self, after: str) -> None:
        """On CUDA: RuntimeError unless the server added at least the model's weights to the GPU by now."""
        added = self.sample()
        if self.cuda and (added is None or added < self.weights_gib):
            raise RuntimeError(
                f"after {after}, ringtune serve's processes had added "
                f"{'an unknown amount (no nvidia-smi)' if added is None else f'{added:.2f} GiB'} to the GPU, less "
                f"than its ranks' {self.weights_gib:.2f} GiB of float32 weights: the model is not on the GPU"
            )


def drive(url: str, model: str, cp: int, shape: ServiceShape, on_gpu: GpuWatch) -> dict[str, Any]:
    """Steps 1-5 of the module docstring against the server at ``url``; the figures (raises on any SDK error)."""
    import numpy as np
    import tinker
    from sampler_kl_depth import kl_stats

    rng = np.random.default_rng(0)
    vocab = shape.hf["vocab_size"]
    out: dict[str, Any] = {"steps": [], "kl_by_depth": {}}

    def datum(tokens: list[int], weight: float = 1.0) -> tinker.Datum:
        return tinker.Datum(
            model_input=tinker.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [weight] * (len(tokens) - 1)},
        )

    with tinker.ServiceClient(base_url=url, api_key=API_KEY) as sc:
        tc = sc.create_lora_training_client(model, rank=0).result()
        on_gpu.check_placed(f"create_lora_training_client(rank=0) on --cp {cp}")  # before any slow CPU-bound step
        batch = [datum(_tokens(rng, vocab, shape.datum_tokens)) for _ in range(shape.datums)]
        for i in range(shape.steps):
            started = time.perf_counter()
            fb = tc.forward_backward(batch, "cross_entropy").result()
            # clipped (a random model's gradient norm is far above 1): the fused kernel's own clipping, on CUDA as
            # on the CPU (engine/optimizer.py _kernel_clip)
            adam = tinker.AdamParams(learning_rate=1e-4, grad_clip_norm=1.0)
            metrics = tc.optim_step(adam).result().metrics
            step = {"step": i + 1, "s": time.perf_counter() - started, "loss_sum": fb.metrics["loss:sum"]}
            step["grad_norm"] = metrics.get("grad_norm:mean")
            step["peak_gib"] = metrics.get("peak_memory_gib:max")
            step["gpu_used_gib"] = on_gpu.sample()
            out["steps"].append(step)
        started = time.perf_counter()
        sampler = tc.save_weights_and_get_sampling_client().result()
        prompt = _tokens(rng, vocab, 32)
        params = tinker.SamplingParams(max_tokens=shape.sample_tokens, temperature=1.0, seed=0, stop=[])
        seq = sampler.sample(tinker.ModelInput.from_ints(prompt), num_samples=1, sampling_params=params).result()
        out["sample"] = {"s": time.perf_counter() - started, "tokens": len(seq.sequences[0].tokens)}
        started = time.perf_counter()
        sampled_lp = sampler.compute_logprobs(tinker.ModelInput.from_ints(prompt)).result()
        trained = tc.forward([datum(prompt, 0.0)], "cross_entropy").result().loss_fn_outputs[0]
        trained_lp = trained["logprobs"].to_torch().double().numpy()
        delta = np.abs(np.asarray(sampled_lp[1:], dtype=np.float64) - trained_lp)
        out["compute_logprobs"] = {"s": time.perf_counter() - started, "max_abs_vs_forward": float(delta.max())}
        for depth in shape.depths:
            ids = _tokens(rng, vocab, depth)
            params = tinker.SamplingParams(max_tokens=shape.kl_tokens, temperature=1.0, seed=depth, stop=[])
            got = sampler.sample(tinker.ModelInput.from_ints(ids), num_samples=1, sampling_params=params).result()
            sampled = got.sequences[0]
            full = ids + list(sampled.tokens)
            scored = tc.forward([datum(full, 0.0)], "cross_entropy").result().loss_fn_outputs[0]
            lp_trainer = scored["logprobs"].to_torch().double().numpy()[depth - 1 :]
            out["kl_by_depth"][depth] = kl_stats(np.asarray(sampled.logprobs, dtype=np.float64), lp_trainer)
            on_gpu.sample()
        before = tc.forward(batch[:1], "cross_entropy").result().metrics["loss:sum"]
        started = time.perf_counter()
        saved = tc.save_state("gpu-check").result()
        out["save_s"] = time.perf_counter() - started
        started = time.perf_counter()
        resumed = sc.create_training_client_from_state_with_optimizer(saved.path).result()
        out["load_s"] = time.perf_counter() - started
        after = resumed.forward(batch[:1], "cross_entropy").result().metrics["loss:sum"]
        out["load_loss_delta"] = abs(after - before)
    return out


def serve_and_drive(model_dir: Path, cp: int, shape: ServiceShape, cuda: bool, weights_bytes: int, work: Path) -> dict:
    """One server at ``cp`` (``ServeProcess``), :func:`drive` against it; the figures, ``pass`` and any ``error``."""
    from ringtune.gateway.serve_process import ServeProcess

    args = ["--cp", str(cp), "--context-length", str(shape.context_length), "--dtype", shape.dtype]
    args += ["--collective-timeout", str(shape.collective_timeout_s)]
    server = ServeProcess(
        str(model_dir),
        checkpoint_root=work / f"ckpt-cp{cp}",
        log_path=work / f"serve-cp{cp}.log",
        api_key=API_KEY,
        extra_args=[*args, *shape.extra_args],
    )
    run: dict[str, Any] = {"cp": cp, "dtype": shape.dtype, "pass": False}
    watch = GpuWatch(cuda, cp * weights_bytes)
    started = time.perf_counter()
    try:
        server.start(timeout_s=shape.ready_timeout_s)
        run["start_s"] = time.perf_counter() - started
        run |= drive(server.url, str(model_dir), cp, shape, watch)
        run["gpu_used_peak_gib"] = watch.peak if cuda else None
        run["pass"] = True
    except Exception as exc:  # any SDK, server or device error: recorded with the server's last lines
        run["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
        run["server_log_tail"] = server.log_tail(15)
        run["traceback"] = traceback.format_exc(limit=4)[-1500:]
    finally:
        server.stop()
        run["wall_s"] = time.perf_counter() - started
    return run


def service_check(cuda: bool, smoke: bool, save=None) -> dict[str, Any]:
    """The whole part: write the model, then :func:`serve_and_drive` per CP of the shape (``save(report)`` after
    each); ``pass`` when every server passed. ``cuda``: the servers are expected on the GPU."""
    shape = SMOKE_SHAPE if smoke else GPU_SHAPE
    report: dict[str, Any] = {"shape": asdict(shape), "runs": [], "pass": False}
    with tempfile.TemporaryDirectory(prefix="gpu-service-") as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        try:
            params = write_model(work / "model", shape.hf)
        except Exception as exc:  # e.g. a transformers without Qwen3.5
            report["error"] = f"writing the model: {type(exc).__name__}: {exc}"[:400]
            return report
        report["params"], report["write_s"] = params, time.perf_counter() - started
        for cp in shape.cps:
            report["runs"].append(serve_and_drive(work / "model", cp, shape, cuda, 4 * params, work))
            if save is not None:
                save(report)
    report["pass"] = bool(report["runs"]) and all(r["pass"] for r in report["runs"])
    return report


def service_lines(report: dict[str, Any]) -> list[str]:
    """One line per fact (``service ...``): what gpu_check prints and tests/test_gpu_check.py reads."""
    lines = []
    for r in report.get("runs", []):
        head = f"service cp={r['cp']} {r['dtype']}"
        if not r["pass"]:
            lines.append(f"{head}: FAIL {r.get('error')}")
            continue
        lines.append(f"{head}: started in {r['start_s']:.1f} s, {r['wall_s']:.1f} s in all")
        for s in r["steps"]:
            used = "" if s["gpu_used_gib"] is None else f", GPU in use {s['gpu_used_gib']:.2f} GiB"
            lines.append(
                f"{head} step {s['step']}: {s['s']:.2f} s, loss:sum {s['loss_sum']:.4g}, "
                f"grad_norm {s['grad_norm']:.4g} (clipped to 1), peak {s['peak_gib']:.2f} GiB{used}"
            )
        lines.append(f"{head} sample: {r['sample']['tokens']} tokens in {r['sample']['s']:.2f} s")
        c = r["compute_logprobs"]
        lines.append(f"{head} compute_logprobs: {c['s']:.2f} s, max |sampler - forward| {c['max_abs_vs_forward']:.2e}")
        for depth, k in r["kl_by_depth"].items():
            lines.append(
                f"{head} KL depth {depth}: v1 {k['kl_sample_train_v1']:.2e} ± {k['se_v1']:.1e}, "
                f"v2 {k['kl_sample_train_v2']:.2e}, max |d| {k['max_abs']:.2e}"
            )
        lines.append(
            f"{head} save {r['save_s']:.2f} s, load {r['load_s']:.2f} s, |loss after load - before| "
            f"{r['load_loss_delta']:.1e}"
        )
    if "error" in report:
        lines.append(f"service: FAIL {report['error']}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny model and workload (the CPU suite's size)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)

    def save(report: dict[str, Any]) -> None:  # after each server: a run stopped by a timeout keeps the ones done
        (a.out / "gpu_service.json").write_text(json.dumps(report, indent=1))

    report = service_check(a.device == "cuda", a.smoke, save)
    save(report)
    print("\n".join(service_lines(report)), flush=True)
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
