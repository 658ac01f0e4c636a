"""ringtune.gateway.proto against the SDK's own codec (tinker/proto/request_conv.py, response_conv.py)."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from ringtune.errors import UserInputError
from ringtune.gateway import proto


def sdk_bytes(data: list[tinker.Datum], loss_fn: str = "cross_entropy", config=None, forward_only=False) -> bytes:
    """What the SDK puts on the wire for a forward_backward (forward_only travels as a flag the resource sets)."""
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="s:train:0",
        seq_id=7,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def test_decode_dense_1d_and_config():
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7, 8], "logprobs": [-1.0, -2.0, -0.5], "advantages": [1.0, 0.0, -1.0]},
    )
    call = proto.decode_request(proto.parse_request(sdk_bytes([datum], "ppo", {"clip_low_threshold": 0.7})))
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("s:train:0", 7, "ppo", False)
    assert call.loss_config == {"clip_low_threshold": 0.7}
    (d,) = call.data
    assert d.tokens.dtype == np.int64 and d.tokens.tolist() == [5, 6, 7]
    assert d.inputs["target_tokens"].dtype == np.int64 and d.inputs["target_tokens"].tolist() == [6, 7, 8]
    assert d.inputs["logprobs"].dtype == np.float32 and d.inputs["logprobs"].tolist() == [-1.0, -2.0, -0.5]


def test_decode_2d_dense_and_csr_equal_the_torch_tensors():
    targets = torch.zeros(6, 4, dtype=torch.int64)
    targets[:, 0] = torch.arange(1, 7)
    weights = torch.zeros(6, 4)
    weights[:, 0] = 1.0
    weights[2, 3] = 0.25
    dense_targets = torch.randint(1, 9, (6, 4))
    for t, w in ((targets, weights), (dense_targets, torch.rand(6, 4) + 0.1)):
        datum = tinker.Datum(
            model_input=tinker.ModelInput.from_ints(list(range(6))), loss_fn_inputs={"target_tokens": t, "weights": w}
        )
        msg = proto.parse_request(sdk_bytes([datum]))
        call = proto.decode_request(msg)
        assert np.array_equal(call.data[0].inputs["target_tokens"], t.numpy())
        assert np.array_equal(call.data[0].inputs["weights"], w.numpy())
    assert msg.data[0].loss_fn_inputs["weights"].WhichOneof("encoding") == "dense"
    sparse = proto.parse_request(
        sdk_bytes(
            [
                tinker.Datum(
                    model_input=tinker.ModelInput.from_ints(list(range(6))),
                    loss_fn_inputs={"target_tokens": targets, "weights": weights},
                )
            ]
        )
    )
    assert sparse.data[0].loss_fn_inputs["weights"].WhichOneof("encoding") == "sparse_csr"  # the CSR path ran


def test_forward_only_and_v2_text_config():
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints([1]), loss_fn_inputs={"target_tokens": [2], "weights": [1.0]}
    )
    call = proto.decode_request(proto.parse_request(sdk_bytes([datum], "dro", {"beta": 0.1, "mode": "x"}, True)))
    assert call.forward_only and call.loss_config == {"beta": 0.1, "mode": "x"}


@pytest.mark.parametrize("k", [None, 3])
def test_encode_output_reads_back_in_the_sdk(k):
    rng = np.random.default_rng(0)
    lengths = [1, 5, 17]
    shape = (lambda n: (n,)) if k is None else (lambda n: (n, k))
    outputs = [
        {
            "logprobs": rng.standard_normal(shape(n)),
            "elementwise_loss": rng.standard_normal(shape(n)).astype(np.float32),
        }
        for n in lengths
    ]
    metrics = {"loss:sum": 1.5, "num_tokens:sum": 23.0}
    out = deserialize_forward_backward_output(proto.encode_output(outputs, metrics))
    assert out.metrics == metrics and out.loss_fn_output_type == "ArrayRecord"
    assert len(out.loss_fn_outputs) == len(lengths)
    for mine, theirs in zip(outputs, out.loss_fn_outputs, strict=True):
        for key in ("logprobs", "elementwise_loss"):
            assert theirs[key].dtype == "float32" and theirs[key].shape == list(mine[key].shape)
            assert np.array_equal(theirs[key].to_numpy(), mine[key].astype(np.float32))


def _request_with(tensor: pb.Tensor) -> pb.ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([1, 2], "<i4").tobytes()
    datum.loss_fn_inputs["weights"].CopyFrom(tensor)
    return msg


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (pb.Tensor(dense=b"\0" * 7, dtype=pb.DTYPE_FLOAT32, shape=[2]), "not a multiple of 4"),
        (pb.Tensor(dense=b"\0" * 12, dtype=pb.DTYPE_FLOAT32, shape=[2]), "3 values for shape [2]"),
        (pb.Tensor(dense=b"\0" * 8, dtype=pb.DTYPE_INT32, shape=[2]), "DTYPE_INT32 is not supported"),
        (pb.Tensor(dense=b"\0" * 8, dtype=pb.DTYPE_UNSPECIFIED, shape=[2]), "is not supported"),
        (pb.Tensor(dense=b"", dtype=pb.DTYPE_FLOAT32, shape=[1 << 20, 1 << 20]), "the limit is"),
        (pb.Tensor(dense=b"", dtype=pb.DTYPE_FLOAT32, shape=[-1]), "negative dim"),
        (
            pb.Tensor(
                sparse_csr=pb.SparseCsr(
                    values=np.ones(1, "<f4").tobytes(),
                    crow_indices=np.array([0, 1, 1], "<i8").tobytes(),
                    col_indices=np.array([9], "<i8").tobytes(),
                ),
                dtype=pb.DTYPE_FLOAT32,
                shape=[2, 3],
            ),
            "col_indices",
        ),
        (
            pb.Tensor(
                sparse_csr=pb.SparseCsr(
                    values=np.ones(2, "<f4").tobytes(), crow_indices=np.array([0, 1, 1], "<i8").tobytes()
                ),
                dtype=pb.DTYPE_FLOAT32,
                shape=[2, 3],
            ),
            "crow_indices",
        ),
    ],
)
def test_bad_tensors_name_the_field(tensor, message):
    with pytest.raises(UserInputError, match="loss_fn_inputs\\['weights'\\]") as info:
        proto.decode_request(_request_with(tensor))
    assert message in str(info.value)


def test_bad_chunks_and_bytes():
    msg = _request_with(pb.Tensor(dense=np.ones(2, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[2]))
    msg.data[0].model_input.add().image.data = b"png"
    with pytest.raises(UserInputError, match=r"data\[0\].model_input.chunks\[1\]: image chunks are not supported"):
        proto.decode_request(msg)
    with pytest.raises(UserInputError, match=r"is not a tinker_public\.ForwardBackwardRequest"):
        proto.parse_request(b"\xff\xff\xff\xff garbage")
