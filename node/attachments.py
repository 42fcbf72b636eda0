"""Attachments of a chat request: OpenAI `image_url` parts decoded into RGB images and `input_audio` parts into
mono samples, under limits.

A part arrives as `{"type": "image_url", "image_url": {"url": "data:image/png;base64,...", "detail": "auto"}}`.
Only inline `data:` URLs are taken: a confidential node fetches nothing on a caller's behalf (a fetch would leak
that the caller is here, and what it looks at, to a third party, and would make the node's output depend on
bytes no attestation covers). A later node policy may allow named hosts (`AttachmentLimits.allowed_hosts`); the
fetch itself is not built, so even an allowed host is refused for now, with a message that says so.

Every check that can run before the pixels are decoded does: the declared MIME type, the decoded size (from the
base64 length), the format (from Pillow's header parse, restricted to an allow-list) and the pixel count (from the
header's dimensions). Only then are the pixels decoded, and a truncated or corrupt stream is refused, never filled
in. Every refusal is the node's 400 (`InvalidRequest`) with `param` naming the part, e.g.
`messages[2].content[1].image_url.url`, and a message that never quotes the caller's data.

Pillow's process-wide settings are read, never written: `Image.MAX_IMAGE_PIXELS` is left as it is (the node's own
`max_pixels` is the limit that decides), and `ImageFile.LOAD_TRUNCATED_IMAGES` must stay False (its default), or
a truncated image would load with its missing rows filled in grey instead of being refused.

Audio arrives as `{"type": "input_audio", "input_audio": {"data": "<base64>", "format": "wav"}}` (OpenAI's shape;
`"mp3"` too) and is decoded by libsndfile (`soundfile`: integer and float WAV, MP3), its format checked against the
declared one and its length, channels and rate checked from the header before any sample is read, its channels
averaged to mono block by block, and resampled to the encoders' `AUDIO_RATE` by soxr.
"""

from __future__ import annotations

import base64
import hashlib
import io
import struct
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NewType
from urllib.parse import urlsplit

import numpy as np
import soundfile
import soxr
from PIL import Image, UnidentifiedImageError

from node.errors import InvalidRequest, invalid_request

AttachmentDigest = NewType("AttachmentDigest", bytes)
"""SHA-256 of an attachment's decoded bytes (32 bytes): the key its encodings are cached under, per scope."""

MIME_TYPES: dict[str, tuple[str, ...]] = {
    "PNG": ("image/png",),
    "JPEG": ("image/jpeg", "image/jpg"),
    "WEBP": ("image/webp",),
    "GIF": ("image/gif",),
}
"""The formats this module can take and the MIME types a `data:` URL may declare for each. The four are OpenAI's
image input formats, so every image a client already sends there is taken here; each has a Pillow decoder that is
built into every wheel and widely exercised. `image/jpg` is not a registered type, but clients and libraries
label `.jpg` files with it: refusing it would refuse a correct image over its label. A GIF or WEBP with several
frames gives its first frame: a vision model takes a still image, OpenAI documents GIF input as non-animated, and
the first frame is what a viewer shows before any animation runs; the later frames are never decoded."""

SAME_FORMAT = {"MPO": "JPEG"}
"""Pillow opens a JPEG that carries several pictures (a phone's multi-picture JPEG) as `MPO`: it is a JPEG whose
first picture is the image, and its MIME type is `image/jpeg`."""

DETAILS = ("auto", "low", "high")
"""OpenAI's `image_url.detail` values."""

AUDIO_FORMATS = ("wav", "mp3")
"""OpenAI's `input_audio.format` values."""
SOUND_FORMATS = {"WAV": "wav", "WAVEX": "wav", "MP3": "mp3"}
"""libsndfile's name of a file's format -> the `input_audio.format` it is."""
MIN_RATE, MAX_RATE = 8_000, 192_000
"""Sample rates taken: telephone audio to studio masters."""
BLOCK_FRAMES = 1 << 16
"""Frames decoded at once while mixing to mono."""
AUDIO_RATE = 16_000
"""Samples a second of the audio handed to a model: Whisper's feature extractor's rate, which the audio encoders
transformers provides read (`media.MediaFamily` refuses a model whose extractor reads another)."""


