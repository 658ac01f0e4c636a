"""The online-softmax merge of attention partial results: one rule for the per-block and the varlen paths."""

from __future__ import annotations

import torch


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """In place: ``out, lse <- merge((out, lse), (block_out, block_lse))`` by the online-softmax rule."""
    block_lse = block_lse.to(lse.dtype)
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1))
    out.add_(block_out.to(out.dtype) * torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)
