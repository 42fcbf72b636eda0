"""A small reference image for the media tests."""

from __future__ import annotations

import io

from PIL import Image


def png(width: int = 48, height: int = 40, colour: tuple[int, int, int] = (200, 30, 90)) -> bytes:
    """A PNG with a line across it, so that its latents are not uniform."""
    image = Image.new("RGB", (width, height), colour)
    for x in range(width):
        image.putpixel((x, x * height // width), (x * 5 % 256, 255 - x * 3 % 256, 40))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
