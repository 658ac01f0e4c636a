"""``ringtune demo``: full fine-tuning of the embedded SmolLM2-135M through the unmodified ``tinker`` SDK.

:func:`run_demo` starts ``ringtune serve`` as a child process (:class:`ServeProcess`; ``--cp`` passed
through), then :func:`train_demo` drives it like any Tinker client: ``ServiceClient`` ->
``create_lora_training_client(base_model, rank=config.lora_rank)`` (rank 0, the default = full fine-tuning;
``--lora-rank R``: a LoRA run) -> per step
``forward_backward(batch, "cross_entropy")`` + ``optim_step(AdamParams)``; the held-out NLL per token is
measured with ``forward`` before and after. Outputs under ``config.out``: ``loss_curve.png``,
``metrics.json`` (every number printed), ``config.json`` (the resolved config) and ``server.log``.
"""

from __future__ import annotations

import json
import math
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import tinker

from ringtune.demo.config import DemoConfig
from ringtune.demo.data import load_conversations, mean_nll, render_chatml, split_held_out
from ringtune.errors import UserInputError
from ringtune.gateway.serve_process import ServeProcess

API_KEY = "tml-demo"


@dataclass
class DemoResult:
    """What one demo run measured (all NLLs are per weighted token, natural log)."""

    base_model: str
    train_examples: int
    held_out_examples: int
    held_out_nll_before: float
    held_out_nll_after: float
    train_nll: list[float] = field(default_factory=list)
    """Per step: the batch's NLL in its forward_backward (weights before that step's update)."""
    held_out_curve: list[tuple[int, float]] = field(default_factory=list)
    samples: dict[str, str] = field(default_factory=dict)
    """A greedy reply to the first held-out prompt, ``before`` and ``after`` fine-tuning (through the sampler)."""
    """``(steps done, held-out NLL)``: before training, every ``eval_every`` steps, and after the last step."""
    seconds: float = 0.0
    plot_path: str | None = None

    @property
    def improved(self) -> bool:
        return self.held_out_nll_after < self.held_out_nll_before

    def finite(self) -> bool:
        return all(math.isfinite(x) for x in (self.held_out_nll_before, self.held_out_nll_after, *self.train_nll))


