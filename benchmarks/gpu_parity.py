"""Kernel parity of the GPU path against the float64 CPU reference (part of ``gpu_check.py``).

Every case draws its inputs in float64 on the CPU, rounds them once to the kernel's dtype, runs the kernel on the
device, and compares its forward output and its input gradients (for one random upstream gradient) with the
plain reference run in float64 on those same rounded inputs. The figure is ``max|kernel - ref| / max|ref|`` per
tensor (the worst of out/lse or of the gradients), against the limit of the case's dtype:

- float32 kernels: 1e-5 forward, 1e-4 backward (float32 rounding of sums over a few hundred terms: ~1e-6, with
  margin for cancellation in the backward's differences);
- bfloat16 kernels: 2e-2 forward, 5e-2 backward. A bf16 flash kernel rounds its output (2^-8 = 3.9e-3 relative)
  and the probabilities it multiplies V and dO with to bf16, so outputs carry a few 2^-8 of error; gradients add
  the bf16 rounding of dS and of the result (measured CPU bf16 flash against float64: a few e-3; limits 5x that);
- Triton kernels (fla, Liger) in float32: 5e-3 forward, 1e-2 backward: their dots may run in TF32 (10-bit
  mantissa, 2^-11 = 4.9e-4 relative per product), summed over a 64-token chunk and 128-wide heads.

With ``device="cpu"`` (``--smoke``) each GPU kernel is replaced by its CPU counterpart (``cpu_varlen_loop`` for
``cuda_varlen``, ``recompute`` for ``fla``, ``torch`` for the fla conv, ``tiled`` for Liger) and the row says so.
"""

from __future__ import annotations

import torch

from ringtune.models.head_kernels import liger_available, liger_label_logprobs
from ringtune.models.logprob_head import label_logprobs, reference_label_logprobs
from ringtune.ops.attention import reference_varlen_attention, varlen_block_attention
from ringtune.ops.attention.schedule import BlockPair, causal_pairs
from ringtune.ops.gated_delta import causal_conv1d, chunk_gated_delta_rule, naive_causal_conv1d
from ringtune.ops.gated_delta.fla_kernels import fla_available

LIMITS = {"float32": (1e-5, 1e-4), "bfloat16": (2e-2, 5e-2), "triton-fp32": (5e-3, 1e-2)}
"""(forward, backward) limits of ``max|kernel - ref| / max|ref|`` by kind (module docstring)."""

SEQ_LENS = (1, 7, 64, 129, 1, 300)
"""A packed row with 1-token and odd-length sequences."""


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|a - ref| / max|ref|`` in float64 on the CPU (0 for an all-zero reference compared with zeros)."""
    a, ref = a.detach().double().cpu(), ref.detach().double().cpu()
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    diff = float((a - ref).abs().max()) if ref.numel() else 0.0
    return diff / scale if scale > 0 else diff


def _grads(fn, inputs, dout):
    """Forward ``fn(*inputs)`` (first output) and autograd gradients of ``(out * dout).sum()`` w.r.t. inputs."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    (outs[0] * dout.to(outs[0].dtype)).sum().backward()
    return outs, [x.grad for x in leaves]


def _row(kind: str, fwd: float, bwd: float, name: str, kernel: str, dtype: str) -> dict:
    f_lim, b_lim = LIMITS[kind]
    return {
        "case": name,
        "kernel": kernel,
        "dtype": dtype,
        "forward": fwd,
        "backward": bwd,
        "limit_forward": f_lim,
        "limit_backward": b_lim,
        "pass": fwd <= f_lim and bwd <= b_lim,
    }


def split_pairs(seq_lens: tuple[int, ...]) -> list[BlockPair]:
    """Each sequence as ring-like blocks: a causal first half, the second half full against the first, and a causal
    second half: the kernel's log-sum-exp must merge them into causal attention."""
    pairs, s = [], 0
    for n in seq_lens:
        m = n // 2
        if m:
            pairs += [BlockPair(s, s + m, s, s + m, True), BlockPair(s + m, s + n, s, s + m, False)]
        pairs.append(BlockPair(s + m, s + n, s + m, s + n, True))
        s += n
    return pairs