@dataclass(frozen=True, slots=True)
class AttachmentLimits:
    """What one request may attach. Each default, and why:

    - `max_bytes` 16 MiB per decoded image: a phone photo as JPEG (a few MiB) and a screenshot of a 4K display as
      PNG fit. At the node's default body limit (`limits.max_body_bytes`, 8 MiB, base64 adding a third) the body
      limit binds first; this bounds the work of one decode when an operator raises it.
    - `max_pixels` 4096 x 4096 = 16,777,216: a 12-megapixel phone photo (4032 x 3024) fits, and so does every
      vision processor's own largest working size (they scale down from here, so more pixels add decode time and
      memory, 48 MiB as RGB at this limit, but nothing the model sees). Checked from the header, before decoding.
    - `max_attachments` 16 per request: each image costs an encoder call and hundreds of placeholder tokens, so
      more would not fit a small model's context; 16 still keeps the images of a long conversation's history.
    - `formats` PNG, JPEG, WEBP, GIF: see `MIME_TYPES`. Pillow parses no header of any other format.
    - `allowed_hosts` none: a confidential node fetches nothing for a caller (see the module's docstring).
    - `max_audio_seconds` 600 per audio part: ten minutes, the most Audio Flamingo 3's processor reads before it
      cuts the rest (20 windows of 30 s); at 16 kHz that is 15,000 placeholder tokens, so the context usually
      binds first. Checked from the header, before samples are read. `max_bytes` bounds the file too.
    - `max_channels` 8: 7.1 surround; more is not a recording a caller means as speech or sound.
    - images and audio parts count together against `max_attachments`: each is an encoder call.
    """

    max_bytes: int = 16 * 1024 * 1024
    max_pixels: int = 4096 * 4096
    max_attachments: int = 16
    max_audio_seconds: int = 600
    max_channels: int = 8
    formats: frozenset[str] = frozenset(MIME_TYPES)
    allowed_hosts: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "max_attachments", "max_audio_seconds", "max_channels"):
            if getattr(self, name) < 1:
                raise ValueError(f"attachment limit {name} must be at least 1, not {getattr(self, name)}")
        unknown = sorted(self.formats - MIME_TYPES.keys())
        if unknown or not self.formats:
            raise ValueError(f"attachment formats must be a non-empty subset of {', '.join(MIME_TYPES)}; "
                             f"{', '.join(unknown) or 'none'} given")


@dataclass(frozen=True, slots=True)
class PartIndex:
    """Where a content part sits in the request: `messages[message].content[part]`."""

    message: int
    part: int

    def param(self, field_path: str = "") -> str:
        """The part's name as OpenAI's error `param` gives it, down to `field_path` (`image_url.url`)."""
        where = f"messages[{self.message}].content[{self.part}]"
        return f"{where}.{field_path}" if field_path else where


@dataclass(frozen=True, slots=True)
class ImageAttachment:
    """One decoded image. `digest` is memory-only: it keys the per-scope encoding cache and is never logged,
    put in an error, a metric or a file (it identifies the caller's image to anyone who holds a copy of it), so it
    is also kept out of `repr`."""

    kind: ClassVar[str] = "image"
    image: Image.Image
    """The pixels as mode `RGB`, loaded (no file handle kept), alpha dropped as transformers' processors drop it."""
    size: tuple[int, int]
    """(width, height), Pillow's order."""
    format: str
    """The decoded format, a key of `MIME_TYPES`."""
    detail: str
    """The caller's `image_url.detail`, one of `DETAILS` ("auto" when absent), for the model's processor."""
    digest: AttachmentDigest = field(repr=False)

    @property
    def content(self) -> Image.Image:
        """What a model's processor reads of it."""
        return self.image


@dataclass(frozen=True, slots=True, eq=False)
class AudioAttachment:
    """One decoded audio clip. `digest` (of the file's bytes) is memory-only, as an image's is. Compared by identity:
    its samples are an array."""

    kind: ClassVar[str] = "audio"
    samples: np.ndarray = field(repr=False)
    """`[frames]` float32 in [-1, 1), mono, at `rate`."""
    rate: int
    seconds: float
    digest: AttachmentDigest = field(repr=False)

    @property
    def content(self) -> np.ndarray:
        """What a model's processor reads of it."""
        return self.samples


