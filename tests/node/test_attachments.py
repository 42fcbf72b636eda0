"""Image attachments: decoded under limits, every bad attachment a 400 that names the part and quotes no data."""

from __future__ import annotations

import base64
import hashlib
import io
import struct
import warnings
import zlib
from typing import Any

import pytest
from PIL import GifImagePlugin, Image

from node.api.middleware import status_of
from node.attachments import (
    AttachmentLimits,
    PartIndex,
    PlacedAttachment,
    collect_attachments,
    parse_image_part,
)
from node.errors import InvalidRequest

URL = "messages[2].content[1].image_url.url"
AT = PartIndex(2, 1)


def encoded(image: Image.Image, format: str, **options: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **options)
    return buffer.getvalue()


def noise(width: int, height: int) -> Image.Image:
    """Pixels that do not compress, so a cut through the file cuts through pixel data."""
    return Image.frombytes("RGB", (width, height), hashlib.shake_256(b"noise").digest(width * height * 3))


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares `width` x `height` pixels and holds one row of data: opening it allocates nothing."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 4))
            + chunk(b"IEND", b""))


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def part(url: str, **fields: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **fields}}


PNG = encoded(Image.new("RGBA", (40, 30), (255, 0, 0, 128)), "PNG")
JPEG = encoded(Image.new("RGB", (32, 16), (0, 0, 255)), "JPEG")


def test_a_png_is_decoded_to_rgb_with_its_size_format_and_the_digest_of_its_bytes() -> None:
    attachment = parse_image_part(part(data_url(PNG)), AT, AttachmentLimits())
    assert (attachment.size, attachment.format, attachment.detail) == ((40, 30), "PNG", "auto")
    assert (attachment.image.mode, attachment.image.size) == ("RGB", (40, 30))
    assert attachment.image.getpixel((0, 0)) == (255, 0, 0)
    assert attachment.digest == hashlib.sha256(PNG).digest()


def test_a_jpeg_is_decoded_and_its_digest_stays_out_of_repr() -> None:
    attachment = parse_image_part(part(data_url(JPEG, "image/jpeg"), detail="high"), AT, AttachmentLimits())
    assert (attachment.size, attachment.format, attachment.detail) == ((32, 16), "JPEG", "high")
    assert attachment.image.mode == "RGB"
    assert attachment.digest == hashlib.sha256(JPEG).digest()
    assert attachment.digest.hex() not in repr(attachment)
    assert str(attachment.digest) not in repr(attachment)


def test_image_jpg_is_taken_as_a_label_of_jpeg() -> None:
    assert parse_image_part(part(data_url(JPEG, "image/jpg")), AT, AttachmentLimits()).format == "JPEG"


def test_webp_is_decoded() -> None:
    webp = encoded(Image.new("RGB", (8, 4), (0, 255, 0)), "WEBP", lossless=True)
    attachment = parse_image_part(part(data_url(webp, "image/webp")), AT, AttachmentLimits())
    assert (attachment.size, attachment.format, attachment.image.getpixel((7, 3))) == ((8, 4), "WEBP", (0, 255, 0))


def test_an_animated_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (6, 6), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    gif = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    with Image.open(io.BytesIO(gif)) as opened:
        assert isinstance(opened, GifImagePlugin.GifImageFile) and opened.n_frames == 2
    attachment = parse_image_part(part(data_url(gif, "image/gif")), AT, AttachmentLimits())
    assert (attachment.format, attachment.image.getpixel((3, 3))) == ("GIF", (255, 0, 0))


TRUNCATED_PNG = encoded(noise(64, 64), "PNG")[:6000]
DECLARED_HUGE = png_header(100_000, 100_000)  # 10^10 pixels: above twice Pillow's limit, its error
DECLARED_LARGE = png_header(10_000, 10_000)  # 10^8 pixels: between Pillow's limit and twice it, its warning
TIFF = encoded(Image.new("RGB", (4, 4)), "TIFF")
BMP = encoded(Image.new("RGB", (4, 4)), "BMP")
FORMATS = "this node decodes GIF, JPEG, PNG, WEBP"

