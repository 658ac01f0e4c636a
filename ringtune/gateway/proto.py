"""The SDK's protobuf messages for forward/forward_backward: decode the request, encode the output.

Uses the schema the SDK ships (``tinker.proto.tinker_public_pb2``), so the bytes are exactly what
``tinker/proto/request_conv.py`` writes and ``response_conv.py`` reads. Pure functions, no torch.

Request (``ForwardBackwardRequest``): every datum's input tokens are the concatenation of its
``encoded_text`` chunks (int32 little-endian); its ``image`` chunks (raw bytes, ``format``, optional
``expected_tokens``) are kept as :class:`WireImage` at their text offsets when the
caller accepts images (a vision-language model; expanded by :mod:`ringtune.gateway.image_chunks`), else refused;
each ``loss_fn_inputs`` tensor is dense bytes or CSR
(``values`` in the declared dtype, ``crow_indices``/``col_indices`` int64, missing entries 0), dtype
FLOAT32 or INT64, row-major with ``shape``. ``loss_fn_config_v2`` wins over the legacy map when set. A datum's
``model_input_spans`` / ``loss_fn_input_spans`` (``Datum.with_provenance``: runs of ``prompt_tokens`` or
``sampled_tokens``, each a ``sequence_id``, ``offset`` and ``length``) are decoded as given, both or neither;
:mod:`ringtune.gateway.provenance` checks and resolves them.

Output (``ForwardBackwardOutput``): one ``ArrayRecord`` with ``num_datums`` set and one ``BatchedTensor`` per
field: per-datum float32 arrays back to back, int64 *byte* offsets (``num_datums + 1`` of them, from 0),
``trailing_shape`` = every dim after the first (``[]`` for ``[N]`` outputs, ``[K]`` for ``[N, K]``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from ringtune.errors import UserInputError

MAX_TENSOR_ELEMENTS = 1 << 26
"""Largest tensor (elements, after CSR expansion) one ``loss_fn_inputs`` entry may hold."""

_DTYPES: dict[int, np.dtype] = {pb.DTYPE_FLOAT32: np.dtype("<f4"), pb.DTYPE_INT64: np.dtype("<i8")}
OUTPUT_TYPE = "ArrayRecord"


@dataclass(frozen=True)
class WireImage:
    """One image chunk as a request gives it.

    - ``data``: the encoded bytes; ``format``: ``png`` / ``jpeg``; ``expected_tokens``: the client's count or None.
    - ``offset``: how many text tokens of the model input come before it.
    - ``where``: its field path for error messages (``data[0].model_input.chunks[2]``, ``prompt.chunks[1]``).
    """

    data: bytes
    format: str
    expected_tokens: int | None
    offset: int
    where: str


def refuse_images(images: Sequence[WireImage]) -> None:
    """A text-only model's answer to image chunks: UserInputError naming the first one (none: nothing)."""
    if images:
        raise UserInputError(
            f"{images[0].where}: image chunks are not supported; this server trains text models "
            "(send encoded_text chunks only)"
        )


@dataclass(frozen=True)
class ProvenanceSpan:
    """One run of a datum's provenance: positions ``[offset, offset + length)`` of the named sequence's prompt
    (``sampled`` False: a ``PromptProvenanceSpan``) or of its sampled tokens (``sampled`` True)."""

    sampled: bool
    sequence_id: str
    offset: int
    length: int


@dataclass(frozen=True)
class WireDatum:
    """One decoded datum: ``tokens`` int64 [N] (its text tokens); ``inputs`` name -> dense float32 / int64 array;
    ``images`` its image chunks in order (offsets into ``tokens``), not yet decoded; its provenance (runs tiling
    the input tokens, runs tiling the loss rows) or None for each when it sent none."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray]
    model_input_spans: tuple[ProvenanceSpan, ...] | None = None
    loss_fn_input_spans: tuple[ProvenanceSpan, ...] | None = None
    images: tuple[WireImage, ...] = ()


@dataclass(frozen=True)
class ForwardBackwardCall:
    """A decoded ``ForwardBackwardRequest``. ``loss_config`` values are floats or (v2 text) strings."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_config: dict[str, float | str]
    forward_only: bool
    data: list[WireDatum]