MediaAttachment = ImageAttachment | AudioAttachment


@dataclass(frozen=True, slots=True)
class PlacedAttachment:
    """An attachment and the content part it came from, in request order."""

    index: PartIndex
    attachment: MediaAttachment


def collect_attachments(messages: Sequence[Any], limits: AttachmentLimits) -> tuple[PlacedAttachment, ...]:
    """Every `image_url` and `input_audio` part of `messages`, decoded, in the order the prompt holds them. The parts
    are counted, both kinds together, before any is decoded, so a request over `max_attachments` is refused at the
    cost of a walk. What this module does not own is skipped (text parts, string contents, malformed messages): the
    chat parser refuses those."""
    media_parts = [
        (PartIndex(message_index, part_index), part)
        for message_index, message in enumerate(messages)
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part_index, part in enumerate(message["content"])
        if isinstance(part, dict) and part.get("type") in PARSERS
    ]
    if len(media_parts) > limits.max_attachments:
        raise invalid_request(f"the request holds {len(media_parts)} attachments (images and audio); this node takes "
                              f"at most {limits.max_attachments} in one request: send fewer",
                              param=media_parts[limits.max_attachments][0].param(), code="array_above_max_length")
    return tuple(PlacedAttachment(index, PARSERS[part["type"]](part, index, limits)) for index, part in media_parts)


def parse_image_part(part: Any, index: PartIndex, limits: AttachmentLimits) -> ImageAttachment:
    """The image of one `image_url` content part, or the 400 that says what to change."""
    image_url = part.get("image_url") if isinstance(part, dict) else None
    if not isinstance(image_url, dict) or not isinstance(image_url.get("url"), str):
        raise _refusal(index.param("image_url"), "must be an object with a string 'url' (a data: URL such as "
                                                 "data:image/png;base64,...)")
    detail = image_url.get("detail", "auto")
    if detail not in DETAILS:
        raise _refusal(index.param("image_url.detail"), f"must be one of {', '.join(DETAILS)}")
    param = index.param("image_url.url")
    declared, data = _data_url(image_url["url"], param, limits)
    return decode_image(data, param, limits, declared, detail)


def parse_audio_part(part: Any, index: PartIndex, limits: AttachmentLimits) -> AudioAttachment:
    """The audio of one `input_audio` content part, or the 400 that says what to change."""
    audio = part.get("input_audio") if isinstance(part, dict) else None
    if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
        raise _refusal(index.param("input_audio"), "must be an object with a string 'data' (the audio file in "
                                                   "base64) and a 'format' (wav or mp3)")
    if audio.get("format") not in AUDIO_FORMATS:
        raise _refusal(index.param("input_audio.format"), f"must be one of {', '.join(AUDIO_FORMATS)}")
    param = index.param("input_audio.data")
    return decode_audio(_base64(audio["data"], param, limits, "audio"), param, limits, audio["format"])


