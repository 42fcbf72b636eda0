"""The audio intake (`node/attachments.py`): WAV decoded to exact mono samples, and each bad part refused with a 400
that names it and quotes none of its data."""

from __future__ import annotations

import base64
import hashlib
import io
import wave
from typing import Any

import numpy as np
import pytest
import soundfile
from PIL import Image

from node.attachments import (
    AUDIO_RATE,
    AttachmentLimits,
    AudioAttachment,
    ImageAttachment,
    PartIndex,
    collect_attachments,
    parse_audio_part,
)
from node.errors import InvalidRequest
from node.openai_schema import ChatBounds, parse_chat

AT = PartIndex(2, 1)
DATA = "messages[2].content[1].input_audio.data"
FORMAT = "messages[2].content[1].input_audio.format"


def wav(frames: bytes, channels: int = 1, width: int = 2, rate: int = AUDIO_RATE) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(channels)
        writer.setsampwidth(width)
        writer.setframerate(rate)
        writer.writeframes(frames)
    return out.getvalue()


def encoded(samples: np.ndarray, rate: int, container: str) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format=container)
    return out.getvalue()


def flac(samples: np.ndarray, rate: int = AUDIO_RATE) -> bytes:
    return encoded(samples, rate, "FLAC")


def mp3(samples: np.ndarray, rate: int = AUDIO_RATE) -> bytes:
    return encoded(samples, rate, "MP3")


def pcm16(*values: int) -> bytes:
    return np.array(values, dtype="<i2").tobytes()


def part(data: bytes | str, audio_format: str = "wav") -> dict[str, Any]:
    encoded = data if isinstance(data, str) else base64.b64encode(data).decode()
    return {"type": "input_audio", "input_audio": {"data": encoded, "format": audio_format}}


def refusal(body: dict[str, Any], limits: AttachmentLimits | None = None) -> tuple[str, str | None, str | None]:
    with pytest.raises(InvalidRequest) as caught:
        parse_audio_part(body, AT, limits or AttachmentLimits())
    return caught.value.message, caught.value.param, caught.value.code


def test_a_16_bit_mono_wav_gives_its_samples_exactly() -> None:
    data = wav(pcm16(0, 16384, -32768, 32767))
    audio = parse_audio_part(part(data), AT, AttachmentLimits())
    assert audio.samples.dtype == np.float32
    assert audio.samples.tolist() == [0.0, 0.5, -1.0, 32767 / 32768]
    assert (audio.rate, audio.seconds, audio.kind) == (AUDIO_RATE, 4 / AUDIO_RATE, "audio")
    assert audio.digest == hashlib.sha256(data).digest()
    assert audio.content is audio.samples
    assert "digest" not in repr(audio) and "samples" not in repr(audio)


def test_channels_are_averaged_to_mono() -> None:
    audio = parse_audio_part(part(wav(pcm16(1000, -3000, 32767, 32767), channels=2)), AT, AttachmentLimits())
    assert audio.samples.tolist() == [-1000 / 32768, 32767 / 32768]


@pytest.mark.parametrize(("width", "frames", "expected"), [
    (1, bytes([128, 192, 0]), [0.0, 0.5, -1.0]),  # unsigned, 128 the middle
    (3, bytes([0, 0, 0xC0, 0xFF, 0xFF, 0x7F]), [-0.5, 8388607 / 8388608]),
    (4, np.array([-(1 << 30), 1 << 29], dtype="<i4").tobytes(), [-0.5, 0.25]),
])
def test_8_24_and_32_bit_pcm_are_scaled_to_full_scale(width: int, frames: bytes, expected: list[float]) -> None:
    audio = parse_audio_part(part(wav(frames, width=width)), AT, AttachmentLimits())
    assert audio.samples.tolist() == expected


def test_a_44_1_khz_stereo_wav_is_mixed_and_resampled_to_the_encoders_rate() -> None:
    """A second of a 440 Hz tone at CD rate comes out as a second at 16 kHz, the tone intact (soxr)."""
    tone = np.sin(2 * np.pi * 440 * np.arange(44_100) / 44_100)
    stereo = (np.stack([tone, tone], axis=1) * 16384).astype("<i2")
    audio = parse_audio_part(part(wav(stereo.tobytes(), channels=2, rate=44_100)), AT, AttachmentLimits())
    assert (audio.rate, audio.seconds, len(audio.samples)) == (AUDIO_RATE, 1.0, AUDIO_RATE)
    expected = np.sin(2 * np.pi * 440 * np.arange(AUDIO_RATE) / AUDIO_RATE) * 0.5
    assert float(np.abs(audio.samples[100:-100] - expected[100:-100]).max()) < 1e-3


