"""``ringtune parity run``: send the fixed parity requests to a running server through the real ``tinker`` SDK and
write what came back to a JSON dump that ``ringtune parity compare`` reads.

Requests, in order, on one fresh training run (``lora_rank`` 0 = full fine-tuning; the cookbook's LoRA runs use 32):

1. ``forward.main`` / ``forward.lone`` / ``forward.long``: cross-entropy forwards of the main set (short + text
   rows), of the lone 7-token datum, and of the two long datums (the weights at start).
2. ``cross_entropy`` then ``optim_step``; ``importance_sampling`` then ``optim_step``; ``cispo`` then
   ``optim_step`` (main set). IS and CISPO take sampler log-probs ``q`` = this server's ``forward.main`` log-probs
   plus seeded noise (sd 0.05) and seeded N(0, 1) advantages, so ``exp(lp - q)`` stays near 1 on any model; the
   difference of ``q`` between two servers is their forward deviation, as for a real sampler.
3. ``long_step.lone``, ``long_step.long`` (loss on the second half) and ``long_step.tail`` (loss on the last
   1/16: every CP rank but 0 holds no scored token) then ``optim_step``.
4. ``after.main`` / ``after.long``: forwards after the four steps.

On a server that takes images (its capabilities' ``image_dir``), the image datums of
:mod:`ringtune.parity.image_datums` (text with 1, 2 and 3 PNG images) join as ``forward.images`` (after
``forward.long``), ``long_step.images`` (in the last step's group) and ``after.images``; the data digest covers them.

The first step is plain AdamW (:data:`ADAM`); the other three add weight decay and gradient clipping
(:data:`ADAM_DECAY`). Each record keeps per-datum log-probs and summed losses; ``grad_norms`` the four steps'
``grad_norm:mean``; ``replica_check`` each step's replica check (milliseconds, tensors compared). A request that
fails with a server error (e.g. replicas that diverged) ends the run: the dump records it in ``server_error``
(request and message) and holds what came back before.
The server's layout (CP, DP, dtype, per-rank budget, CP modes, debug fault) comes from the ``ringtune`` key of
``GET /api/v1/get_server_capabilities``. The served probes (``probes``: the ring's accumulation precision,
run by the server on its own ranks) are recorded too. Last, when the server samples (``sampleable``), the
on-policy check KL(sampler ‖ trainer) on the weights after the steps (:mod:`ringtune.parity.sampler_kl`);
otherwise the dump records it as skipped, with the reason.

Options (each recorded in the dump's ``settings``; compare refuses dumps whose request sets differ):
``lora_rank`` > 0 runs the requests on a LoRA run of that rank; ``companion`` adds a second run of the same rank
whose every request is submitted just before the first run's, so a server with ``--lora-pass-runs`` >= 2 can join
them in one pass (the dump's ``lora_pass_runs`` is the most runs a pass of the first run held); ``long_rows`` adds
the long-row profile (:mod:`ringtune.parity.long_rows`); ``permute`` (a seed) sends every request's datums in a
seeded order and puts the outputs back in the datums' order: the same computation packed differently, whose
spread against an unpermuted run of the same server is the noise floor of its precision
(``ringtune parity noise``).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import tinker

from ringtune.parity.datums import DatumSet, ParityDatum, build_datum_set, text_token_stream
from ringtune.parity.image_datums import (
    ImageChunkSpec,
    ImageParityDatum,
    build_image_datums,
    image_digest,
    load_image_side,
)
from ringtune.parity.long_rows import mesh_prefill_record, mesh_prompts, packed_datums
from ringtune.parity.sampler_kl import measure_sampler_kl, sampler_prompts, skipped_sampler_kl
from ringtune.probes.ring_accumulation import SERVED_PROBES

FORMAT = "ringtune-parity/1"
ADAM = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
"""One small AdamW step per loss: lr 1e-4 moves weights by ~1e-4 (sign-like first steps), enough for the
post-step log-probs to show a wrong update, small enough that both layouts stay in the same basin."""
ADAM_DECAY = {**ADAM, "weight_decay": 0.1, "grad_clip_norm": 1e-3}
"""Steps 2-4: decoupled weight decay (a replica that skips it drifts by lr·wd·|w| per step) and clipping far
below any real summed-loss grad norm (the clip scale is applied on every step; Adam's update barely depends on
it, but the clipping path runs and must agree across ranks)."""
TOKENIZER_MIN_VOCAB = 1000
"""Below this vocabulary the served tokenizer is a test one (no English words): text rows use bytes mod vocab."""


def server_layout(url: str, api_key: str | None) -> dict[str, Any]:
    """The ``ringtune`` layout block and the first supported model of the server's capabilities."""
    headers = {"X-API-Key": api_key} if api_key else {}
    response = httpx.get(f"{url.rstrip('/')}/api/v1/get_server_capabilities", headers=headers, timeout=30)
    response.raise_for_status()
    body = response.json()
    if "ringtune" not in body:
        raise ValueError(f"{url} is not a ringtune server (no 'ringtune' layout in its capabilities)")
    return {"layout": body["ringtune"], "model": body["supported_models"][0]}