def decode_audio(data: bytes, param: str, limits: AttachmentLimits, declared: str = "wav") -> AudioAttachment:
    """A WAV or MP3 file's samples (`declared`: the part's `format`, which the data must be), mono, under `limits`,
    resampled to `AUDIO_RATE`."""
    if len(data) > limits.max_bytes:
        raise _refusal(param, f"the audio is over {limits.max_bytes} bytes, the most this node takes per audio part")
    try:
        info = soundfile.info(io.BytesIO(data))
    except (soundfile.SoundFileError, RuntimeError, TypeError, ValueError):
        raise _refusal(param, "the data is not a WAV or MP3 file this node can decode") from None
    decoded = SOUND_FORMATS.get(info.format)
    if decoded is None:
        raise _refusal(param, f"the data is a {info.format} file; this node takes {', '.join(AUDIO_FORMATS)}")
    if decoded != declared:
        raise _refusal(param, f"is declared {declared} but the data is a {decoded} file: declare {decoded}")
    if decoded == "wav" and _wav_truncated(data):
        raise _refusal(param, "the audio data is truncated")  # libsndfile would play what is there
    channels, rate = info.channels, info.samplerate
    if not 1 <= channels <= limits.max_channels:
        raise _refusal(param, f"the audio has {channels} channels; this node takes 1 to {limits.max_channels}")
    if not MIN_RATE <= rate <= MAX_RATE:
        raise _refusal(param, f"the audio is sampled at {rate} Hz; this node takes {MIN_RATE} to {MAX_RATE} Hz")
    if info.frames > limits.max_audio_seconds * rate:
        raise _refusal(param, f"the audio is over {limits.max_audio_seconds} seconds, the most this node takes per "
                              "audio part: send it shorter")
    blocks: list[np.ndarray] = []
    frames = 0
    try:
        # Mixed to mono block by block: a many-channel clip is never held whole.
        for block in soundfile.blocks(io.BytesIO(data), blocksize=BLOCK_FRAMES, dtype="float32", always_2d=True):
            frames += len(block)
            if frames > limits.max_audio_seconds * rate:  # an MP3's header only estimates its length
                raise _refusal(param, f"the audio is over {limits.max_audio_seconds} seconds, the most this node "
                                      "takes per audio part: send it shorter")
            blocks.append(block.mean(axis=1, dtype=np.float32))
    except (soundfile.SoundFileError, RuntimeError):
        raise _refusal(param, "the audio data is corrupt") from None
    if not frames:
        raise _refusal(param, "the audio holds no samples")
    samples = np.concatenate(blocks)
    if rate != AUDIO_RATE:
        samples = soxr.resample(samples, rate, AUDIO_RATE).astype(np.float32, copy=False)
    return AudioAttachment(samples=samples, rate=AUDIO_RATE, seconds=frames / rate,
                           digest=AttachmentDigest(hashlib.sha256(data).digest()))


def _wav_truncated(data: bytes) -> bool:
    """Whether a RIFF/WAVE file's `data` chunk declares more bytes than the file holds (a header libsndfile has
    opened: its chunks are well formed up to `data`)."""
    at = 12
    while at + 8 <= len(data):
        name, size = data[at:at + 4], int.from_bytes(data[at + 4:at + 8], "little")
        if name == b"data":
            return size != 0xFFFFFFFF and at + 8 + size > len(data)  # 0xFFFFFFFF: a streamed file's unknown length
        at += 8 + size + (size & 1)
    return False


def image_from_data_url(url: str, param: str, limits: AttachmentLimits) -> ImageAttachment:
    """The image of a `data:` URL outside a chat message (an image edit's `image`), `param` naming its field."""
    declared, data = _data_url(url, param, limits)
    return decode_image(data, param, limits, declared)


def decode_image(data: bytes, param: str, limits: AttachmentLimits, declared: str | None = None,
                 detail: str = "auto") -> ImageAttachment:
    """`data` decoded under `limits`; `declared`: the format its sender named (a data: URL's type), which the
    data must be, or None where nothing was declared (a multipart file, whose own header is not trusted)."""
    if len(data) > limits.max_bytes:
        raise _refusal(param, f"the image is over {limits.max_bytes} bytes, the most this node takes per image: "
                              "send it scaled down or compressed")
    with _open(data, param, limits) as image:
        decoded = SAME_FORMAT.get(str(image.format), str(image.format))
        if declared is not None and decoded != declared:
            raise _refusal(param, f"declares {MIME_TYPES[declared][0]} but the data is a {decoded} image: "
                                  f"declare {MIME_TYPES[decoded][0]}")
        width, height = image.size
        if width * height > limits.max_pixels:
            raise _too_many_pixels(param, limits)
        try:
            image.load()
        except (OSError, SyntaxError, ValueError, EOFError):
            raise _corrupt(param) from None
        rgb = image.convert("RGB")
    return ImageAttachment(image=rgb, size=(width, height), format=decoded, detail=detail,
                           digest=AttachmentDigest(hashlib.sha256(data).digest()))


def _data_url(url: str, param: str, limits: AttachmentLimits) -> tuple[str, bytes]:
    """The declared format and the decoded bytes of a `data:<mime>[;params];base64,<data>` URL. The size is
    checked from the base64 length before anything is decoded."""
    if url[:5].lower() != "data:":
        raise _remote(url, param, limits)
    header, comma, payload = url[5:].partition(",")
    fields = header.split(";")
    if not comma or fields[-1].lower() != "base64":
        raise _refusal(param, "must be a base64 data: URL (data:image/png;base64,...)")
    declared = next((name for name in sorted(limits.formats) if fields[0].lower() in MIME_TYPES[name]), None)
    if declared is None:
        mime_types = [mime for name in sorted(limits.formats) for mime in MIME_TYPES[name]]
        raise _refusal(param, f"declares a MIME type this node does not take; use one of {', '.join(mime_types)}")
    return declared, _base64(payload, param, limits, "image")


