"""The per-position log-prob delta plot of a comparison (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ringtune.parity.compare import Comparison

FLOOR = 1e-12
"""Exact zeros are drawn at this height (log scale)."""


def plot_deltas(result: Comparison, path: str | Path) -> Path:
    """PNG of ``|lp_B - lp_A|`` over the long rows' positions (datums side by side), zigzag chunk boundaries
    dotted grey, chunkwise-GDN split rows dashed red, datum edges solid black; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 3.6), dpi=100)
    offset = 0
    split_label = boundary_label = None
    for row in result.deltas:
        d = np.maximum(row["abs"], FLOOR)
        x = offset + np.arange(d.size)
        ax.plot(x, d, lw=0.5, color="tab:blue")
        for b in row["boundaries"]:
            boundary_label = ax.axvline(offset + b, color="0.6", ls=":", lw=0.6)
        for s in row["splits"]:
            split_label = ax.axvline(offset + s, color="tab:red", ls="--", lw=0.9)
        ax.axvline(offset, color="k", lw=0.8)
        ax.text(offset + 2, 1.0, row["datum"], fontsize=7, va="top", transform=ax.get_xaxis_transform())
        offset += d.size
    ax.set_yscale("log")
    ax.set_xlim(0, max(offset, 1))
    ax.set_xlabel("position (long rows of forward.main and forward.long, side by side)")
    ax.set_ylabel("|Δ log-prob|")
    verdict = "pass" if not result.failures else f"FAIL: {', '.join(f.name for f in result.failures[:3])}"
    ax.set_title(f"{result.candidate} vs {result.reference} ({result.dtype}): {verdict}", fontsize=9)
    marks = [(h, t) for h, t in ((boundary_label, "zigzag chunk boundary"), (split_label, "GDN split row")) if h]
    if marks:
        ax.legend([h for h, _ in marks], [t for _, t in marks], fontsize=7, loc="lower right")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