def parse_request(body: bytes) -> pb.ForwardBackwardRequest:
    """Parse the wire bytes; UserInputError when they are not a ``ForwardBackwardRequest`` message."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise UserInputError(
            f"request body ({len(body)} bytes) is not a tinker_public.ForwardBackwardRequest protobuf: {exc}"
        ) from None
    return msg


def _flat_values(raw: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise UserInputError(f"{where}: {len(raw)} bytes is not a multiple of {dtype.itemsize} ({dtype.name})")
    return np.frombuffer(raw, dtype=dtype)


def decode_tensor(msg: pb.Tensor, where: str) -> np.ndarray:
    """A proto ``Tensor`` as a dense numpy array (native byte order, a copy).

    Args:
        msg: dense or ``sparse_csr`` tensor, dtype FLOAT32 or INT64; no shape means 1-D.
        where: the field name for error messages (e.g. ``data[3].loss_fn_inputs['weights']``).
    Raises:
        UserInputError: unsupported dtype, byte count or element count not matching ``shape``, a negative
            dim, more than :data:`MAX_TENSOR_ELEMENTS` elements, or malformed CSR indices.
    """
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        name = pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else str(msg.dtype)
        raise UserInputError(f"{where}: dtype {name} is not supported; send FLOAT32 or INT64")
    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape):
        raise UserInputError(f"{where}: shape {shape} has a negative dim")
    numel = math.prod(shape) if shape else None
    if numel is not None and numel > MAX_TENSOR_ELEMENTS:
        raise UserInputError(f"{where}: shape {shape} holds {numel} elements; the limit is {MAX_TENSOR_ELEMENTS}")
    if msg.WhichOneof("encoding") == "sparse_csr":
        return _decode_csr(msg.sparse_csr, dtype, shape, where)
    values = _flat_values(msg.dense, dtype, where)
    if numel is None:
        shape = [values.size]
    elif values.size != numel:
        raise UserInputError(f"{where}: {values.size} values for shape {shape} ({numel} expected)")
    return values.reshape(shape).astype(dtype.newbyteorder("="), copy=True)


def _decode_csr(csr: pb.SparseCsr, dtype: np.dtype, shape: list[int], where: str) -> np.ndarray:
    if len(shape) != 2:
        raise UserInputError(f"{where}: a sparse_csr tensor needs a 2-D shape, got {shape}")
    values = _flat_values(csr.values, dtype, f"{where}.sparse_csr.values")
    crow = _flat_values(csr.crow_indices, np.dtype("<i8"), f"{where}.sparse_csr.crow_indices")
    col = _flat_values(csr.col_indices, np.dtype("<i8"), f"{where}.sparse_csr.col_indices")
    fields = (f"{where}.sparse_csr.crow_indices", f"{where}.sparse_csr.col_indices")
    return csr_to_dense(values.astype(dtype.newbyteorder("=")), crow, col, (shape[0], shape[1]), fields)


def csr_to_dense(
    values: np.ndarray,
    crow: np.ndarray,
    col: np.ndarray,
    shape: tuple[int, int],
    fields: tuple[str, str],
    *,
    fill: float = 0,
) -> np.ndarray:
    """A checked CSR tensor (``values`` [nnz], ``crow`` [rows + 1], ``col`` [nnz]) -> dense ``shape``, ``fill``
    where no value is listed. ``fields`` name the two index arrays in the UserInputError of a bad one."""
    rows, cols = shape
    if crow.size != rows + 1 or crow[0] != 0 or np.any(np.diff(crow) < 0) or crow[-1] != values.size:
        raise UserInputError(
            f"{fields[0]}: need {rows + 1} non-decreasing offsets from 0 to "
            f"{values.size} (the number of values); got {crow.size} offsets ending at {crow[-1] if crow.size else None}"
        )
    if col.size != values.size or (col.size and (col.min() < 0 or col.max() >= cols)):
        raise UserInputError(
            f"{fields[1]}: need {values.size} column indices in [0, {cols}); got {col.size} "
            f"in [{col.min() if col.size else None}, {col.max() if col.size else None}]"
        )
    dense = np.full((rows, cols), fill, dtype=values.dtype)
    row_of = np.repeat(np.arange(rows), np.diff(crow))
    dense[row_of, col] = values
    return dense


def _chunks(datum: pb.Datum, i: int, accept_images: bool) -> tuple[np.ndarray, tuple[WireImage, ...]]:
    """The datum's text tokens (int64) and image chunks; images refused (UserInputError) unless accepted."""
    parts, images, length = [], [], 0
    for j, chunk in enumerate(datum.model_input):
        kind, where = chunk.WhichOneof("chunk"), f"data[{i}].model_input.chunks[{j}]"
        if kind == "image":
            image = chunk.image
            expected = int(image.expected_tokens) if image.HasField("expected_tokens") else None
            images.append(WireImage(bytes(image.data), image.format, expected, length, where))
            if not accept_images:
                refuse_images(images)
            if image.HasField("override_dimensions"):
                raise UserInputError(f"{where}.override_dimensions: not supported; send the image at its size")
            continue
        if kind != "encoded_text":
            raise UserInputError(
                f"{where}: {kind or 'empty'} chunks are not supported; this server trains text models "
                "(send encoded_text chunks only)"
            )
        parts.append(_flat_values(chunk.encoded_text.tokens, np.dtype("<i4"), where))
        length += parts[-1].size
    return np.concatenate([np.zeros(0, np.int64), *parts]).astype(np.int64), tuple(images)


