"""``ringtune parity noise``: the noise floor of a precision, measured: the spread between mathematically equal
computations on one server.

One CP=1 server per precision runs the parity requests once as they are and once per permutation seed with every
request's datums sent in a seeded order (:func:`~ringtune.parity.client.run_parity` ``permute``): the packer puts
each datum in another row, at another offset, beside other datums, so every matmul, attention block and GDN scan
of a datum runs inside another batch. Mathematically nothing changes; the log-probs, losses and grad norms move
by the kernels' batch-dependent rounding only. :func:`noise_floors` takes, per figure, the largest value over the
seeds of compare's figures (the permuted run against the unpermuted one). ``limits.py`` derives the bfloat16 and
bf16-mixed limits from these floors (:func:`~ringtune.parity.limits.limits_from_noise`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ringtune.parity.client import run_parity
from ringtune.parity.compare import compare_dumps
from ringtune.parity.limits import NOISE_FIGURES
from ringtune.parity.servers import API_KEY, ServeSpec, running_server

PERMUTATIONS = (1, 2)
"""Permutation seeds of a noise measurement (each one more client run on the same server)."""


def noise_floors(reference: dict[str, Any], permuted: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per :data:`~ringtune.parity.limits.NOISE_FIGURES` key: the largest value over ``permuted`` of the
    compare figures it names (several figures under one key, e.g. every ``lp.short[...].max``: their max)."""
    floors = dict.fromkeys(NOISE_FIGURES, 0.0)
    for dump in permuted:
        for figure in compare_dumps(reference, dump).figures:
            for key, match in NOISE_FIGURES.items():
                if match(figure.name):
                    floors[key] = max(floors[key], float(figure.value))
    return floors


def measure_noise(
    spec: ServeSpec, workdir: Path, *, seeds: Sequence[int] = PERMUTATIONS, long_context: int | None = None
) -> tuple[dict[str, Any], dict[str, float]]:
    """Serve ``spec`` (a CP=1 server), run the parity requests unpermuted and once per seed permuted; returns the
    unpermuted dump and the :func:`noise_floors` (each dump written to ``workdir``)."""
    with running_server(spec, workdir) as url:
        common = {"api_key": API_KEY, "long_context": long_context, "lora_rank": spec.lora_rank}
        reference = run_parity(url, workdir / f"noise-{spec.name}.json", label=f"noise {spec.name}", **common)
        permuted = [
            run_parity(url, workdir / f"noise-{spec.name}-perm{s}.json", permute=s, label=f"perm{s}", **common)
            for s in seeds
        ]
    return reference, noise_floors(reference, permuted)


def write_floors(floors: dict[str, dict[str, float]], path: Path) -> None:
    """The measured floors per precision as JSON (what ``limits.py``'s ``MEASURED_NOISE`` was copied from)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(floors, indent=1, sort_keys=True))