def _batches(n_examples: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """``steps`` batches of example indices: shuffled epochs (seeded), a batch never spans two epochs."""
    if batch_size > n_examples:
        raise UserInputError(f"batch_size={batch_size} exceeds the {n_examples} training examples")
    rng, order, batches = random.Random(seed), [], []
    while len(batches) < steps:
        if len(order) < batch_size:
            order = list(range(n_examples))
            rng.shuffle(order)
        batches.append(order[:batch_size])
        order = order[batch_size:]
    return batches


SESSION_CLOSE_TIMEOUT_S = 30.0
"""How long the demo waits for the server to confirm its session's close before it stops the server anyway."""


@contextmanager
def bounded_session(base_url: str, api_key: str, log: Callable[[str], None]) -> Iterator[tinker.ServiceClient]:
    """A ``tinker.ServiceClient`` closed on exit with the status ``with ServiceClient(...)`` gives it (success,
    errored, interrupted), but waiting at most :data:`SESSION_CLOSE_TIMEOUT_S` for the close: the SDK's own exit
    waits without a bound, and a Ctrl-C must stop the demo (and then its server) whatever the close does."""
    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    status = "success"
    try:
        yield service
    except BaseException as exc:
        status = "errored" if isinstance(exc, Exception) else "interrupted"
        raise
    finally:
        try:
            service.close(status).result(timeout=SESSION_CLOSE_TIMEOUT_S)
        except Exception as exc:  # a timeout or a refused close: the server is stopped next either way
            log(f"the SDK session's close did not complete ({type(exc).__name__}: {exc}); going on")


def train_demo(
    base_url: str,
    api_key: str,
    base_model: str,
    config: DemoConfig,
    *,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> DemoResult:
    """Fine-tune ``base_model`` on the gateway at ``base_url`` for ``config.steps`` steps (see the module doc).

    The tokenizer is the served one (``TrainingClient.get_tokenizer()``); conversations are rendered with
    :func:`render_chatml`. Returns the measured :class:`DemoResult` (plot not drawn here).
    """
    start = time.monotonic()
    conversations = load_conversations(config.data_path)
    train_conv, held_conv = split_held_out(conversations, config.held_out_every)
    adam = tinker.AdamParams(
        learning_rate=config.learning_rate, beta1=0.9, beta2=0.95, eps=1e-8, grad_clip_norm=config.grad_clip_norm
    )
    with bounded_session(base_url, api_key, log) as service:
        client = service.create_lora_training_client(base_model, rank=config.lora_rank).result()
        tokenizer = client.get_tokenizer()
        train = [render_chatml(c, tokenizer).datum() for c in train_conv]
        held_out = [render_chatml(c, tokenizer).datum() for c in held_conv]
        longest = max(d.model_input.length for d in train + held_out)
        log(
            f"data: {len(train)} training and {len(held_out)} held-out conversations "
            f"(longest {longest} tokens), {config.batch_size} per step"
        )

        prompt_text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in held_conv[0][:-1])
        prompt = tinker.ModelInput.from_ints(
            list(tokenizer.encode(prompt_text + "<|im_start|>assistant\n", add_special_tokens=False))
        )

        def sample_reply(when: str) -> str:
            """Greedy reply to the first held-out prompt from the current weights (an ephemeral sampler)."""
            sampler = client.save_weights_and_get_sampling_client().result()
            params = tinker.SamplingParams(max_tokens=config.sample_tokens, temperature=0.0, stop=["<|im_end|>"])
            tokens = sampler.sample(prompt, 1, params).result().sequences[0].tokens
            text = tokenizer.decode(tokens).replace("<|im_end|>", "").strip()
            log(f"sample {when} fine-tuning: {text!r}")
            return text

        def held_out_nll() -> float:
            return mean_nll(client.forward(held_out, "cross_entropy").result().loss_fn_outputs, held_out)

        before = held_out_nll()
        log(f"held-out NLL per token before: {before:.4f}")
        result = DemoResult(base_model, len(train), len(held_out), before, math.nan, held_out_curve=[(0, before)])
        log(f"held-out prompt: {held_conv[0][-2]['content']!r} (reference reply: {held_conv[0][-1]['content']!r})")
        result.samples["before"] = sample_reply("before")
        batches = _batches(len(train), config.batch_size, config.steps, config.seed)
        bar = _progress(config.steps, enabled=progress)
        try:
            for step, indices in enumerate(batches):
                batch = [train[i] for i in indices]
                fwd_bwd = client.forward_backward(batch, "cross_entropy")
                optim = client.optim_step(adam)
                loss = mean_nll(fwd_bwd.result().loss_fn_outputs, batch)
                optim.result()
                result.train_nll.append(loss)
                done = step + 1
                if done == config.steps or (config.eval_every and done % config.eval_every == 0):
                    result.held_out_curve.append((done, held_out_nll()))
                if bar is not None:
                    bar.set_postfix(train=f"{loss:.3f}", held_out=f"{result.held_out_curve[-1][1]:.3f}")
                    bar.update(1)
                elif done % 10 == 0 or done == config.steps:
                    log(f"step {done}/{config.steps}: train NLL {loss:.4f}")
        finally:
            if bar is not None:
                bar.close()
        result.held_out_nll_after = result.held_out_curve[-1][1]
        result.samples["after"] = sample_reply("after")
    result.seconds = time.monotonic() - start
    first, last = result.train_nll[0], _tail_mean(result.train_nll)
    log(f"train NLL per token: step 1 {first:.4f}, mean of the last steps {last:.4f}")
    log(f"held-out NLL per token after {config.steps} steps: {result.held_out_nll_after:.4f} (before {before:.4f})")
    return result


def _tail_mean(values: Sequence[float], n: int = 5) -> float:
    tail = list(values[-n:])
    return sum(tail) / len(tail)


def _running_mean(values: Sequence[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = values[max(0, i + 1 - window) : i + 1]
        out.append(sum(part) / len(part))
    return out


def _progress(total: int, *, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="fine-tuning", unit="step", dynamic_ncols=True)


def plot_losses(result: DemoResult, path: str | Path, title: str) -> Path:
    """Write the loss curve (per-step train NLL, held-out NLL before/after) as a PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = list(range(1, len(result.train_nll) + 1))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, result.train_nll, marker=".", alpha=0.45, label="train NLL (batch, before its update)")
    ax.plot(steps, _running_mean(result.train_nll, 5), color="tab:blue", label="train NLL, mean of 5 steps")
    held_steps, held_nll = zip(*result.held_out_curve, strict=True)
    ax.plot(held_steps, held_nll, "s-", color="tab:red", label="held-out NLL")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("NLL per token (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def run_demo(config: DemoConfig, *, progress: bool = True, log: Callable[[str], None] = print) -> DemoResult:
    """Start ``ringtune serve --model config.model --cp config.cp`` as a child, train, plot, stop the child.

    The child is stopped on every exit path (end, error, Ctrl-C). Raises ServerStartError when the server
    does not come up (e.g. a ``--cp`` it does not accept), with the tail of ``server.log``.
    """
    config.validate()
    out = Path(config.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(config), indent=2) + "\n")
    extra = ["--cp", str(config.cp), "--context-length", str(config.context_length)]
    server = ServeProcess(
        config.model,
        checkpoint_root=out / "server",
        log_path=out / "server.log",
        port=config.port,
        api_key=API_KEY,
        extra_args=extra,
    )
    log(f"starting ringtune serve --model {config.model} --cp {config.cp} on {server.url} (log {server.log_path})")
    t0 = time.monotonic()
    with server:
        log(f"server ready after {time.monotonic() - t0:.1f} s (pid {server.proc.pid if server.proc else '?'})")
        result = train_demo(server.url, API_KEY, config.model, config, progress=progress, log=log)
    log("server stopped")
    kind = f"LoRA rank {config.lora_rank}" if config.lora_rank else "full fine-tuning"
    title = f"ringtune demo: {Path(config.model).name}, {kind}, CP={config.cp}"
    result.plot_path = str(plot_losses(result, out / "loss_curve.png", title))
    (out / "metrics.json").write_text(json.dumps(asdict(result) | {"cp": config.cp}, indent=2) + "\n")
    log(f"loss curve: {result.plot_path}")
    log(f"metrics: {out / 'metrics.json'} ({result.seconds:.0f} s of training and evaluation)")
    return result


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main_demo(config: DemoConfig) -> int:
    """The ``ringtune demo`` command: 0 when the held-out NLL fell, 1 when it did not, 2 on a setup error."""
    from ringtune.gateway.serve_process import ServerStartError

    previous: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        # SIGTERM unwinds like Ctrl-C: the server is stopped. SIGINT is set too: a process started as a background
        # job of a non-interactive shell inherits SIGINT *ignored*, and Python keeps that, so Ctrl-C / kill -INT
        # would never reach the demo (measured: a CI run under `bash -c '... &'` waited past 240 s).
        previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, _interrupt)
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        result = run_demo(config)
    except (UserInputError, ServerStartError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: the server was stopped", file=sys.stderr)
        return 130
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if not result.finite():
        print("error: a loss was not finite", file=sys.stderr)
        return 1
    if not result.improved:
        print("error: the held-out NLL did not fall", file=sys.stderr)
        return 1
    drop = result.held_out_nll_before - result.held_out_nll_after
    print(
        f"held-out NLL fell by {drop:.4f} nats per token ({result.held_out_nll_before:.4f} -> "
        f"{result.held_out_nll_after:.4f})"
    )
    return 0
