"""The bodies of `POST /v1/images/generations` and `/v1/images/edits` in OpenAI's form, checked into one record.

Generations take JSON. Edits take what OpenAI's clients send, `multipart/form-data` with the image as a file
part, and also JSON whose `image` is a `data:` URL. Both take `seed` and `num_inference_steps`, this node's
extensions. Output is `b64_json` only: `url` would mean the node stores the images and serves them later, and a
confidential node keeps nothing of a caller's once it has answered. Every refusal is a 400 naming the field.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from node.attachments import AttachmentLimits, decode_image, image_from_data_url
from node.errors import invalid_request
from node.media.pipeline import ImageRequest, Reference

MAX_IMAGES = 10
"""OpenAI's bound on `n`."""
MAX_PROMPT_CHARS = 4000
"""OpenAI's bound for its edit-capable models; a CLIP encoder reads only its first 77 tokens anyway."""
DEFAULT_STEPS = 20
MAX_STEPS = 50
"""Denoising steps a request may ask for: a render's cost grows with them, and past 50 a DDIM-like scheduler
changes little."""
SEED_BOUND = 1 << 32
"""Seeds are 0 to 2**32 - 1, and `seed + n - 1` must be too (image i is drawn from seed + i)."""
IGNORED = frozenset({"quality", "style", "user", "background", "moderation", "output_format", "input_fidelity",
                     "partial_images", "stream", "output_compression"})
"""OpenAI fields that change nothing here; a value other than the default of the formats ones is refused below."""
GENERATION_FIELDS = frozenset({"model", "prompt", "n", "size", "response_format", "seed", "num_inference_steps"})
EDIT_FIELDS = GENERATION_FIELDS | {"image", "mask"}


@dataclass(frozen=True, slots=True)
class ImageOptions:
    """What the served pipeline takes: its id, the sizes it renders, its default size."""

    model_id: str
    sizes: tuple[str, ...]
    default_size: str


def parse_generation(body: Any, options: ImageOptions) -> ImageRequest:
    if not isinstance(body, dict):
        raise invalid_request("the request body must be a JSON object")
    return _parse(body, options, GENERATION_FIELDS, None)


def parse_edit_json(body: Any, options: ImageOptions, limits: AttachmentLimits) -> ImageRequest:
    """An edit sent as JSON: `image` is a `data:` URL."""
    if not isinstance(body, dict):
        raise invalid_request("the request body must be a JSON object")
    image = body.get("image")
    if not isinstance(image, str):
        raise invalid_request("'image' is required: a data: URL of the image to edit (data:image/png;base64,...)",
                              param="image")
    _no_mask(body)
    attachment = image_from_data_url(image, "image", limits)
    return _parse(body, options, EDIT_FIELDS, Reference(attachment.image, attachment.digest))


def parse_edit_form(fields: Mapping[str, str], image: bytes | None, options: ImageOptions,
                    limits: AttachmentLimits) -> ImageRequest:
    """An edit sent as multipart/form-data: text `fields` (numbers as text, as forms send them) and the `image`
    file's bytes."""
    if image is None:
        raise invalid_request("'image' is required: the image to edit, as a file part", param="image")
    _no_mask(fields)
    body: dict[str, Any] = dict(fields)
    for name in ("n", "seed", "num_inference_steps"):
        if name in body:
            try:
                body[name] = int(body[name])
            except ValueError:
                raise invalid_request(f"'{name}' must be an integer", param=name) from None
    attachment = decode_image(image, "image", limits)
    return _parse(body, options, EDIT_FIELDS, Reference(attachment.image, attachment.digest))


def _no_mask(body: Mapping[str, Any]) -> None:
    if body.get("mask") is not None:
        raise invalid_request("'mask' is not supported by this node: the whole image is edited", param="mask",
                              code="unsupported_parameter")


def _parse(body: Mapping[str, Any], options: ImageOptions, known: frozenset[str],
           reference: Reference | None) -> ImageRequest:
    unknown = sorted(set(body) - known - IGNORED)
    if unknown:
        raise invalid_request(f"unknown field {unknown[0]!r}", param=unknown[0], code="unknown_parameter")
    model = body.get("model", options.model_id)
    if not isinstance(model, str):
        raise invalid_request("'model' must be a string", param="model")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise invalid_request("'prompt' is required: a non-empty string", param="prompt")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise invalid_request(f"'prompt' is {len(prompt)} characters; at most {MAX_PROMPT_CHARS} are taken",
                              param="prompt")
    n = _integer(body, "n", 1, 1, MAX_IMAGES)
    size = body.get("size", "auto")
    if size == "auto":
        size = options.default_size
    if size not in options.sizes:
        raise invalid_request(f"'size' must be one of {', '.join(options.sizes)} for this model (or 'auto')",
                              param="size")
    width, height = (int(side) for side in size.split("x"))
    response_format = body.get("response_format", "b64_json")
    if response_format != "b64_json":
        raise invalid_request("'response_format' must be 'b64_json': this node stores no image, so it serves no "
                              "url", param="response_format", code="unsupported_parameter")
    if body.get("output_format", "png") != "png":
        raise invalid_request("'output_format' must be 'png'", param="output_format")
    steps = _integer(body, "num_inference_steps", DEFAULT_STEPS, 1, MAX_STEPS)
    seed = _integer(body, "seed", None, 0, SEED_BOUND - n)
    if seed is None:
        seed = secrets.randbelow(SEED_BOUND - n + 1)
    return ImageRequest(model, prompt, n, width, height, steps, seed, reference)


def _integer(body: Mapping[str, Any], name: str, default: int | None, low: int, high: int) -> Any:
    value = body.get(name, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise invalid_request(f"'{name}' must be an integer from {low} to {high}", param=name)
    return value
