"""The parity client's image datums (:mod:`ringtune.parity.image_datums`): fixed by the seed, laid out as the
cookbook's Qwen3.5 renderer lays out images, and exactly as long as the gateway makes them (its decoder counts
every image as the client did), with only text positions scored."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from image_fixtures import VISION_TOKENS, tiny_vl_dir
from tinker.proto.request_conv import forward_backward_request_to_proto

from ringtune.gateway import proto, translate
from ringtune.gateway.images import ImageDecoder
from ringtune.parity.client import _image_to_tinker
from ringtune.parity.image_datums import ImageChunkSpec, build_image_datums, image_digest, load_image_side

STREAM = list(range(40, 200))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_vl_dir(tmp_path_factory.mktemp("parity-vl") / "ckpt", weights=False)


def test_image_datums_match_what_the_gateway_builds(checkpoint):
    processor, ids = load_image_side(checkpoint)
    assert (ids.start, ids.end, ids.pad) == tuple(
        VISION_TOKENS[t] for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
    )
    datums = build_image_datums(seed=0, stream=STREAM, processor=processor, ids=ids)
    assert [sum(isinstance(c, ImageChunkSpec) for c in d.chunks) for d in datums] == [1, 2, 3]
    assert image_digest(datums) == image_digest(build_image_datums(seed=0, stream=STREAM, processor=processor, ids=ids))
    assert image_digest(datums) != image_digest(build_image_datums(seed=1, stream=STREAM, processor=processor, ids=ids))
    decoder = ImageDecoder.from_checkpoint(checkpoint)
    for d in datums:
        request = tinker.types.ForwardBackwardRequest(
            forward_backward_input=tinker.types.ForwardBackwardInput(
                data=[_image_to_tinker(d)], loss_fn="cross_entropy"
            ),
            model_id="m",
            seq_id=1,
        )
        msg = proto.parse_request(forward_backward_request_to_proto(request).SerializeToString())  # the SDK's bytes
        [datum] = translate.train_data(proto.decode_request(msg, accept_images=True), decoder)
        tokens = datum.tokens.numpy()
        assert tokens.size == len(d.targets) == len(d.weights)
        # the next token is an image pad exactly where the target is 0 and the weight 0; text is scored
        next_is_pad = np.append(tokens[1:], -1) == ids.pad
        assert np.array_equal(next_is_pad[:-1], (np.asarray(d.targets) == 0)[:-1])
        assert all((w == 0) == pad for w, pad in zip(d.weights[:-1], next_is_pad[:-1], strict=True))
        assert [im.num_tokens for im in datum.images] == [
            c.expected_tokens for c in d.chunks if isinstance(c, ImageChunkSpec)
        ]
        assert all(tokens[im.token_start - 1] == ids.start and tokens[im.token_end] == ids.end for im in datum.images)