def served_probes(url: str, api_key: str | None) -> dict[str, Any]:
    """Each served probe's summary (``POST /api/v1/ringtune/probe``: the server runs it on its own ranks, modes,
    dtype and debug fault; :mod:`ringtune.probes.ring_accumulation`); a probe that failed records why."""
    headers = {"X-API-Key": api_key} if api_key else {}
    out: dict[str, Any] = {}
    for name in SERVED_PROBES:
        response = httpx.post(
            f"{url.rstrip('/')}/api/v1/ringtune/probe", json={"name": name}, headers=headers, timeout=600
        )
        out[name] = response.json() if response.status_code == 200 else {"applies": False, "why": response.text[:300]}
    return out


def _to_tinker(d: ParityDatum, extra: dict[str, list[float]] | None = None) -> tinker.Datum:
    inputs: dict[str, Any] = {"target_tokens": list(d.targets)}
    inputs.update(extra if extra is not None else {"weights": list(d.weights)})
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(list(d.tokens)), loss_fn_inputs=inputs)


def _image_to_tinker(d: ImageParityDatum) -> tinker.Datum:
    chunks: list[Any] = [
        tinker.types.ImageChunk(data=c.png, format="png", expected_tokens=c.expected_tokens)
        if isinstance(c, ImageChunkSpec)
        else tinker.EncodedTextChunk(tokens=list(c))
        for c in d.chunks
    ]
    inputs = {"target_tokens": list(d.targets), "weights": list(d.weights)}
    return tinker.Datum(model_input=tinker.ModelInput(chunks=chunks), loss_fn_inputs=inputs)


def _record(result: Any, datums: Sequence[ParityDatum], order: Sequence[int] | None = None) -> dict[str, Any]:
    """The dump's record of one request; ``order[j]``: the datum index whose output is the j-th returned."""
    outputs = list(result.loss_fn_outputs)
    if order is not None:
        back: list[Any] = [None] * len(outputs)
        for j, i in enumerate(order):
            back[i] = outputs[j]
        outputs = back
    return {
        "datums": [d.name for d in datums],
        "kinds": [d.kind for d in datums],
        "lengths": [len(d.targets) for d in datums],
        "logprobs": [[float(x) for x in o["logprobs"].to_torch().double().tolist()] for o in outputs],
        "losses": [float(o["elementwise_loss"].to_torch().double().sum()) for o in outputs],
        "loss_sum": float(result.metrics["loss:sum"]),
    }


def _policy_inputs(datums: Sequence[ParityDatum], q: Sequence[Sequence[float]], rng: np.random.Generator):
    out = []
    for d, lp in zip(datums, q, strict=True):
        n = len(d.tokens)
        sampler = (np.asarray(lp) + rng.normal(0.0, 0.05, n)).tolist()
        out.append(_to_tinker(d, {"logprobs": sampler, "advantages": rng.normal(0.0, 1.0, n).tolist()}))
    return out