BAD: dict[str, tuple[Any, AttachmentLimits, str, str, str | None]] = {
    # name: (part, limits, param, message after "<param>: ", code)
    "corrupt base64": (part("data:image/png;base64," + base64.b64encode(PNG).decode()[:-1] + "*"),
                       AttachmentLimits(), URL,
                       "the data is not valid base64 (standard alphabet, padded, no whitespace)", None),
    "base64 with a line break": (part("data:image/png;base64," + base64.encodebytes(PNG).decode()),
                                 AttachmentLimits(), URL,
                                 "the data is not valid base64 (standard alphabet, padded, no whitespace)", None),
    "not an image": (part(data_url(b"a caller's private notes, not an image at all")), AttachmentLimits(), URL,
                     f"the data is not an image; {FORMATS}", None),
    "empty data": (part(data_url(b"")), AttachmentLimits(), URL, f"the data is not an image; {FORMATS}", None),
    "a truncated png": (part(data_url(TRUNCATED_PNG)), AttachmentLimits(), URL,
                        "the image data is truncated or corrupt", None),
    "a png signature then garbage": (part(data_url(b"\x89PNG\r\n\x1a\n" + b"\xff" * 40)), AttachmentLimits(), URL,
                                     "the image data is truncated or corrupt", None),
    "a decompression bomb": (part(data_url(DECLARED_HUGE)), AttachmentLimits(), URL,
                             "the image declares more than 16777216 pixels, the most this node decodes per image: "
                             "send it scaled down", None),
    "too many pixels": (part(data_url(PNG)), AttachmentLimits(max_pixels=40 * 30 - 1), URL,
                        "the image declares more than 1199 pixels, the most this node decodes per image: "
                        "send it scaled down", None),
    "too many bytes": (part(data_url(PNG)), AttachmentLimits(max_bytes=len(PNG) - 3), URL,
                       f"the decoded image would be over {len(PNG) - 3} bytes, the most this node takes per image: "
                       "send it scaled down or compressed", None),
    "a tiff": (part(data_url(TIFF)), AttachmentLimits(), URL, f"the data is a TIFF image; {FORMATS}", None),
    "a declared bmp": (part(data_url(BMP, "image/bmp")), AttachmentLimits(), URL,
                       "declares a MIME type this node does not take; use one of image/gif, image/jpeg, image/jpg, "
                       "image/png, image/webp", None),
    "a format left out by the limits": (part(data_url(JPEG, "image/jpeg")),
                                        AttachmentLimits(formats=frozenset({"PNG"})), URL,
                                        "declares a MIME type this node does not take; use one of image/png", None),
    "a jpeg declared as png": (part(data_url(JPEG)), AttachmentLimits(), URL,
                               "declares image/png but the data is a JPEG image: declare image/jpeg", None),
    "a data url without base64": (part("data:image/png,%89PNG"), AttachmentLimits(), URL,
                                  "must be a base64 data: URL (data:image/png;base64,...)", None),
    "a remote url": (part("https://images.example.com/cat.png?token=s3cret"), AttachmentLimits(), URL,
                     "a confidential node fetches nothing for a caller, so only inline images are taken: send the "
                     "image as a data: URL (data:image/png;base64,...)", "unsupported_parameter"),
    "a file url": (part("file:///etc/passwd"), AttachmentLimits(), URL,
                   "a confidential node fetches nothing for a caller, so only inline images are taken: send the "
                   "image as a data: URL (data:image/png;base64,...)", "unsupported_parameter"),
    "a remote url on an allowed host": (part("https://images.example.com/cat.png?token=s3cret"),
                                        AttachmentLimits(allowed_hosts=frozenset({"images.example.com"})), URL,
                                        "this node's policy allows the image's host, but fetching images is not "
                                        "built yet: send the image as a data: URL (data:image/png;base64,...)",
                                        "unsupported_parameter"),
    "a string image_url": ({"type": "image_url", "image_url": data_url(PNG)}, AttachmentLimits(),
                           "messages[2].content[1].image_url",
                           "must be an object with a string 'url' (a data: URL such as data:image/png;base64,...)",
                           None),
    "an unknown detail": (part(data_url(PNG), detail="ultra"), AttachmentLimits(),
                          "messages[2].content[1].image_url.detail", "must be one of auto, low, high", None),
}


def refusal(bad_part: Any, limits: AttachmentLimits) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse_image_part(bad_part, AT, limits)
    return caught.value


@pytest.mark.parametrize("case", sorted(BAD))
def test_each_bad_attachment_is_a_400_that_names_the_part(case: str) -> None:
    bad_part, limits, param, message, code = BAD[case]
    error = refusal(bad_part, limits)
    assert (type(error), status_of(error)) == (InvalidRequest, 400)
    assert error.body() == {"error": {"message": f"{param}: {message}", "type": "invalid_request_error",
                                      "param": param, "code": code}}


