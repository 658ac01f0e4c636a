"""The parity client's long-row profile (``ringtune parity run --long-rows``): rows of many datums filled up to the
row budget, and a prompt long enough to take the sampler's mesh prefill.

- ``packed``: :data:`PACKED_DATUMS` datums of ``row_tokens // PACKED_DATUMS - 5`` tokens each, cut from the parity
  text (seeded), so one packed row holds them all, close to its budget: every CP rank holds a share of dozens of
  sequences (many zigzag chunks per rank, most of them a few tokens long). Sent as ``forward.packed`` (starting
  weights), ``long_step.packed`` (a forward-backward in the long step) and ``after.packed``.
- ``prefill.mesh``: ``compute_logprobs`` of the text datums' first :data:`MESH_PROMPT` tokens on a sampling client
  of the starting weights. A server started with ``--mesh-prompt-tokens`` at most that long prefills it on all of
  its ranks (the CP prefill of the sampler), so these log-probs come from the mesh path; compared position by
  position with the reference's (``lp.prefill.mesh.max``).

Both sides of a comparison must run the same profile (the request sets differ otherwise and compare refuses).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tinker

from ringtune.parity.datums import ParityDatum

PACKED_DATUMS = 48
"""Datums of the packed row: more than the 32 that ``long_row_positions_carried`` needs, more than any row of the
default requests holds (~22)."""
MESH_PROMPT = 384
"""Tokens of the mesh-prefill prompt (the matrix serves the long-row profile with ``--mesh-prompt-tokens`` 256)."""
MESH_PROMPT_TOKENS = 256
"""The ``--mesh-prompt-tokens`` the matrix gives a long-row server: prompts of at least this many tokens take the
mesh prefill."""


def packed_datums(stream: Sequence[int], *, row_tokens: int, seed: int) -> list[ParityDatum]:
    """:data:`PACKED_DATUMS` datums of ``row_tokens // PACKED_DATUMS - 5`` tokens (at least 4), cut at seeded
    offsets of ``stream`` (the parity text's token ids), targets the next token, weights in [0.5, 1.5]."""
    n = max(row_tokens // PACKED_DATUMS - 5, 4)
    rng = np.random.default_rng(seed + 17)
    base = list(stream) * (n // max(len(stream), 1) + 2)
    out = []
    for k in range(PACKED_DATUMS):
        start = int(rng.integers(0, len(stream)))
        window = base[start : start + n + 1]
        weights = tuple(float(w) for w in rng.uniform(0.5, 1.5, n))
        out.append(ParityDatum(f"packed{k}", "short", tuple(window[:-1]), tuple(window[1:]), weights))
    return out


def mesh_prompts(text: Sequence[ParityDatum]) -> list[tuple[str, list[int]]]:
    """The mesh-prefill prompts: the first :data:`MESH_PROMPT` tokens of each text datum at least that long."""
    return [(d.name, list(d.tokens[:MESH_PROMPT])) for d in text if len(d.tokens) >= MESH_PROMPT]


def mesh_prefill_record(tc: tinker.TrainingClient, prompts: Sequence[tuple[str, list[int]]]) -> dict[str, Any]:
    """``compute_logprobs`` of each prompt on a sampling client of ``tc``'s current weights: the dump's
    ``prefill.mesh`` record (``logprobs[i]`` [len(prompt) - 1]: the log-prob of token t+1 given tokens ≤ t)."""
    sampler = tc.save_weights_and_get_sampling_client().result()
    futures = [sampler.compute_logprobs(tinker.ModelInput.from_ints(tokens)) for _, tokens in prompts]
    logprobs = []
    for (name, tokens), future in zip(prompts, futures, strict=True):
        values = future.result()
        scored = [float(v) for v in values if v is not None]
        if len(scored) != len(tokens) - 1:
            raise ValueError(f"prompt {name}: compute_logprobs scored {len(scored)} of {len(tokens) - 1} tokens")
        logprobs.append(scored)
    return {
        "datums": [name for name, _ in prompts],
        "kinds": ["prefill"] * len(prompts),
        "lengths": [len(t) - 1 for _, t in prompts],
        "logprobs": logprobs,
    }