def test_an_mp3_is_decoded() -> None:
    tone = (np.sin(2 * np.pi * 440 * np.arange(44_100) / 44_100) * 0.5).astype(np.float32)
    audio = parse_audio_part(part(mp3(tone, 44_100), "mp3"), AT, AttachmentLimits())
    assert audio.rate == AUDIO_RATE and abs(audio.seconds - 1.0) < 0.1
    assert 0.3 < float(np.abs(audio.samples).max()) < 0.7  # the tone, not silence


def test_the_same_file_has_the_same_digest_and_another_file_another() -> None:
    one, two = wav(pcm16(1, 2, 3)), wav(pcm16(1, 2, 4))
    digests = [parse_audio_part(part(data), AT, AttachmentLimits()).digest for data in (one, one, two)]
    assert digests[0] == digests[1] != digests[2]


BAD: dict[str, tuple[dict[str, Any], AttachmentLimits, tuple[str, str | None, str | None]]] = {
    "corrupt base64": (part("@@@not base64"), AttachmentLimits(), (
        f"{DATA}: the data is not valid base64 (standard alphabet, padded, no whitespace)", DATA, None)),
    "not audio": (part(b"plain text, not sound"), AttachmentLimits(), (
        f"{DATA}: the data is not a WAV or MP3 file this node can decode", DATA, None)),
    "too long": (part(wav(pcm16(*[0] * (2 * AUDIO_RATE)))), AttachmentLimits(max_audio_seconds=1), (
        f"{DATA}: the audio is over 1 seconds, the most this node takes per audio part: send it shorter", DATA,
        None)),
    "a rate below telephone audio": (part(wav(pcm16(0, 1), rate=4_000)), AttachmentLimits(), (
        f"{DATA}: the audio is sampled at 4000 Hz; this node takes 8000 to 192000 Hz", DATA, None)),
    "another container": (part(flac(np.zeros(16, dtype=np.float32))), AttachmentLimits(), (
        f"{DATA}: the data is a FLAC file; this node takes wav, mp3", DATA, None)),
    "mp3 declared as wav": (part(mp3(np.zeros(AUDIO_RATE, dtype=np.float32))), AttachmentLimits(), (
        f"{DATA}: is declared wav but the data is a mp3 file: declare mp3", DATA, None)),
    "too many channels": (part(wav(pcm16(*[0] * 9), channels=9)), AttachmentLimits(), (
        f"{DATA}: the audio has 9 channels; this node takes 1 to 8", DATA, None)),
    "no samples": (part(wav(b"")), AttachmentLimits(), (f"{DATA}: the audio holds no samples", DATA, None)),
    "truncated": (part(wav(pcm16(1, 2, 3, 4))[:-3]), AttachmentLimits(), (
        f"{DATA}: the audio data is truncated", DATA, None)),
    "over the bytes limit": (part(wav(pcm16(*[0] * 100))), AttachmentLimits(max_bytes=100), (
        f"{DATA}: the decoded audio would be over 100 bytes, the most this node takes per audio: send it shorter",
        DATA, None)),
    "not an mp3": (part(b"\xff\xfb\x90\x00" + bytes(100), "mp3"), AttachmentLimits(), (
        f"{DATA}: the data is not a WAV or MP3 file this node can decode", DATA, None)),
    "an unknown format": (part(wav(pcm16(0)), "flac"), AttachmentLimits(), (
        f"{FORMAT}: must be one of wav, mp3", FORMAT, None)),
    "no data": ({"type": "input_audio", "input_audio": {"format": "wav"}}, AttachmentLimits(), (
        "messages[2].content[1].input_audio: must be an object with a string 'data' (the audio file in base64) and "
        "a 'format' (wav or mp3)", "messages[2].content[1].input_audio", None)),
}


@pytest.mark.parametrize("what", BAD)
def test_bad_audio_is_refused_by_name(what: str) -> None:
    body, limits, expected = BAD[what]
    assert refusal(body, limits) == expected


def test_images_and_audio_count_together_against_the_attachment_limit() -> None:
    png = "data:image/png;base64,not*base64"  # never decoded: the count refuses first
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png}}, part(wav(pcm16(0)))]},
                {"role": "user", "content": [part(wav(pcm16(1)))]}]
    with pytest.raises(InvalidRequest) as caught:
        collect_attachments(messages, AttachmentLimits(max_attachments=2))
    assert (caught.value.param, caught.value.code) == ("messages[1].content[0]", "array_above_max_length")


def test_a_chat_holds_its_audio_parts_in_order() -> None:
    png = io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, "PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    bounds = ChatBounds(10, 4096, 16, 0, AttachmentLimits())
    content = [{"type": "text", "text": "hear "}, part(wav(pcm16(5))), {"type": "text", "text": " and see "},
               {"type": "image_url", "image_url": {"url": url}}]
    message = parse_chat({"model": "m", "messages": [{"role": "user", "content": content}]}, bounds).messages[0]
    assert message.content == "hear  and see "
    kinds = [type(p) for p in message.parts]
    assert kinds == [str, AudioAttachment, str, ImageAttachment]