def attention_cases(device: torch.device, dim: int = 128) -> list[dict]:
    """cuda_varlen (bf16) on the device, cpu_varlen_loop (fp32) on CPU: causal, split + merged, MHA/GQA, D 128/256."""
    on_gpu = device.type == "cuda"
    kernel, dtype, kind = (
        ("cuda_varlen", torch.bfloat16, "bfloat16") if on_gpu else ("cpu_varlen_loop", torch.float32, "float32")
    )
    label = kernel if on_gpu else f"{kernel} (cpu fallback)"
    rows = []
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, *torch.tensor(SEQ_LENS).cumsum(0).tolist()])
    T = int(cu[-1])
    for hq, hkv, d in ((8, 8, dim), (8, 2, dim), (4, 1, 2 * dim)):
        q, k, v = (torch.randn(T, h, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv))
        q, k, v = (x.to(dtype).double() for x in (q, k, v))  # the kernel's inputs, exactly
        dout = torch.randn(T, hq, d, generator=gen, dtype=torch.float64)
        ref, ref_g = _grads(lambda a, b, c: reference_varlen_attention(a, b, c, cu), (q, k, v), dout)
        for name, pairs in (("causal", causal_pairs(cu)), ("split+lse merge", split_pairs(SEQ_LENS))):
            dev = [x.to(device=device, dtype=dtype) for x in (q, k, v)]
            outs, g = _grads(
                lambda a, b, c, pairs=pairs: varlen_block_attention(a, b, c, pairs, kernel=kernel), dev, dout.to(device)
            )
            fwd = max(rel_err(outs[0], ref[0]), rel_err(outs[1], ref[1]))
            bwd = max(rel_err(x, y) for x, y in zip(g, ref_g, strict=True))
            rows.append(_row(kind, fwd, bwd, f"attention {name} Hq={hq} Hkv={hkv} D={d}", label, str(dtype)[6:]))
    # full (non-causal) blocks: each sequence's second half against its first half only
    q, k, v = (torch.randn(T, h, dim, generator=gen, dtype=torch.float64).to(dtype).double() for h in (8, 2, 2))
    pairs = [p for p in split_pairs(SEQ_LENS) if not p.causal]
    dout = torch.randn(T, 8, dim, generator=gen, dtype=torch.float64)
    ref, ref_g = _grads(lambda a, b, c: varlen_block_attention(a, b, c, pairs, kernel="math"), (q, k, v), dout)
    dev = [x.to(device=device, dtype=dtype) for x in (q, k, v)]
    outs, g = _grads(lambda a, b, c: varlen_block_attention(a, b, c, pairs, kernel=kernel), dev, dout.to(device))
    covered = outs[1].isfinite()
    fwd = max(rel_err(outs[0], ref[0]), rel_err(outs[1][covered], ref[1][covered.cpu()]))
    bwd = max(rel_err(x, y) for x, y in zip(g, ref_g, strict=True))
    rows.append(_row(kind, fwd, bwd, f"attention full blocks Hq=8 Hkv=2 D={dim}", label, str(dtype)[6:]))
    return rows


