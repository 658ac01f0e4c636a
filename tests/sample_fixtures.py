"""Tiny random checkpoints whose next-token distributions are not trivial, for the sampling tests.

``hf_model`` initialises matrices with std 0.02, so after 4 layers the residual stream is still the input
embedding and a tied model predicts its own last input token (greedy decoding repeats it). Scaling every
non-embedding matrix by 10 makes the layers matter: greedy continuations vary token to token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.tiny_models import hf_model

SCALE = 10.0


def sharp_hf_model(family: str, *, seed: int):
    """``hf_model(family, seed=seed)`` (float32, eval) with every non-embedding matrix multiplied by SCALE."""
    model = hf_model(family, seed=seed).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(SCALE)
    return model


def sharp_checkpoint(family: str, dest: Path, *, seed: int = 2):
    """Save :func:`sharp_hf_model` to ``dest``; returns the transformers model."""
    model = sharp_hf_model(family, seed=seed)
    model.save_pretrained(dest)
    return model


def random_prompts(lens: tuple[int, ...], vocab: int, *, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for the module: these models are tiny, and on a shared 2-core machine two spinning
    OpenMP threads per op made a decode step 50x slower (measured 7.8 s vs 0.14 s for the same generate)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
