"""Start ``ringtune serve`` as a subprocess on a free loopback port (the parity matrix and its tests), and the
server specs of the matrix's layouts."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from ringtune.gateway.serve_process import ServeProcess
from ringtune.parity.long_rows import MESH_PROMPT_TOKENS

API_KEY = "tml-parity"
SERVER_THREADS = 1
"""Torch intra-op threads of a matrix server's single rank (``OMP_NUM_THREADS`` of the child). A multi-rank
server sets ``cores // ranks`` per rank itself (one on this 2-core machine); a DP=1, CP=1 server runs in the
gateway's process with torch's default, one thread per core, and the tiny model's small kernels then spin two
threads against each other and the machine's load: the CP=1 references ran 10-30x slower than a CP=2 layout
(measured 2026-12-07: the float32 reference's client run 195 s with two threads, 20 s with one, load 1-22;
a 64x32 matmul+backward loop 32x slower with two threads at load ~17). One thread changes no figure that the
matrix compares (the float64 layouts stay bit-identical to a two-thread reference)."""


@dataclass(frozen=True, kw_only=True)
class ServeSpec:
    """One server of the matrix: the ``ringtune serve`` flags that matter for parity, and how the client runs
    against it (``lora_rank``: 0 full fine-tuning; ``long_rows``: the long-row profile of
    :mod:`ringtune.parity.long_rows`, served with ``--mesh-prompt-tokens`` so its long prompt takes the mesh
    prefill). ``lora_pass_runs`` >= 2 adds a companion LoRA run whose requests can join the first run's passes."""

    model: str
    cp: int = 1
    dp: int = 1
    dtype: str = "float32"
    linear_cp_mode: str = "headwise"
    attention: str = "ring"
    max_tokens_per_rank: int = 512
    debug_fault: str | None = None
    ep: int = 1
    shard_params: str = "none"
    recompute: str = "none"
    lora_rank: int = 0
    lora_pass_runs: int = 1
    shared_decode: bool = True
    long_rows: bool = False

    @property
    def name(self) -> str:
        fault = f"-fault-{self.debug_fault}" if self.debug_fault else ""
        mode = f"-{self.linear_cp_mode}" if self.cp > 1 else ""
        mode += f"-{self.attention}" if self.cp > 1 and self.attention != "ring" else ""
        ep = f"-ep{self.ep}" if self.ep > 1 else ""
        return f"cp{self.cp}{mode}-dp{self.dp}{ep}-{self.dtype}{self.options_tag}{fault}"

    @property
    def options_tag(self) -> str:
        """The non-default options in the name: ``-shard_dp_cp``, ``-rc_full``, ``-lora32-runs2``, ``-long`` ..."""
        tag = f"-shard_{self.shard_params}" if self.shard_params != "none" else ""
        tag += f"-rc_{self.recompute}" if self.recompute != "none" else ""
        tag += f"-lora{self.lora_rank}" if self.lora_rank else ""
        tag += f"-runs{self.lora_pass_runs}" if self.lora_pass_runs > 1 else ""
        tag += "-nodecode" if not self.shared_decode else ""
        return tag + ("-long" if self.long_rows else "")

    @property
    def companion(self) -> bool:
        """Whether the client runs a second LoRA run beside the first (to join passes)."""
        return self.lora_rank > 0 and self.lora_pass_runs > 1

    def reference(self) -> ServeSpec:
        """The CP=1 server this one is compared with: the same precision, packed-row budget
        (``max_tokens_per_rank · CP``), LoRA rank, LoRA pass joining and client profile (what legitimately changes
        the numbers or the requests); DP 1, EP 1, ring attention, replicated parameters, no recomputation, the
        shared decode on and no fault (what must change nothing but memory and speed)."""
        return replace(
            self,
            cp=1,
            dp=1,
            ep=1,
            linear_cp_mode="headwise",
            attention="ring",
            shard_params="none",
            recompute="none",
            shared_decode=True,
            debug_fault=None,
            max_tokens_per_rank=self.max_tokens_per_rank * self.cp,
        )

    def arguments(self) -> list[str]:
        """The whole ``ringtune serve`` argument list of this layout: ``--model`` and :meth:`options`."""
        return ["--model", self.model, *self.options()]

    def options(self) -> list[str]:
        """The ``ringtune serve`` options of this layout, ``--model`` left out (the caller names the model once:
        a second ``--model`` would serve a second model)."""
        args = ["--cp", str(self.cp), "--dp", str(self.dp), "--dtype", self.dtype]
        args += ["--linear-cp-mode", self.linear_cp_mode, "--attention", self.attention]
        args += ["--max-tokens-per-rank", str(self.max_tokens_per_rank)]
        if self.ep > 1:
            args += ["--ep", str(self.ep)]
        if self.shard_params != "none":
            args += ["--shard-params", self.shard_params]
        if self.recompute != "none":
            args += ["--recompute", self.recompute]
        if self.lora_pass_runs > 1:
            args += ["--lora-pass-runs", str(self.lora_pass_runs)]
        if not self.shared_decode:
            args += ["--no-shared-decode"]
        if self.long_rows:
            args += ["--mesh-prompt-tokens", str(MESH_PROMPT_TOKENS)]
        if self.debug_fault:
            args += ["--debug-fault", self.debug_fault]
        return args


@contextmanager
def running_server(spec: ServeSpec, workdir: Path, *, timeout_s: float = 300.0) -> Iterator[str]:
    """``ringtune serve`` with ``spec`` on 127.0.0.1 (log in ``workdir/serve-<name>.log``); yields its URL.

    A :class:`~ringtune.gateway.serve_process.ServeProcess`: waits for ``/api/v1/healthz`` (ServerStartError, a
    RuntimeError with the log's tail, if the server exits or does not come up within ``timeout_s``) and stops
    the server and the ranks it spawned on exit. The server's single rank runs :data:`SERVER_THREADS` torch threads.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    server = ServeProcess(
        spec.model,
        checkpoint_root=workdir / f"ckpt-{spec.name}",
        log_path=workdir / f"serve-{spec.name}.log",
        api_key=API_KEY,
        extra_args=[*spec.options(), "--collective-timeout", "60"],
        env={"OMP_NUM_THREADS": str(SERVER_THREADS)},
    )
    server.start(timeout_s)
    try:
        yield server.url
    finally:
        server.stop()


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
