"""``serve --sampler vllm --vllm-devices``: the started engines' GPUs, split evenly over them, and the splits that
cannot work refused before anything starts.

The training ranks of this host use its GPUs ``0 .. R-1`` (rank r on GPU ``r mod count``:
:mod:`ringtune.worker.launch`); an engine on one of them would take ``--gpu-memory-utilization`` (vLLM's default
0.9) of a GPU a rank trains on. So ``--vllm-devices`` lists GPUs ``R`` and above, split evenly over the started
engines, each share at least the engine's tensor parallelism (``--tensor-parallel-size`` in ``--vllm-args``,
else 1) times its pipeline parallelism (``--pipeline-parallel-size``). On a GPU host, started engines without
``--vllm-devices`` are refused unless ``--vllm-args`` sets ``--gpu-memory-utilization`` (the operator shares a
GPU knowingly). ``ringtune plan --vllm-engines`` says how many GPUs to give engines
(:mod:`ringtune.plan.gpu_split`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ringtune.errors import UserInputError

PARALLEL_FLAGS = {"--tensor-parallel-size": 1, "-tp": 1, "--pipeline-parallel-size": 1, "-pp": 1}
"""vLLM's flags whose product is an engine's GPU count (default 1 each)."""


def engine_gpu_count(extra_args: Sequence[str]) -> int:
    """GPUs one engine of ``extra_args`` (``--vllm-args``, split) runs on: tensor x pipeline parallel size.
    UserInputError for a size that is not an integer >= 1."""
    sizes = {"tp": 1, "pp": 1}
    for i, arg in enumerate(extra_args):
        flag, _, value = arg.partition("=")
        if flag not in PARALLEL_FLAGS:
            continue
        if not value:
            value = extra_args[i + 1] if i + 1 < len(extra_args) else ""
        if not value.isdigit() or int(value) < 1:
            raise UserInputError(f"--vllm-args: {flag} {value!r} must be an integer >= 1")
        sizes["tp" if flag in ("--tensor-parallel-size", "-tp") else "pp"] = int(value)
    return sizes["tp"] * sizes["pp"]


def engine_devices(
    text: str | None,
    engines: int,
    extra_args: Sequence[str],
    *,
    ranks_on_host: int | None = None,
    gpus_on_host: int | None = None,
) -> list[str]:
    """One ``CUDA_VISIBLE_DEVICES`` value per started engine (``engines`` of them, in order) from ``--vllm-devices``
    ``text`` (comma-separated GPU indices, split evenly in order); [] when ``text`` is None (engines see every GPU).

    UserInputError, naming the flag, when: an index is not an integer >= 0 or is listed twice; the count is not
    a multiple of ``engines`` or gives an engine fewer GPUs than it runs on (:func:`engine_gpu_count`); ``text``
    is given but no engine is started; an index is below ``ranks_on_host`` (a training rank's GPU) or not below
    ``gpus_on_host``; or, on a GPU host (``gpus_on_host`` > 0), engines are started without ``text`` and
    without ``--gpu-memory-utilization``.
    """
    per_engine = engine_gpu_count(extra_args)
    if text is None:
        sharing = any(a.split("=")[0] == "--gpu-memory-utilization" for a in extra_args)
        if engines and gpus_on_host and not sharing:
            ranks = f"GPUs 0..{ranks_on_host - 1} train" if ranks_on_host else "the training ranks use GPUs from 0"
            raise UserInputError(
                f"--sampler vllm on a host with {gpus_on_host} GPUs: give --vllm-devices ({engines} engine(s) x "
                f"{per_engine} GPU(s) the ranks do not use; {ranks}), or share a GPU knowingly with "
                "--vllm-args='--gpu-memory-utilization F'"
            )
        return []
    if not engines:
        raise UserInputError(f"--vllm-devices={text!r}: no engine is started (--vllm-engines 0, --vllm-url only)")
    items = [t.strip() for t in text.split(",")]
    if not all(t.isdigit() for t in items):
        raise UserInputError(f"--vllm-devices={text!r}: expected comma-separated GPU indices, e.g. 4,5,6,7")
    indices = [int(t) for t in items]
    twice = sorted({i for i in indices if indices.count(i) > 1})
    if twice:
        raise UserInputError(f"--vllm-devices={text!r}: GPU(s) {twice} listed twice")
    share = len(indices) // engines
    if len(indices) % engines or share < per_engine:
        raise UserInputError(
            f"--vllm-devices={text!r}: {len(indices)} GPU(s) do not split evenly over {engines} started engine(s) of "
            f"at least {per_engine} GPU(s) each (--vllm-engines per model; --tensor-parallel-size x "
            "--pipeline-parallel-size in --vllm-args)"
        )
    if ranks_on_host:
        taken = [i for i in indices if i < ranks_on_host]
        if taken:
            raise UserInputError(
                f"--vllm-devices={text!r}: GPU(s) {taken} hold training ranks (--cp x --dp puts {ranks_on_host} "
                f"rank(s) on this host, on GPUs 0..{ranks_on_host - 1}); give engines GPUs {ranks_on_host} and up"
            )
    if gpus_on_host is not None and gpus_on_host > 0:
        missing = [i for i in indices if i >= gpus_on_host]
        if missing:
            raise UserInputError(
                f"--vllm-devices={text!r}: GPU(s) {missing} do not exist (this host has {gpus_on_host})"
            )
    return [",".join(items[k * share : (k + 1) * share]) for k in range(engines)]
