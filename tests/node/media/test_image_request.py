"""The images bodies: OpenAI's fields and this node's extensions checked, each refusal a 400 naming its field."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from node.attachments import AttachmentLimits
from node.errors import InvalidRequest
from node.media.image_request import (
    ImageOptions,
    ImageRequest,
    parse_edit_form,
    parse_edit_json,
    parse_generation,
)
from tests.node.media.images import png

OPTIONS = ImageOptions("tiny", ("32x32", "64x64", "128x128"), "64x64")
LIMITS = AttachmentLimits(max_attachments=1)


def test_a_generation_with_every_field_and_its_defaults() -> None:
    body = {"model": "tiny", "prompt": "a cat", "n": 3, "size": "32x32", "response_format": "b64_json", "seed": 7,
            "num_inference_steps": 4, "quality": "standard", "user": "u1"}
    assert parse_generation(body, OPTIONS) == ImageRequest("tiny", "a cat", 3, 32, 32, 4, 7)
    plain = parse_generation({"prompt": "a cat", "size": "auto"}, OPTIONS)
    assert (plain.model, plain.n, plain.width, plain.height, plain.steps) == ("tiny", 1, 64, 64, 20)
    assert 0 <= plain.seed < 2**32


@pytest.mark.parametrize(("change", "param", "says"), [
    ({"size": "65x64"}, "size", "'size' must be one of 32x32, 64x64, 128x128"),
    ({"size": "1024x1024"}, "size", "'size' must be one of"),
    ({"n": 0}, "n", "'n' must be an integer from 1 to 10"),
    ({"n": 11}, "n", "'n' must be an integer from 1 to 10"),
    ({"n": True}, "n", "'n' must be an integer"),
    ({"response_format": "url"}, "response_format", "this node stores no image, so it serves no url"),
    ({"num_inference_steps": 51}, "num_inference_steps", "from 1 to 50"),
    ({"seed": -1}, "seed", "'seed' must be an integer from 0 to 4294967295"),
    ({"seed": 2**32 - 1, "n": 2}, "seed", "from 0 to 4294967294"),
    ({"prompt": ""}, "prompt", "'prompt' is required"),
    ({"prompt": "x" * 4001}, "prompt", "at most 4000"),
    ({"model": 3}, "model", "'model' must be a string"),
    ({"output_format": "jpeg"}, "output_format", "'output_format' must be 'png'"),
    ({"image": "data:"}, "image", "unknown field 'image'"),
])
def test_a_bad_generation_field_is_refused_by_name(change: dict[str, Any], param: str, says: str) -> None:
    with pytest.raises(InvalidRequest, match=says) as refused:
        parse_generation({"prompt": "a cat", **change}, OPTIONS)
    assert refused.value.param == param


def test_an_edit_as_json_takes_a_data_url_and_as_a_form_the_file_with_numbers_as_text() -> None:
    data = png()
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    from_json = parse_edit_json({"prompt": "blue", "image": url, "seed": 3, "num_inference_steps": 2}, OPTIONS,
                                LIMITS)
    from_form = parse_edit_form({"prompt": "blue", "seed": "3", "num_inference_steps": "2"}, data, OPTIONS, LIMITS)
    for parsed in (from_json, from_form):
        assert (parsed.seed, parsed.steps, parsed.width) == (3, 2, 64)
        assert parsed.reference is not None and parsed.reference.image.size == (48, 40)
    assert from_json.reference is not None and from_form.reference is not None
    assert from_json.reference.digest == from_form.reference.digest


@pytest.mark.parametrize(("fields", "image", "param", "says"), [
    ({"prompt": "blue"}, None, "image", "'image' is required"),
    ({"prompt": "blue"}, b"not an image at all", "image", "the data is not an image"),
    ({"prompt": "blue"}, png()[:60], "image", "truncated or corrupt"),
    ({"prompt": "blue", "n": "two"}, png(), "n", "'n' must be an integer"),
    ({"prompt": "blue", "mask": "x"}, png(), "mask", "'mask' is not supported"),
])
def test_a_bad_edit_form_is_refused_by_name(fields: dict[str, str], image: bytes | None, param: str,
                                            says: str) -> None:
    with pytest.raises(InvalidRequest, match=says) as refused:
        parse_edit_form(fields, image, OPTIONS, LIMITS)
    assert refused.value.param == param


def test_an_edit_as_json_refuses_a_remote_image_and_bad_base64() -> None:
    with pytest.raises(InvalidRequest, match="fetches nothing") as remote:
        parse_edit_json({"prompt": "blue", "image": "https://example.com/a.png"}, OPTIONS, LIMITS)
    assert remote.value.param == "image"
    with pytest.raises(InvalidRequest, match="not valid base64"):
        parse_edit_json({"prompt": "blue", "image": "data:image/png;base64,@@@"}, OPTIONS, LIMITS)
