"""What ``ringtune serve`` runs with on this host's device: the precision, the data-group backend and the kernels.

One pure function, :func:`resolve_device_settings`, turns the facts about the host (:class:`HostFacts`: CPU or
CUDA, how many GPUs, whether flash-linear-attention is installed), the user's ``--dtype`` as given (None: not
given) and the model and context settings into :class:`DeviceSettings`, or refuses with a
:class:`~ringtune.errors.UserInputError` that names the flag that fixes it. :func:`host_facts` reads the facts
(the only impure part), so the rule is tested on any machine.

The rule (docs/gpu.md "Defaults on a GPU"):

- ``--dtype`` not given: ``float32`` on CPU (:data:`~ringtune.models.precision.DEFAULT_PRECISION`), ``bf16-mixed``
  on CUDA (float32 master weights, gradients and AdamW moments; bfloat16 decoder layers, so attention takes the
  flash kernels). A given ``--dtype`` is kept, unless the next point refuses it.
- Attention's block kernel is what :func:`~ringtune.ops.attention.kernels.select_block_kernel` picks for the
  layers' arithmetic dtype (``bf16-exact`` computes in float64). On CUDA the flash kernels take only
  float16/bfloat16, so ``float32``, ``float64`` and ``bf16-exact`` fall back to ``math``, which materialises
  [heads × Sq × Sk] scores per block (Sq = Sk = the per-rank token budget at most). When that one tensor would
  exceed :data:`QUADRATIC_SCORES_LIMIT_BYTES`, the setting is refused with ``--dtype bf16-mixed`` (or a shorter
  context per rank) named as the fix; below it, served with a note. Models without full-attention layers never
  reach the kernel.
- Data groups (CP, DP, EP collectives): NCCL on CUDA when every rank has a GPU of its own
  (:func:`~ringtune.parallel.mesh.default_backend`); when ranks share a GPU (``--cp 2`` on one GPU), gloo, through
  which ringtune's collectives stage CUDA tensors in host memory (NCCL refuses two ranks on one GPU,
  "Duplicate GPU detected"). The control group is gloo everywhere (``parallel/mesh.py``).
- GatedDeltaNet scan and conv: ``fla`` on CUDA when flash-linear-attention is installed, else ringtune's torch
  ones (linear memory, slower; noted). Log-prob head: ``tiled`` everywhere. AdamW: ``fused`` on CUDA.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from ringtune.engine.optimizer import default_adamw_kernel_for
from ringtune.errors import UserInputError
from ringtune.models.config import DecoderConfig
from ringtune.models.head_kernels import DEFAULT_HEAD
from ringtune.models.precision import DEFAULT_PRECISION, check_precision
from ringtune.ops.attention.kernels import select_block_kernel
from ringtune.ops.gated_delta.chunked import DEFAULT_CHUNK_SCAN
from ringtune.parallel.mesh import default_backend

CUDA_PRECISION = "bf16-mixed"
"""``--dtype`` on CUDA when the user gives none."""

QUADRATIC_SCORES_LIMIT_BYTES = 2**30
"""The largest [heads x Sq x Sk] score tensor of one attention block the ``math`` kernel may materialise on CUDA
before a setting is refused (its backward holds about three of them at once)."""

DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class HostFacts:
    """What the host offers: ``device_type`` "cpu" or "cuda"; ``gpu_count`` (0 on CPU); whether the GatedDeltaNet
    kernels of flash-linear-attention (``fla`` and ``triton``) can be imported."""

    device_type: str
    gpu_count: int = 0
    fla_installed: bool = False


@dataclass(frozen=True, kw_only=True)
class DeviceSettings:
    """The resolved settings: ``dtype`` a name of :data:`~ringtune.models.precision.PRECISIONS` (``--dtype``);
    ``data_backend`` the data groups' torch.distributed backend; the kernel names each registry will pick
    (attention :data:`~ringtune.ops.attention.kernels.KERNELS`, GatedDeltaNet scan ``CHUNK_SCANS`` and conv
    ``CONV_KERNELS`` (for rows without a CP conv context: the chunkwise mode's context path keeps ``torch``), head
    ``HEAD_KERNELS``, AdamW ``ADAMW_KERNELS``); ``notes`` lines for the serve banner."""

    device_type: str
    dtype: str
    data_backend: str
    attention_kernel: str
    gated_delta_scan: str
    conv_kernel: str
    head_kernel: str
    adamw_kernel: str
    notes: tuple[str, ...] = ()


def host_facts() -> HostFacts:
    """This process's host: CUDA when torch sees a GPU (``gpu_count`` of them), else CPU; whether ``fla`` and
    ``triton`` are importable (nothing is imported)."""
    if not torch.cuda.is_available():
        return HostFacts(device_type="cpu")
    fla = importlib.util.find_spec("fla") is not None and importlib.util.find_spec("triton") is not None
    return HostFacts(device_type="cuda", gpu_count=torch.cuda.device_count(), fla_installed=fla)


def attention_arithmetic_dtype(dtype: str) -> torch.dtype:
    """The dtype attention's block kernel sees under precision ``dtype``: the layers' compute dtype, float64
    under ``bf16-exact`` (bf16 values, float64 arithmetic)."""
    precision = check_precision(dtype, "--dtype")
    return torch.float64 if precision.exact else precision.compute_dtype


def math_scores_bytes(config: DecoderConfig, max_tokens_per_rank: int, dtype: torch.dtype) -> int:
    """Bytes of one [heads × S × S] score tensor of the ``math`` kernel at S = ``max_tokens_per_rank`` (the
    largest block a rank computes), in its accumulation dtype (float64 for float64 inputs, else float32)."""
    acc_bytes = 8 if dtype == torch.float64 else 4
    return config.num_heads * max_tokens_per_rank**2 * acc_bytes


def resolve_device_settings(
    host: HostFacts,
    *,
    dtype: str | None,
    config: DecoderConfig,
    world_size: int,
    max_tokens_per_rank: int,
) -> DeviceSettings:
    """The settings ``ringtune serve`` runs with (module docstring), from the host, the user's ``--dtype`` (None:
    not given), the model's config, the number of ranks on this host (``world_size`` = DP × CP) and the per-rank
    token budget.

    Raises UserInputError naming ``--dtype`` when CUDA attention would fall back to the quadratic-memory ``math``
    kernel past :data:`QUADRATIC_SCORES_LIMIT_BYTES`, or an unknown ``--dtype``; ValueError for host facts that
    cannot be (an unknown device type, CUDA without a GPU, ``world_size`` < 1).
    """
    if host.device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type={host.device_type!r}: choose one of {DEVICE_TYPES}")
    if host.device_type == "cuda" and host.gpu_count < 1:
        raise ValueError(f"device_type='cuda' needs gpu_count >= 1; got {host.gpu_count}")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    cuda = host.device_type == "cuda"
    notes: list[str] = []
    resolved = dtype if dtype is not None else (CUDA_PRECISION if cuda else DEFAULT_PRECISION)
    arithmetic = attention_arithmetic_dtype(resolved)
    attention = select_block_kernel(torch.device(host.device_type), arithmetic).name
    has_attention = "full_attention" in config.layer_types
    if cuda and has_attention and attention == "math":
        scores = math_scores_bytes(config, max_tokens_per_rank, arithmetic)
        where = (
            f"--dtype {resolved} on CUDA computes attention in {str(arithmetic).removeprefix('torch.')}, which no "
            f"flash kernel takes: the 'math' kernel materialises [{config.num_heads} heads x S x S] scores per block, "
            f"{scores / 2**30:.2f} GiB at {max_tokens_per_rank} tokens per rank"
        )
        if scores > QUADRATIC_SCORES_LIMIT_BYTES:
            raise UserInputError(
                f"{where} (limit {QUADRATIC_SCORES_LIMIT_BYTES / 2**30:g} GiB, about three held at once in the "
                f"backward); serve with --dtype {CUDA_PRECISION} (float32 master weights, bfloat16 flash attention), "
                "or fewer tokens per rank (--context-length / --max-tokens-per-rank, or a larger --cp)"
            )
        notes.append(f"{where}; --dtype {CUDA_PRECISION} takes the flash kernel")
    if cuda and world_size > host.gpu_count:
        backend = "gloo"
        notes.append(
            f"{world_size} ranks share {host.gpu_count} GPU(s): the data groups run over gloo with CUDA tensors staged "
            "through host memory (NCCL refuses two ranks on one GPU); one GPU per rank runs them over NCCL"
        )
    else:
        backend = default_backend(host.device_type)
    fla = cuda and host.fla_installed
    if cuda and not host.fla_installed and any(t == "linear_attention" for t in config.layer_types):
        notes.append(
            "flash-linear-attention is not installed: GatedDeltaNet runs ringtune's torch scan and conv (linear "
            "memory, slower); pip install 'ringtune[gpu]'"
        )
    return DeviceSettings(
        device_type=host.device_type,
        dtype=resolved,
        data_backend=backend,
        attention_kernel=attention,
        gated_delta_scan="fla" if fla else DEFAULT_CHUNK_SCAN,
        conv_kernel="fla" if fla else "torch",
        head_kernel=DEFAULT_HEAD,
        adamw_kernel=default_adamw_kernel_for(host.device_type),
        notes=tuple(notes),
    )