def run_parity(
    url: str,
    out: str | Path,
    *,
    api_key: str | None = None,
    seed: int = 0,
    long_context: int | None = None,
    label: str | None = None,
    lora_rank: int = 0,
    companion: bool = False,
    long_rows: bool = False,
    permute: int | None = None,
) -> dict[str, Any]:
    """Run the parity requests against ``url`` and write the dump to ``out`` (JSON); returns the dump.

    ``long_context`` caps the longest datums below the server's context (small machines); both runs compared
    must use the same value (the data digest differs otherwise and compare refuses). ``lora_rank``,
    ``companion``, ``long_rows`` and ``permute``: the module docstring's options.
    """
    if companion and lora_rank < 1:
        raise ValueError("companion=True joins LoRA passes: it needs lora_rank >= 1")
    started = time.time()
    described = server_layout(url, api_key)
    layout, model = described["layout"], described["model"]
    context = int(model["max_context_length"])
    vocab = int(layout["vocab_size"])
    with tinker.ServiceClient(base_url=url, api_key=api_key or "tml-local") as sc:
        # A LoRA run's adapters start from its seed (the gateway draws one when none is given): seeded, so that the
        # reference and the candidate train the same adapters.
        lora_seed = {"seed": seed} if lora_rank else {}  # full fine-tuning (rank 0) as before
        tc = sc.create_lora_training_client(model["model_name"], rank=lora_rank, **lora_seed).result()
        partner = None
        if companion:
            partner = sc.create_lora_training_client(model["model_name"], rank=lora_rank, seed=seed + 1).result()
        encode = None
        if vocab >= TOKENIZER_MIN_VOCAB:
            tokenizer = tc.get_tokenizer()
            encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        stream = text_token_stream(vocab, encode)
        data: DatumSet = build_datum_set(
            seed=seed, vocab_size=vocab, context_length=context, stream=stream, long_context=long_context
        )
        images: tuple[ImageParityDatum, ...] = ()
        if layout.get("image_dir"):  # a server that takes images: the image datums too
            processor, ids = load_image_side(layout["image_dir"])
            images = build_image_datums(seed=seed, stream=stream, processor=processor, ids=ids)
        packed = packed_datums(stream, row_tokens=context, seed=seed) if long_rows else []
        rng = np.random.default_rng(seed + 1)
        shuffle = np.random.default_rng(permute) if permute is not None else None
        records: dict[str, Any] = {}
        grad_norms: dict[str, float] = {}
        replica_check: dict[str, dict[str, float]] = {}
        pass_runs: list[float] = []
        server_error: dict[str, str] | None = None

        def submit(call: str, batch: list[tinker.Datum], loss_fn: str, datums: Sequence[ParityDatum]):
            order = list(shuffle.permutation(len(batch))) if shuffle is not None else None
            sent = [batch[i] for i in order] if order is not None else batch
            twin = getattr(partner, call)(sent, loss_fn) if partner is not None else None
            result = getattr(tc, call)(sent, loss_fn).result()
            if twin is not None:
                twin.result()
            pass_runs.append(float(result.metrics.get("lora_pass_runs:max", 1.0)))
            return _record(result, datums, order)

        def forward(name: str, datums: Sequence[ParityDatum]) -> None:
            records[name] = submit("forward", [_to_tinker(d) for d in datums], "cross_entropy", datums)

        def train(name: str, datums: Sequence[ParityDatum], inputs: list[tinker.Datum] | None = None) -> None:
            loss_fn = name if inputs is not None else "cross_entropy"
            batch = inputs if inputs is not None else [_to_tinker(d) for d in datums]
            records[name] = submit("forward_backward", batch, loss_fn, datums)

        def forward_images(name: str) -> None:
            batch = [_image_to_tinker(d) for d in images]
            records[name] = _record(tc.forward(batch, "cross_entropy").result(), images)

        def train_images(name: str) -> None:
            batch = [_image_to_tinker(d) for d in images]
            records[name] = _record(tc.forward_backward(batch, "cross_entropy").result(), images)

        def step(name: str, params: dict[str, float]) -> None:
            twin = partner.optim_step(tinker.AdamParams(**params)) if partner is not None else None
            metrics = tc.optim_step(tinker.AdamParams(**params)).result().metrics
            if twin is not None:
                twin.result()
            grad_norms[name] = float(metrics["grad_norm:mean"])
            replica_check[name] = {
                "ms": float(metrics.get("replica_check_ms:max", float("nan"))),
                "tensors": float(metrics.get("replica_tensors:max", 0.0)),
            }

        main, long = list(data.main), [*data.long, data.tail]

        def _policy(datums: Sequence[ParityDatum]) -> list[tinker.Datum]:
            return _policy_inputs(datums, records["forward.main"]["logprobs"], rng)

        requests = [
            ("forward.main", lambda: forward("forward.main", main)),
            ("forward.lone", lambda: forward("forward.lone", [data.lone])),
            ("forward.long", lambda: forward("forward.long", long)),
            *([("forward.images", lambda: forward_images("forward.images"))] if images else []),
            ("cross_entropy", lambda: train("cross_entropy", main)),
            ("optim_step cross_entropy", lambda: step("cross_entropy", ADAM)),
            ("importance_sampling", lambda: train("importance_sampling", main, _policy(main))),
            ("optim_step importance_sampling", lambda: step("importance_sampling", ADAM_DECAY)),
            ("cispo", lambda: train("cispo", main, _policy(main))),
            ("optim_step cispo", lambda: step("cispo", ADAM_DECAY)),
            ("long_step.lone", lambda: train("long_step.lone", [data.lone])),
            ("long_step.long", lambda: train("long_step.long", list(data.long))),
            ("long_step.tail", lambda: train("long_step.tail", [data.tail])),
            *([("long_step.images", lambda: train_images("long_step.images"))] if images else []),
            ("optim_step long_step", lambda: step("long_step", ADAM_DECAY)),
            ("after.main", lambda: forward("after.main", main)),
            ("after.long", lambda: forward("after.long", long)),
            *([("after.images", lambda: forward_images("after.images"))] if images else []),
        ]
        if long_rows:  # the packed row at start, in the long step, and after it
            requests.insert(3, ("forward.packed", lambda: forward("forward.packed", packed)))
            at = [n for n, _ in requests].index("optim_step long_step")
            requests.insert(at, ("long_step.packed", lambda: train("long_step.packed", packed)))
            requests.append(("after.packed", lambda: forward("after.packed", packed)))
        for name, request in requests:
            try:
                request()
            except tinker.RequestFailedError as exc:  # a server error ends the run (later requests would fail too)
                server_error = {"request": name, "message": str(exc)}
                break
        prompts = mesh_prompts([d for d in main if d.kind == "text"]) if long_rows else []
        if prompts and server_error is None and model.get("sampleable"):
            try:
                records["prefill.mesh"] = mesh_prefill_record(tc, prompts)
            except tinker.RequestFailedError as exc:
                server_error = {"request": "prefill.mesh", "message": str(exc)}
        if server_error is not None:
            sampler_kl = skipped_sampler_kl(f"a request failed: {server_error['message'][:200]}")
        elif model.get("sampleable"):
            sampler_kl = measure_sampler_kl(tc, sampler_prompts(data, context), seed=seed + 2)
        else:
            sampler_kl = skipped_sampler_kl(
                f"the server does not sample (get_server_capabilities: sampleable={model.get('sampleable')})"
            )
    probes = served_probes(url, api_key)
    dump = {
        "format": FORMAT,
        "label": label or url,
        "url": url,
        "model_name": model["model_name"],
        "layout": layout,
        "context_length": context,
        "settings": {
            "seed": seed,
            "long_context": long_context,
            "adam": ADAM,
            "adam_decay": ADAM_DECAY,
            "text": "tokenizer" if encode else "bytes",
            "lora_rank": lora_rank,
            "companion": companion,
            "long_rows": long_rows,
            "permute": permute,
        },
        "lora_pass_runs": max(pass_runs, default=1.0),
        "data_digest": data.digest()
        if not images
        else hashlib.sha256((data.digest() + image_digest(images)).encode()).hexdigest(),
        "records": records,
        "grad_norms": grad_norms,
        "replica_check": replica_check,
        "server_error": server_error,
        "sampler_kl": sampler_kl,
        "probes": probes,
        "seconds": round(time.time() - started, 2),
    }
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dump))
    return dump


def load_dump(path: str | Path) -> dict[str, Any]:
    """A dump written by :func:`run_parity` (ValueError if it is not one)."""
    dump = json.loads(Path(path).read_text())
    if dump.get("format") != FORMAT:
        raise ValueError(f"{path}: not a parity dump (format {dump.get('format')!r}, want {FORMAT!r})")
    return dump