def _spans(spans, where: str) -> tuple[ProvenanceSpan, ...] | None:
    """A repeated ``ProvenanceSpan`` field as :class:`ProvenanceSpan` runs (None when empty)."""
    out = []
    for j, span in enumerate(spans):
        kind = span.WhichOneof("span")
        if kind is None:
            raise UserInputError(f"{where}[{j}]: neither prompt_tokens nor sampled_tokens is set")
        arm = getattr(span, kind)
        if not arm.sequence_id:
            raise UserInputError(f"{where}[{j}]: empty sequence_id")
        out.append(ProvenanceSpan(kind == "sampled_tokens", arm.sequence_id, int(arm.offset), int(arm.length)))
    return tuple(out) or None


def decode_loss_config(msg: pb.ForwardBackwardRequest) -> dict[str, float | str]:
    """The request's ``loss_fn_config_v2`` (numbers and text) or, when absent, ``loss_fn_config``."""
    if msg.loss_fn_config_v2:
        config: dict[str, float | str] = {}
        for key, value in msg.loss_fn_config_v2.items():
            kind = value.WhichOneof("value")
            if kind is None:
                raise UserInputError(f"loss_fn_config_v2[{key!r}]: neither number nor text is set")
            config[key] = value.number if kind == "number" else value.text
        return config
    return {key: float(value) for key, value in msg.loss_fn_config.items()}


def decode_request(msg: pb.ForwardBackwardRequest, *, accept_images: bool = False) -> ForwardBackwardCall:
    """The parsed message as plain numpy data; UserInputError naming the datum and field on a bad tensor/chunk.
    ``accept_images``: keep image chunks (still encoded) for a vision-language model; False refuses them."""
    data = []
    for i, datum in enumerate(msg.data):
        inputs = {
            key: decode_tensor(tensor, f"data[{i}].loss_fn_inputs[{key!r}]")
            for key, tensor in sorted(datum.loss_fn_inputs.items())
        }
        model_spans = _spans(datum.model_input_spans, f"data[{i}].model_input_spans")
        loss_spans = _spans(datum.loss_fn_input_spans, f"data[{i}].loss_fn_input_spans")
        if (model_spans is None) != (loss_spans is None):
            raise UserInputError(
                f"data[{i}]: provenance comes as a pair (Datum.with_provenance): model_input_spans has "
                f"{len(model_spans or ())} runs, loss_fn_input_spans {len(loss_spans or ())}"
            )
        tokens, images = _chunks(datum, i, accept_images)
        data.append(WireDatum(tokens, inputs, model_spans, loss_spans, images))
    return ForwardBackwardCall(
        model_id=msg.model_id,
        seq_id=int(msg.seq_id),
        loss_fn=msg.loss_fn,
        loss_config=decode_loss_config(msg),
        forward_only=bool(msg.forward_only),
        data=data,
    )


def _batched(arrays: Sequence[np.ndarray], field: str) -> pb.BatchedTensor:
    trailing = list(arrays[0].shape[1:])
    for i, a in enumerate(arrays):
        if list(a.shape[1:]) != trailing:
            raise ValueError(f"output {field!r} of datum {i} has shape {a.shape}; datum 0 has trailing {trailing}")
    flat = [np.ascontiguousarray(a, dtype="<f4").reshape(-1) for a in arrays]
    offsets = np.zeros(len(flat) + 1, dtype="<i8")
    offsets[1:] = np.cumsum([a.nbytes for a in flat])
    return pb.BatchedTensor(
        data=b"".join(a.tobytes() for a in flat),
        offsets=offsets.tobytes(),
        dtype=pb.DTYPE_FLOAT32,
        trailing_shape=trailing,
    )


def encode_output(outputs: Sequence[Mapping[str, np.ndarray]], metrics: Mapping[str, float]) -> bytes:
    """Serialized ``ForwardBackwardOutput``: ``outputs[i]`` = datum i's fields (float arrays [N] or [N, K]).

    Every datum must have the same field names and, per field, the same trailing shape. Values are sent
    as float32 (a float32 engine's values round-trip exactly; float64 ones are rounded).
    """
    record = pb.ArrayRecord(type_tag=OUTPUT_TYPE, num_datums=len(outputs))
    if outputs:
        names = list(outputs[0])
        for name in names:
            record.fields[name].CopyFrom(_batched([np.asarray(o[name]) for o in outputs], name))
    out = pb.ForwardBackwardOutput(loss_fn_output_type=OUTPUT_TYPE, metrics={k: float(v) for k, v in metrics.items()})
    out.loss_fn_outputs.append(record)
    return out.SerializeToString()