def gated_delta_cases(device: torch.device, dim: int = 128) -> list[dict]:
    """The chunked GDN rule (fla on the device, recompute on CPU) with and without states, and the conv."""
    on_gpu = device.type == "cuda" and fla_available()
    scan = "fla" if on_gpu else "recompute"
    kind = "triton-fp32" if on_gpu else "float32"
    label = scan if on_gpu else f"{scan} (cpu fallback)"
    gen = torch.Generator().manual_seed(1)
    lens = (1, 0, 63, 65, 130, 7)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    T, n, hk, hv, dk, dv = int(cu[-1]), len(lens), 2, 4, dim, dim

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = draw(T, hk, dk), draw(T, hk, dk), draw(T, hv, dv)
    g = -torch.nn.functional.softplus(draw(T, hv))  # log decay <= 0
    beta = torch.sigmoid(draw(T, hv))
    h0 = draw(n, hv, dk, dv) * 0.1
    rows = []
    for name, state in (("without states", None), ("with initial/final state", h0)):
        inputs = [q, k, v, g, beta] + ([state] if state is not None else [])
        dout = draw(T, hv, dv)

        def run(*xs, scan_name, state=state):
            st = xs[5] if state is not None else None
            o, fin = chunk_gated_delta_rule(
                *xs[:3], cu.to(xs[0].device), g=xs[3], beta=xs[4], initial_state=st, use_qk_l2norm=True, scan=scan_name
            )
            return o, fin

        ref, ref_g = _grads(lambda *xs, run=run: run(*xs, scan_name="recompute"), inputs, dout)
        dev = [x.to(device=device, dtype=torch.float32) for x in inputs]
        outs, gr = _grads(lambda *xs, run=run: run(*xs, scan_name=scan), dev, dout.to(device))
        fwd = max(rel_err(outs[0], ref[0]), rel_err(outs[1], ref[1]))
        bwd = max(rel_err(a, b) for a, b in zip(gr, ref_g, strict=True))
        rows.append(_row(kind, fwd, bwd, f"GDN chunk scan {name} Hk={hk} Hv={hv} D={dim}", label, "float32"))
    conv_kernel = "fla" if on_gpu else "torch"
    cu = torch.tensor([0, *torch.tensor([n for n in lens if n]).cumsum(0).tolist()])  # the naive conv needs n > 0
    x, w = draw(T, 2 * hk * dk + hv * dv), draw(2 * hk * dk + hv * dv, 4) * 0.5
    dout = draw(*x.shape)
    ref, ref_g = _grads(lambda a, b: naive_causal_conv1d(a, b, cu), (x, w), dout)
    dev = [t.to(device=device, dtype=torch.float32) for t in (x, w)]
    outs, gr = _grads(lambda a, b: causal_conv1d(a, b, cu.to(a.device), kernel=conv_kernel), dev, dout.to(device))
    fwd, bwd = rel_err(outs[0], ref[0]), max(rel_err(a, b) for a, b in zip(gr, ref_g, strict=True))
    clabel = conv_kernel if on_gpu else f"{conv_kernel} (cpu fallback)"
    rows.append(_row(kind, fwd, bwd, "GDN causal conv1d K=4", clabel, "float32"))
    return rows


def head_cases(device: torch.device) -> list[dict]:
    """The tiled head on the device and, where installed, Liger's fused linear cross-entropy, float32."""
    gen = torch.Generator().manual_seed(2)
    T, D, V = 257, 64, 5000
    h = torch.randn(T, D, generator=gen, dtype=torch.float64)
    w = torch.randn(V, D, generator=gen, dtype=torch.float64) * 0.2
    labels = torch.randint(0, V, (T,), generator=gen)
    labels[::7] = -100
    dout = torch.randn(T, generator=gen, dtype=torch.float64)
    ref, ref_g = _grads(lambda a, b: reference_label_logprobs(a, b, labels), (h, w), dout)
    kernels = [("tiled", label_logprobs, "float32")]
    if device.type == "cuda" and liger_available():
        kernels.append(("liger", liger_label_logprobs, "triton-fp32"))
    rows = []
    for name, fn, kind in kernels:
        dev = [x.to(device=device, dtype=torch.float32) for x in (h, w)]
        lab = labels.to(device)
        outs, gr = _grads(lambda a, b, fn=fn, lab=lab: fn(a, b, lab), dev, dout.to(device))
        fwd, bwd = rel_err(outs[0], ref[0]), max(rel_err(a, b) for a, b in zip(gr, ref_g, strict=True))
        label = name if device.type == "cuda" else f"{name} (cpu)"
        rows.append(_row(kind, fwd, bwd, f"log-prob head T={T} V={V}", label, "float32"))
    return rows


def kernel_parity(device: torch.device, *, smoke: bool = False) -> list[dict]:
    """Every parity row (attention, GatedDeltaNet scan and conv, head) on ``device``; ``smoke``: head dims 32."""
    dim = 32 if smoke else 128
    rows: list[dict] = []
    for name, part in (("attention", attention_cases), ("GatedDeltaNet", gated_delta_cases), ("head", head_cases)):
        try:  # a kernel that raises fails its part's row; the other parts still run
            rows += part(device, dim) if part is not head_cases else part(device)
        except Exception as exc:  # reported as a failed row with the error
            rows.append({"case": f"{name} (all cases)", "kernel": "—", "error": repr(exc)[:300], "pass": False})
    return rows