def _base64(payload: str, param: str, limits: AttachmentLimits, kind: str) -> bytes:
    """The bytes of a base64 `payload`, its size checked from its length before anything is decoded."""
    if -(-len(payload) // 4) * 3 > limits.max_bytes:  # an upper bound: padding counted as data (2 bytes at most)
        raise _refusal(param, f"the decoded {kind} would be over {limits.max_bytes} bytes, the most this node takes "
                              f"per {kind}: send it {'scaled down or compressed' if kind == 'image' else 'shorter'}")
    try:
        return base64.b64decode(payload, validate=True)
    except ValueError:
        raise _refusal(param, "the data is not valid base64 (standard alphabet, padded, no whitespace)") from None


def _remote(url: str, param: str, limits: AttachmentLimits) -> InvalidRequest:
    """The refusal of a URL that is not `data:`. The URL itself is never quoted: it may carry a caller's token."""
    try:
        parts = urlsplit(url)
        host = parts.hostname if parts.scheme in ("http", "https") else None
    except ValueError:
        host = None
    if host is not None and host in limits.allowed_hosts:
        reason = "this node's policy allows the image's host, but fetching images is not built yet"
    else:
        reason = "a confidential node fetches nothing for a caller, so only inline images are taken"
    return _refusal(param, f"{reason}: send the image as a data: URL (data:image/png;base64,...)",
                    code="unsupported_parameter")


def _open(data: bytes, param: str, limits: AttachmentLimits) -> Image.Image:
    """The image with its header parsed and no pixel decoded, by the allow-listed formats' parsers only.

    Pillow checks the declared dimensions against its own `MAX_IMAGE_PIXELS` while opening: above it a warning,
    above twice it `DecompressionBombError`. Both are refused here as too many pixels; the warning is made an
    error with `catch_warnings`, which changes the interpreter's filters while it runs. On Python 3.11 those are
    shared by all threads, so a decode on another thread may see the filter or lose it: either way the node's
    own `max_pixels`, checked after opening, is what refuses, and Pillow's global is never touched."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=sorted(limits.formats))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise _too_many_pixels(param, limits) from None
    except UnidentifiedImageError:
        found = _format_of(data)
        if found in limits.formats:
            raise _corrupt(param) from None
        what = f"the data is a {found} image" if found else "the data is not an image"
        raise _refusal(param, f"{what}; this node decodes {', '.join(sorted(limits.formats))}") from None
    except (OSError, SyntaxError, ValueError, EOFError):  # a parser that got far enough to fail on its own terms
        raise _corrupt(param) from None


def _format_of(data: bytes) -> str | None:
    """The format Pillow recognises from the data's first 16 bytes (what `Image.open` reads to choose), by each
    plugin's signature test alone, no parser running: it names an unsupported format in the refusal. Plugins
    without a signature test are never named."""
    Image.init()
    prefix = data[:16]
    for name, (_, accept) in Image.OPEN.items():
        try:
            if accept is not None and accept(prefix):
                return name
        except (SyntaxError, IndexError, TypeError, struct.error):  # a short prefix, as `Image.open` tolerates it
            continue
    return None


def _refusal(param: str, reason: str, code: str | None = None) -> InvalidRequest:
    """The 400 for the field `param`; `reason` never quotes the caller's data."""
    return invalid_request(f"{param}: {reason}", param=param, code=code)


def _corrupt(param: str) -> InvalidRequest:
    return _refusal(param, "the image data is truncated or corrupt")


def _too_many_pixels(param: str, limits: AttachmentLimits) -> InvalidRequest:
    return _refusal(param, f"the image declares more than {limits.max_pixels} pixels, the most this node decodes "
                           "per image: send it scaled down")


PARSERS: dict[str, Callable[[Any, PartIndex, AttachmentLimits], MediaAttachment]] = {
    "image_url": parse_image_part, "input_audio": parse_audio_part}
"""The content part types this module decodes, and how."""
