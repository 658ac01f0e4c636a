"""Image chunks in the gateway (:mod:`ringtune.gateway.images`, :mod:`ringtune.gateway.image_chunks`, the protobuf
and JSON paths): decoded by the tiny Qwen3.5-VL checkpoint's own image processor, counted as transformers and the
cookbook count them, expanded into image-pad tokens, and every bad input refused as a user error naming the chunk.
No model runs here (the decoder reads ``config.json`` and ``preprocessor_config.json`` only)."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tinker
import torch
from image_fixtures import MERGE, VISION_TOKENS, image_bytes, tiny_vl_dir
from PIL import Image
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker_cookbook.renderers.base import image_to_chunk

from ringtune.errors import UserInputError
from ringtune.gateway import proto, translate
from ringtune.gateway.image_chunks import expand_images
from ringtune.gateway.images import ImageDecoder, ImageLimits, PatchBudget
from ringtune.gateway.proto import WireImage
from ringtune.gateway.sample_prompt import prompt_input
from ringtune.worker.describe import image_dir

START, END, PAD = VISION_TOKENS["<|vision_start|>"], VISION_TOKENS["<|vision_end|>"], VISION_TOKENS["<|image_pad|>"]
SIZES = ((50, 40), (200, 100), (17, 300))
"""Three images of different sizes and aspect ratios: 2, 18 and 9 tokens after the processor's resize."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny_vl_dir(tmp_path_factory.mktemp("vl") / "ckpt", weights=False)


@pytest.fixture(scope="module")
def decoder(checkpoint) -> ImageDecoder:
    return ImageDecoder.from_checkpoint(checkpoint)


def _budget(decoder: ImageDecoder) -> PatchBudget:
    return PatchBudget(decoder.limits.max_request_patches)


def test_counts_and_pixels_equal_transformers_and_the_cookbook(decoder):
    """For each size, as PNG and as the cookbook's JPEG chunk: the grid and pixel values are transformers'
    processor's on the same decoded image, and the token count is the cookbook's ``expected_tokens``."""
    rows = []
    for i, (w, h) in enumerate(SIZES):
        png = image_bytes(w, h, "png", seed=i)
        chunk = image_to_chunk(Image.open(io.BytesIO(png)), decoder.processor)  # what the renderer sends
        for fmt, data in (("png", png), ("jpeg", chunk.data)):
            got = decoder.decode(data, fmt, f"img{i}", _budget(decoder))
            ref = decoder.processor(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
            assert got.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
            assert torch.equal(got.pixel_values, ref["pixel_values"])
            assert got.num_tokens == chunk.expected_tokens == got.grid_thw[1] * got.grid_thw[2] // MERGE**2
            rows.append(
                f"{w}x{h} {fmt}: grid {got.grid_thw}, {got.num_tokens} tokens (cookbook {chunk.expected_tokens})"
            )
    print("\n".join(rows))
    assert [r.split(" tokens")[0].rsplit(" ", 1)[1] for r in rows[::2]] == ["2", "18", "9"]


def test_three_images_expand_into_pads_at_their_offsets(decoder):
    """A datum text | image | text | image | image | text: every image becomes ``num_tokens`` pads where its chunk
    was, ``token_start`` indexes the expanded tokens, and the text is unchanged around them."""
    text = np.array([5, START, END, 6, 7, START, END, START, END, 8], dtype=np.int64)
    offsets = (2, 6, 8)  # after each vision_start
    images = [WireImage(image_bytes(w, h, seed=i), "png", None, offsets[i], f"c{i}") for i, (w, h) in enumerate(SIZES)]
    tokens, inputs = expand_images(text, images, decoder, _budget(decoder), "datum")
    assert [im.num_tokens for im in inputs] == [2, 18, 9]
    assert tokens.size == text.size + 29
    pads = np.flatnonzero(tokens == PAD)
    assert pads.tolist() == [i for im in inputs for i in range(im.token_start, im.token_end)]
    assert np.array_equal(np.delete(tokens, pads), text)
    for im in inputs:
        assert tokens[im.token_start - 1] == START and tokens[im.token_end] == END
        assert im.pixel_values.shape == (im.grid_thw[0] * im.grid_thw[1] * im.grid_thw[2], 3 * 2 * 16 * 16)


def _gif() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (20, 20)).save(out, format="GIF")
    return out.getvalue()


