"""What the Tinker gateway adds to a training call: the SDK over a real socket vs a direct Trainer call.

Run ``python benchmarks/gateway_overhead.py [--rounds 30] [--sizes tiny small] [--futures 100] [--quick]``.

One process holds both sides: a gateway (``ServerThread``: uvicorn on 127.0.0.1, a ``LocalBackend``) that
the unmodified ``tinker`` SDK drives over TCP, and a reference ``Trainer`` built exactly as the backend
builds one, on the same weights (both loaded from the same HF directory, float32). Rounds interleave the
two on the same request (direct first in even rounds, SDK first in odd ones), so machine noise hits both
alike; gradients accumulate on both sides (no optim_step), so every round does the same work.

The direct calls run on the gateway's backend thread (``service.executor``, the one thread that runs torch
in a server; the hand-off costs microseconds): torch's OpenMP pool is per calling thread, and two pools in one
process slow each other down (direct calls from the main thread after the backend thread had computed took
2x as long, and 75x on this shared 2-core machine under load), which would measure the benchmark, not the gateway.

Printed (ratios measured in this run, with goals and PASS/FAIL):
1. per size: median seconds of ``forward_backward`` direct and through the SDK (submit + long-polled
   ``retrieve_future`` + protobuf both ways), their ratio (goal <= 1.1x) and the per-request overhead in ms
   (SDK median - direct median); the loss through the SDK must equal the direct one bit for bit;
2. ``--futures`` (default 100) ``forward`` futures submitted before any result is read: all complete, each
   result equals a direct forward of the same datum, and the wall time per future vs a direct forward.

Sizes (random Llama decoders, a forward_backward of ``datums`` x ``tokens``):
``tiny``: 4 layers, hidden 32, vocab 96, 4 x 64 tokens (compute of a few ms: the ratio shows the fixed cost);
``small``: 4 layers, hidden 128, vocab 4096, 8 x 128 tokens (a few hundred ms: a small real step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import tinker
import torch

# verdict() of the attention benchmark (same directory, on sys.path when run as a script).
from attention_cp import verdict

from ringtune.engine.trainer import TrainDatum, Trainer
from ringtune.gateway.config import GatewayConfig
from ringtune.gateway.local import LocalBackend
from ringtune.gateway.server import ServerThread
from ringtune.models.checkpoints.load import load_model

# tests/support holds test helpers outside the ringtune package: importable once tests/ is on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.tiny_models import hf_config

API_KEY = "tml-bench"
RATIO_GOAL = 1.1
MAX_TOKENS_PER_RANK = 4096


@dataclass(frozen=True)
class Size:
    """A model shape and a request shape."""

    hidden: int
    intermediate: int
    vocab: int
    datums: int
    tokens: int


SIZES = {
    "tiny": Size(hidden=32, intermediate=48, vocab=96, datums=4, tokens=64),
    "small": Size(hidden=128, intermediate=256, vocab=4096, datums=8, tokens=128),
}


def write_model(size: Size, dest: Path) -> Path:
    """A random 4-layer Llama of ``size`` (float32, seed 0) saved as an HF directory."""
    import transformers

    config = hf_config("llama")
    config.hidden_size, config.intermediate_size, config.vocab_size = size.hidden, size.intermediate, size.vocab
    config.head_dim = size.hidden // config.num_attention_heads
    config.max_position_embeddings = 4 * size.tokens
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(dest)
    return dest


def make_request(size: Size, seed: int) -> tuple[list[tinker.Datum], list[TrainDatum]]:
    """The same cross-entropy request as SDK datums and as engine datums (random tokens, unit weights)."""
    gen = torch.Generator().manual_seed(seed)
    sdk, engine = [], []
    for _ in range(size.datums):
        tokens = torch.randint(0, size.vocab, (size.tokens,), generator=gen)
        targets = torch.randint(0, size.vocab, (size.tokens,), generator=gen)
        weights = torch.ones(size.tokens)
        inputs = {"target_tokens": targets, "weights": weights}
        sdk.append(tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens.tolist()), loss_fn_inputs=dict(inputs)))
        engine.append(TrainDatum(tokens=tokens, inputs=inputs))
    return sdk, engine


def measure_size(name: str, size: Size, rounds: int, futures: int, work: Path) -> bool:
    """Figures 1 and 2 for one size; True when every check passed."""
    model_dir = write_model(size, work / name)
    backend = LocalBackend(str(model_dir), max_tokens_per_rank=MAX_TOKENS_PER_RANK, model_name=name)
    config = GatewayConfig(checkpoint_root=str(work / f"{name}-ckpt"), api_key=API_KEY, max_live_runs=2)
    direct = Trainer(load_model(str(model_dir), dtype=torch.float32), None, max_tokens_per_rank=MAX_TOKENS_PER_RANK)
    sdk_data, engine_data = make_request(size, seed=1)
    ok = True
    server = ServerThread(backend, config)
    url = server.start()
    on_backend_thread = server.service.executor  # see the module docstring
    try:
        service = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        client = service.create_lora_training_client(name, rank=0).result()
    except BaseException:
        server.stop()
        raise
    with service:
        for _ in range(3):  # warm-up: allocator, thread pools, connections
            on_backend_thread.submit(direct.forward_backward, engine_data, "cross_entropy").result()
            client.forward_backward(sdk_data, "cross_entropy").result()
        t_direct, t_sdk, same = [], [], True

        def run_direct() -> float:
            t0 = time.perf_counter()
            result = on_backend_thread.submit(direct.forward_backward, engine_data, "cross_entropy").result()
            t_direct.append(time.perf_counter() - t0)
            return result.metrics["loss:sum"]

        def run_sdk() -> float:
            t0 = time.perf_counter()
            loss = client.forward_backward(sdk_data, "cross_entropy").result().metrics["loss:sum"]
            t_sdk.append(time.perf_counter() - t0)
            return loss

        for r in range(rounds):  # alternate which side goes first, so neither always follows the other
            if r % 2 == 0:
                want = run_direct()
                got = run_sdk()
            else:
                got = run_sdk()
                want = run_direct()
            same &= got == want
        med_direct, med_sdk = statistics.median(t_direct), statistics.median(t_sdk)
        ratio = med_sdk / med_direct
        ok &= same and ratio <= RATIO_GOAL
        print(
            f"[1] {name:5s} {size.datums} x {size.tokens} tokens, hidden {size.hidden}, vocab {size.vocab}: "
            f"direct {med_direct * 1e3:.2f} ms, SDK {med_sdk * 1e3:.2f} ms (medians of {rounds}): "
            f"ratio {ratio:.3f}x (goal <= {RATIO_GOAL}x) {verdict(ratio, RATIO_GOAL)}, "
            f"overhead {(med_sdk - med_direct) * 1e3:.2f} ms per request; fastest rounds: "
            f"{min(t_sdk) / min(t_direct):.3f}x, {(min(t_sdk) - min(t_direct)) * 1e3:.2f} ms; "
            f"loss bit-identical in every round: {'PASS' if same else 'FAIL'}"
        )
        if futures:
            ok &= concurrent_futures(name, size, futures, client, direct, on_backend_thread)
    server.stop()
    return ok


def concurrent_futures(
    name: str, size: Size, n: int, client: tinker.TrainingClient, direct: Trainer, executor: Executor
) -> bool:
    """``n`` forward futures submitted before any result is read; each result checked against a direct forward
    (run through ``executor``, the gateway's backend thread)."""
    requests = [
        make_request(Size(size.hidden, size.intermediate, size.vocab, 1, size.tokens), 100 + i) for i in range(n)
    ]
    t0 = time.perf_counter()
    pending = [client.forward(sdk, "cross_entropy") for sdk, _ in requests]
    t_submit = time.perf_counter() - t0
    results = [f.result(timeout=600) for f in pending]
    t_all = time.perf_counter() - t0
    t1 = time.perf_counter()
    wants = [executor.submit(direct.forward, engine, "cross_entropy").result() for _, engine in requests]
    t_direct = time.perf_counter() - t1
    equal = 0
    for got, want in zip(results, wants, strict=True):
        mine = torch.tensor(got.loss_fn_outputs[0]["logprobs"].tolist(), dtype=torch.float32)
        equal += int(torch.equal(mine, want.outputs[0]["logprobs"].to(torch.float32)))
    done = sum(r is not None for r in results)
    passed = done == n and equal == n
    print(
        f"[2] {name:5s} {n} forward futures submitted in {t_submit * 1e3:.0f} ms before any result was read: "
        f"{done}/{n} completed, {equal}/{n} equal to a direct forward {'PASS' if passed else 'FAIL'}; "
        f"{t_all / n * 1e3:.2f} ms per future through the SDK vs {t_direct / n * 1e3:.2f} ms per direct forward"
    )
    return passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="interleaved direct/SDK rounds per size")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--futures", type=int, default=100, help="concurrent forward futures (0: skip)")
    parser.add_argument("--quick", action="store_true", help="10 rounds, tiny only")
    args = parser.parse_args(argv)
    rounds, sizes = (10, ["tiny"]) if args.quick else (args.rounds, args.sizes)
    torch.set_num_threads(torch.get_num_threads())  # the same intra-op pool serves both sides
    print(
        f"gateway overhead: tinker {tinker.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    ok = True
    with tempfile.TemporaryDirectory(prefix="ringtune-gateway-bench-") as tmp:
        for name in sizes:
            ok &= measure_size(name, SIZES[name], rounds, args.futures, Path(tmp))
    print("all PASS" if ok else "some FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
