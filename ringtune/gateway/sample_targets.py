"""Tinker's ``target_prompt_logprobs``: K candidate token ids per prompt position in, their log-probs out.

The request carries a JSON ``TensorData`` of int64 ids, shape ``[len(prompt) − 1, K]``: cell ``[i, j]`` asks
for ``log p(id | prompt[:i+1])``, the model's distribution at prompt position ``i + 1``; ``−1`` asks for
nothing. It is dense (``data`` holds every cell) or sparse CSR (``sparse_crow_indices`` /
``sparse_col_indices`` list the cells that ask; the others are −1). The response's
``SampleResponse.target_prompt_logprobs`` is a float32 ``Tensor`` of the same shape **and layout** (the
same CSR indices when the request was sparse), 0.0 where nothing was asked.

The ids become the worker's ``SampleRequest.target_tokens`` (dense, −1 = none), scored by the training
head's [T, K] labels in the prefill (:mod:`ringtune.sample.prefill`, :mod:`ringtune.sample.mesh_prompts`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tinker.proto import tinker_public_pb2 as pb

from ringtune.engine.batch import MAX_TARGET_K
from ringtune.errors import UserInputError
from ringtune.gateway.proto import csr_to_dense

FIELD = "target_prompt_logprobs"


@dataclass(frozen=True)
class TargetLayout:
    """How the request laid its targets out: ``shape`` [rows, K], and the CSR indices if it was sparse."""

    shape: tuple[int, int]
    crow: tuple[int, ...] | None = None
    col: tuple[int, ...] | None = None


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise UserInputError(f"{FIELD}.{name}: expected a list of integers")
    return value


def parse_targets(value: Any, prompt_len: int, vocab_size: int) -> tuple[torch.Tensor, TargetLayout]:
    """The JSON ``TensorData`` -> (int64 [prompt_len − 1, K] dense ids with −1 = none, its layout).

    Raises UserInputError naming the part of the field that is wrong, its value and the limit.
    """
    if not isinstance(value, dict):
        raise UserInputError(f"{FIELD}: expected a TensorData object, got {type(value).__name__}")
    if value.get("dtype") != "int64":
        raise UserInputError(f"{FIELD}.dtype={value.get('dtype')!r} must be 'int64' (token ids)")
    shape = _int_list(value.get("shape"), "shape")
    rows = prompt_len - 1
    if len(shape) != 2 or shape[0] != rows or not 1 <= shape[1] <= MAX_TARGET_K:
        raise UserInputError(
            f"{FIELD}.shape={shape} must be [len(prompt) - 1 = {rows}, K] with 1 <= K <= {MAX_TARGET_K}"
        )
    k = shape[1]
    data = _int_list(value.get("data"), "data")
    crow_raw, col_raw = value.get("sparse_crow_indices"), value.get("sparse_col_indices")
    if crow_raw is None and col_raw is None:
        if len(data) != rows * k:
            raise UserInputError(f"{FIELD}.data: {len(data)} values for shape [{rows}, {k}] (need {rows * k})")
        ids = torch.tensor(data, dtype=torch.int64, device="cpu").reshape(rows, k)  # wire values, on the host
        layout = TargetLayout((rows, k))
    else:
        crow, col = _int_list(crow_raw, "sparse_crow_indices"), _int_list(col_raw, "sparse_col_indices")
        dense = csr_to_dense(
            np.array(data, dtype=np.int64),
            np.array(crow, dtype=np.int64),
            np.array(col, dtype=np.int64),
            (rows, k),
            (f"{FIELD}.sparse_crow_indices", f"{FIELD}.sparse_col_indices"),
            fill=-1,
        )
        ids = torch.from_numpy(dense)
        layout = TargetLayout((rows, k), tuple(crow), tuple(col))
    if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= vocab_size):
        bad = int(ids.min()) if int(ids.min()) < -1 else int(ids.max())
        raise UserInputError(f"{FIELD}: token id {bad} is outside [-1, vocab_size={vocab_size})")
    return ids, layout


def encode_targets(logprobs: torch.Tensor, layout: TargetLayout) -> pb.Tensor:
    """Log-probs [rows, K] -> the response's float32 ``Tensor`` in the request's layout."""
    flat: list[float]
    if layout.crow is None or layout.col is None:
        flat = logprobs.reshape(-1).tolist()
        return pb.Tensor(dense=struct.pack(f"<{len(flat)}f", *flat), dtype=pb.DTYPE_FLOAT32, shape=list(layout.shape))
    rows_of = [r for r in range(layout.shape[0]) for _ in range(layout.crow[r], layout.crow[r + 1])]
    flat = [float(logprobs[r, c]) for r, c in zip(rows_of, layout.col, strict=True)]
    csr = pb.SparseCsr(
        values=struct.pack(f"<{len(flat)}f", *flat),
        crow_indices=struct.pack(f"<{len(layout.crow)}q", *layout.crow),
        col_indices=struct.pack(f"<{len(layout.col)}q", *layout.col),
    )
    return pb.Tensor(sparse_csr=csr, dtype=pb.DTYPE_FLOAT32, shape=list(layout.shape))