def _animated_png() -> bytes:
    out = io.BytesIO()
    frames = [Image.new("RGB", (32, 32), c) for c in ("red", "blue")]
    frames[0].save(out, format="PNG", save_all=True, append_images=frames[1:])
    return out.getvalue()


PNG = image_bytes(50, 40)
REFUSALS = {
    "expected tokens": (
        WireImage(PNG, "png", 5, 1, "data[0].model_input.chunks[1]"),
        None,
        r"data\[0\]\.model_input\.chunks\[1\]\.expected_tokens=5 but the image is 2 tokens",
    ),
    "bad bytes": (WireImage(b"not an image", "png", None, 1, "c"), None, r"c\.data: 12 bytes are not a PNG or JPEG"),
    "empty": (WireImage(b"", "png", None, 1, "c"), None, r"c\.data: 0 bytes"),
    "truncated": (WireImage(PNG[: len(PNG) // 2], "png", None, 1, "c"), None, r"c\.data: the png image does not"),
    "format": (WireImage(PNG, "gif", None, 1, "c"), None, r"c\.format='gif': supported formats are \['jpeg', 'png'\]"),
    "gif bytes": (WireImage(_gif(), "png", None, 1, "c"), None, r"c\.data: \d+ bytes are not a PNG or JPEG"),
    "format mismatch": (
        WireImage(image_bytes(20, 20, "jpeg"), "png", None, 1, "c"),
        None,
        r"c\.format='png' but the bytes are a JPEG image",
    ),
    "animated": (WireImage(_animated_png(), "png", None, 1, "c"), None, r"c: an animated image of 2 frames"),
    "oversize bytes": (
        WireImage(PNG, "png", None, 1, "c"),
        ImageLimits(max_image_bytes=1000),
        rf"c\.data: {len(PNG)} bytes; the limit is 1000 bytes per image",
    ),
    "oversize pixels": (
        WireImage(PNG, "png", None, 1, "c"),
        ImageLimits(max_image_pixels=1999),
        r"c: a 50x40 image has 2000 pixels; the limit is 1999 pixels per image",
    ),
    "aspect ratio": (
        WireImage(image_bytes(4000, 16), "png", None, 1, "c"),
        None,
        r"c: the image processor refused this 4000x16 image: .*aspect ratio",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_bad_images_are_user_errors_naming_the_chunk(decoder, case):
    image, limits, message = REFUSALS[case]
    if limits is not None:
        decoder = ImageDecoder(decoder.processor, image_token_id=decoder.image_token_id, limits=limits)
    text = np.array([1, START, END, 2], dtype=np.int64)
    with pytest.raises(UserInputError, match=message) as err:
        expand_images(text, [image], decoder, _budget(decoder), "datum")
    print(f"{case}: {err.value}")


def test_request_patch_budget_text_pads_and_text_models_are_refused(decoder):
    small = ImageDecoder(decoder.processor, image_token_id=PAD, limits=ImageLimits(max_request_patches=80))
    text = np.array([1, START, END, START, END], dtype=np.int64)
    two = [WireImage(image_bytes(200, 100), "png", None, 2, "a"), WireImage(PNG, "png", None, 4, "b")]
    with pytest.raises(UserInputError, match=r"b: 8 vision patches bring this request's images to 80|a: 72"):
        expand_images(text, two, small, PatchBudget(79), "datum")
    stray = np.array([1, PAD, START, END], dtype=np.int64)
    with pytest.raises(UserInputError, match=rf"datum: text token 1 is the image-pad id {PAD}"):
        expand_images(stray, two[1:], decoder, _budget(decoder), "datum")
    with pytest.raises(UserInputError, match=r"b: image chunks are not supported; this server trains text models"):
        expand_images(text, two[1:], None, None, "datum")


def _datum(chunks: list, n: int) -> tinker.Datum:
    return tinker.Datum(
        model_input=tinker.ModelInput(chunks=chunks),
        loss_fn_inputs={"target_tokens": [0] * n, "weights": [1.0] * n},
    )


def test_protobuf_chunks_become_train_datums(decoder):
    """The SDK's own protobuf encoding of a datum with two image chunks -> ``TrainDatum`` tokens and images; a
    text-only server (``accept_images=False``) refuses the same request by name, as before."""
    png, jpeg = image_bytes(200, 100), image_bytes(17, 300, "jpeg")
    chunks = [
        tinker.EncodedTextChunk(tokens=[3, START]),
        tinker.types.ImageChunk(data=png, format="png", expected_tokens=18),
        tinker.EncodedTextChunk(tokens=[END, START]),
        tinker.types.ImageChunk(data=jpeg, format="jpeg", expected_tokens=9),
        tinker.EncodedTextChunk(tokens=[END, 4]),
    ]
    request = tinker.types.ForwardBackwardRequest(
        forward_backward_input=tinker.types.ForwardBackwardInput(data=[_datum(chunks, 33)], loss_fn="cross_entropy"),
        model_id="m",
        seq_id=1,
    )
    msg = proto.parse_request(forward_backward_request_to_proto(request).SerializeToString())
    with pytest.raises(UserInputError, match=r"data\[0\]\.model_input\.chunks\[1\]: image chunks are not supported"):
        proto.decode_request(msg)
    [datum] = translate.train_data(proto.decode_request(msg, accept_images=True), decoder)
    assert datum.tokens.dtype == torch.int64 and datum.tokens.numel() == 33 == datum.inputs["weights"].numel()
    assert [(im.token_start, im.num_tokens, im.grid_thw) for im in datum.images] == [
        (2, 18, (1, 6, 12)),
        (22, 9, (1, 18, 2)),
    ]
    assert datum.tokens[:2].tolist() == [3, START] and datum.tokens[-2:].tolist() == [END, 4]
    bad = [*chunks[:1], tinker.types.ImageChunk(data=png, format="png", expected_tokens=17), *chunks[2:]]
    request.forward_backward_input.data[0] = _datum(bad, 32)
    msg = proto.parse_request(forward_backward_request_to_proto(request).SerializeToString())
    with pytest.raises(UserInputError, match=r"chunks\[1\]\.expected_tokens=17 but the image is 18 tokens"):
        translate.train_data(proto.decode_request(msg, accept_images=True), decoder)


def test_json_prompt_as_the_sdk_sends_it(decoder):
    """``asample``'s JSON prompt (the SDK's ``model_dump(mode="json")``: base64 image data) -> ids and images;
    refusals name the chunk: a text model, bad base64, an asset pointer, an unknown chunk type."""
    prompt = tinker.ModelInput(
        chunks=[
            tinker.EncodedTextChunk(tokens=[3, START]),
            tinker.types.ImageChunk(data=image_bytes(50, 40), format="png", expected_tokens=2),
            tinker.EncodedTextChunk(tokens=[END]),
        ]
    ).model_dump(mode="json", exclude_none=True)
    assert isinstance(prompt["chunks"][1]["data"], str)
    ids, images = prompt_input(prompt, 296, decoder)
    assert ids == [3, START, PAD, PAD, END] and [(im.token_start, im.num_tokens) for im in images] == [(2, 2)]
    with pytest.raises(UserInputError, match=r"prompt\.chunks\[1\]: image chunks are not supported"):
        prompt_input(prompt, 296, None)
    broken = {"chunks": [{"type": "image", "data": "@@@", "format": "png"}]}
    with pytest.raises(UserInputError, match=r"prompt\.chunks\[0\]\.data: 3 characters are not valid base64"):
        prompt_input(broken, 296, decoder)
    pointer = {"chunks": [{"type": "image_asset_pointer", "location": "x.png", "format": "png"}]}
    with pytest.raises(UserInputError, match=re.escape("prompt.chunks[0].type='image_asset_pointer': only")):
        prompt_input(pointer, 296, decoder)
    count = {"chunks": [{**prompt["chunks"][1], "expected_tokens": -1}]}
    with pytest.raises(UserInputError, match=r"expected_tokens=-1 must be a non-negative int"):
        prompt_input(count, 296, decoder)
    assert base64.b64decode(prompt["chunks"][1]["data"]) == image_bytes(50, 40)


def test_image_dir_needs_a_vl_checkpoint_and_a_vision_tower(checkpoint, tmp_path):
    with_tower = SimpleNamespace(model=SimpleNamespace(visual=object()))
    text_only = SimpleNamespace(model=SimpleNamespace())
    assert image_dir(str(checkpoint), with_tower) == str(checkpoint.resolve())
    assert image_dir(str(checkpoint), text_only) is None  # a VL checkpoint loaded as its text model
    assert image_dir(str(tmp_path), with_tower) is None  # no config.json / preprocessor_config.json