@pytest.mark.parametrize("case", sorted(BAD))
def test_no_refusal_quotes_the_callers_data(case: str) -> None:
    bad_part, limits, _, _, _ = BAD[case]
    image_url = bad_part["image_url"]
    url = image_url if isinstance(image_url, str) else image_url["url"]
    message = refusal(bad_part, limits).message
    secret = url.partition(",")[2] if url.startswith("data:") else url.partition("://")[2]
    windows = {secret[start:start + 12] for start in range(max(1, len(secret) - 11))} - {""}
    assert [window for window in windows if window in message] == []
    assert "s3cret" not in message and "example.com" not in message


def test_the_size_is_refused_before_the_base64_is_read() -> None:
    error = refusal(part("data:image/png;base64," + "*" * 400), AttachmentLimits(max_bytes=100))
    assert error.message == (f"{URL}: the decoded image would be over 100 bytes, the most this node takes per "
                             "image: send it scaled down or compressed")


def test_pillows_warning_range_is_refused_without_a_warning_or_a_change_to_pillow() -> None:
    limit = Image.MAX_IMAGE_PIXELS
    assert limit is not None and limit < 10_000 * 10_000 <= 2 * limit
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        error = refusal(part(data_url(DECLARED_LARGE)), AttachmentLimits(max_pixels=2 * limit))
    assert error.message == (f"{URL}: the image declares more than {2 * limit} pixels, the most this node decodes "
                             "per image: send it scaled down")
    assert [warning.category for warning in seen] == []
    assert Image.MAX_IMAGE_PIXELS == limit


def test_the_pixel_limit_is_checked_from_the_header_before_decoding() -> None:
    """A header declaring 4x the limit and one row of data: refused as too large, not as truncated."""
    error = refusal(part(data_url(png_header(64, 64))), AttachmentLimits(max_pixels=32 * 32))
    assert error.message.endswith("the image declares more than 1024 pixels, the most this node decodes per image: "
                                  "send it scaled down")


def test_the_images_of_a_chat_are_collected_in_order_with_their_places() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "compare"}, part(data_url(PNG)),
                                     part(data_url(JPEG, "image/jpeg"))]},
        {"role": "assistant", "content": "they differ"},
        {"role": "user", "content": [part(data_url(PNG)), {"type": "text", "text": "again"}]},
    ]
    placed = collect_attachments(messages, AttachmentLimits())
    assert [(p.index, p.attachment.format) for p in placed] == [
        (PartIndex(1, 1), "PNG"), (PartIndex(1, 2), "JPEG"), (PartIndex(3, 0), "PNG")]
    assert all(isinstance(p, PlacedAttachment) for p in placed)
    assert placed[0].attachment.digest == placed[2].attachment.digest != placed[1].attachment.digest
    assert collect_attachments([{"role": "user", "content": "no images"}], AttachmentLimits()) == ()


def test_too_many_attachments_are_refused_before_any_is_decoded() -> None:
    messages = [
        {"role": "user", "content": [part("data:image/png;base64,not*base64"), part(data_url(PNG))]},
        {"role": "user", "content": [{"type": "text", "text": "and"}, part(data_url(PNG))]},
    ]
    with pytest.raises(InvalidRequest) as caught:
        collect_attachments(messages, AttachmentLimits(max_attachments=2))
    assert caught.value.body() == {"error": {
        "message": "the request holds 3 attachments (images and audio); this node takes at most 2 in one request: "
                   "send fewer",
        "type": "invalid_request_error", "param": "messages[1].content[1]", "code": "array_above_max_length"}}


def test_a_refusal_in_a_later_message_names_that_part() -> None:
    messages = [{"role": "user", "content": [part(data_url(PNG))]},
                {"role": "user", "content": [{"type": "text", "text": "x"}, part(data_url(JPEG))]}]
    with pytest.raises(InvalidRequest) as caught:
        collect_attachments(messages, AttachmentLimits())
    assert caught.value.param == "messages[1].content[1].image_url.url"


@pytest.mark.parametrize(("fields", "message"), [
    ({"max_pixels": 0}, "attachment limit max_pixels must be at least 1, not 0"),
    ({"formats": frozenset({"PNG", "BMP"})}, "attachment formats must be a non-empty subset of PNG, JPEG, WEBP, GIF; "
                                             "BMP given"),
    ({"formats": frozenset()}, "attachment formats must be a non-empty subset of PNG, JPEG, WEBP, GIF; none given"),
])
def test_limits_refuse_what_cannot_be_served(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        AttachmentLimits(**fields)
    assert str(caught.value) == message
