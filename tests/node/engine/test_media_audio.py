"""Audio attachments through the engine (`node/engine/media.py` with the audio kind): prefill chunks on input
embeddings against Audio Flamingo 3's own forward, reuse on against reuse off over a conversation that keeps, swaps,
drops and repeats a clip, and the encoder calls each turn makes."""

from __future__ import annotations

import base64
import io
import wave
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from node.attachments import AUDIO_RATE
from node.cli import AUDIO_LANGUAGE_FAMILIES, build_parser
from node.engine.loader import LoadedModel, load_model
from node.engine.media import AUDIO, MEDIA_KEY, MediaFamily, MediaUnsupported, SequenceMedia
from node.engine.synthetic import init_model
from node.engine.synthetic_alm import AUDIO_LANGUAGE
from node.errors import InvalidRequest
from tests.node.engine.media_pairs import MediaPair, chunked_logits, keep_swap_drop_repeat

ARCH = "alm-audioflamingo3"
AGREEMENT = 1e-5
"""Largest |difference| of logits from the model's own forward, relative to the largest |logit|."""
ROWS_PER_SECOND = 25
"""The small model's encoder rows a second (`synthetic_alm.AUDIO_SIZES`): 100 mel frames, halved twice."""


def clip(seed: int, seconds: float = 1.0) -> np.ndarray:
    """Seeded noise at the node's rate, as 16-bit PCM would carry it: `[frames]` float32."""
    noise = np.random.default_rng(seed).uniform(-0.5, 0.5, int(seconds * AUDIO_RATE))
    return (np.round(noise * 32768) / 32768).astype(np.float32)


def wav(seed: int, seconds: float = 1.0) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(AUDIO_RATE)
        writer.writeframes((clip(seed, seconds) * 32768).astype("<i2").tobytes())
    return out.getvalue()


def audio_part(seed: int, seconds: float = 1.0) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(seed, seconds)).decode(),
                                                   "format": "wav"}}


def user(text: str, *clips: int) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}, *(audio_part(seed) for seed in clips)]}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(ARCH, init_model(ARCH, tmp_path_factory.mktemp("alm") / ARCH, size="small"), device="cpu")


def test_the_family_is_audio_with_its_own_encoder_identity(loaded: LoadedModel) -> None:
    family = loaded.media
    assert family is not None and loaded.media_blocker is None and loaded.reuse_blocker is None
    assert family.kind is AUDIO and family.part == "<sound>"
    assert family.encoder == "audioflamingo3:audio:WhisperFeatureExtractor"
    assert family.expand(clip(1, 3.0)).rows == 3 * ROWS_PER_SECOND  # two windows: 2 s and 1 s


def test_a_model_whose_extractor_reads_another_rate_takes_no_audio(loaded: LoadedModel) -> None:
    processor = AutoProcessor.from_pretrained(loaded.path)
    processor.feature_extractor.sampling_rate = 24_000
    with pytest.raises(MediaUnsupported) as caught:
        MediaFamily(loaded.model, processor, loaded.tokenizer, AUDIO)
    assert str(caught.value) == ("WhisperFeatureExtractor reads audio at 24000 Hz; the node brings audio to 16000 Hz "
                                 "and resamples nothing else")


def test_the_command_line_builds_it() -> None:
    assert AUDIO_LANGUAGE_FAMILIES == AUDIO_LANGUAGE == (ARCH,)
    args = build_parser().parse_args(["models", "init", "--arch", ARCH, "--size", "small", "out"])
    assert (args.arch, args.size) == (ARCH, "small")


def test_chunks_on_input_embeddings_give_the_models_own_forward(loaded: LoadedModel) -> None:
    """Prefill chunks that start or end inside a clip of two encoder windows, and a decode step after them,
    against the model's forward over the processor's whole input."""
    family = loaded.media
    assert family is not None
    model, samples = loaded.model, clip(1, 2.5)
    whole = AutoProcessor.from_pretrained(loaded.path)(text=["listen " + family.part + " now"], audio=[samples],
                                                      sampling_rate=AUDIO_RATE, return_tensors="pt")
    with torch.inference_mode():
        reference = model(**whole).logits[0].float()
    ids = whole["input_ids"][0].tolist()
    expanded = family.expand(samples)
    assert expanded.rows == 50 + 12  # windows of 2 s and 0.5 s (50 mel frames: 25 after the convolution, 12 pooled)
    offset = ids.index(family.placeholder) - expanded.start
    assert ids[offset:offset + len(expanded.ids)] == expanded.ids
    media = family.prompt_media(ids, [(offset, expanded, bytes(32))])
    item = media.items[0]
    assert (item.kind, item.end - item.start, media.whole, media.delta) == ("audio", expanded.rows, False, 0)
    held = SequenceMedia(media, {0: family.encode(expanded.inputs)})
    scale = float(reference.abs().max())
    for cuts in ([len(ids)], [item.start + 1, len(ids)], [2, item.start + 30, item.end - 1, len(ids)]):
        logits, cache = chunked_logits(model, held, ids, cuts)
        assert float((logits - reference).abs().max()) <= AGREEMENT * scale
    following = int(reference[-1].argmax())
    more = {**whole, "input_ids": torch.cat([whole["input_ids"], torch.tensor([[following]])], dim=1)}
    more.pop("attention_mask")
    with torch.inference_mode():
        expected = model(**more).logits[0, -1].float()
        step = model(input_ids=torch.tensor([[following]]), position_ids=torch.tensor([[len(ids)]]),
                     cache=cache, use_cache=True).logits[0, -1].float()
    assert float((step - expected).abs().max()) <= AGREEMENT * scale


def test_reuse_on_equals_reuse_off_and_each_clip_is_encoded_once(loaded: LoadedModel) -> None:
    """A conversation about one clip: greedy replies equal with reuse on and off at every turn; the clip is encoded
    once (later turns restore past it, or find its encoding), a swapped clip is encoded, a dropped one is not, and
    the same clip sent again in a new message is found in the caller's encoding cache."""
    pair = MediaPair(loaded)
    second = keep_swap_drop_repeat(pair, user, "what is this sound", "and its pitch?")
    assert second.cached_read_tokens > ROWS_PER_SECOND  # restored past the clip


def test_another_caller_encodes_the_same_clip_again(loaded: LoadedModel) -> None:
    pair = MediaPair(loaded)
    mine = pair.turn([user("hear it", 3)], caller="a")
    again = pair.turn([user("hear it", 3)], caller="a")
    theirs = pair.turn([user("hear it", 3)], caller="b")
    assert (mine.attachments_encoded, again.attachments_encoded, theirs.attachments_encoded) == (1, 0, 1)
    assert (again.cached_read_tokens, theirs.cached_read_tokens) == (again.prompt_tokens - 1, 0)


def test_prompts_with_different_clips_diverge_at_the_clip(loaded: LoadedModel) -> None:
    pair = MediaPair(loaded)
    one, two, same = (pair.prompt([user("hear", seed)]) for seed in (4, 5, 4))
    assert one.media is not None and two.media is not None and same.media is not None
    item = one.media.items[0]
    assert one.ids == two.ids and item.end - item.start == ROWS_PER_SECOND
    assert one.media.keys[:item.start] == two.media.keys[:item.start]
    assert all(a != b and a >= MEDIA_KEY for a, b in zip(one.media.keys[item.start:item.end],
                                                         two.media.keys[item.start:item.end], strict=True))
    assert one.media.keys == same.media.keys


def test_an_image_part_is_refused_by_an_audio_model(loaded: LoadedModel) -> None:
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, "PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    with pytest.raises(InvalidRequest) as caught:
        MediaPair(loaded).prompt([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
    assert (caught.value.message, caught.value.param) == (f"model {ARCH!r} takes no image attachments", "messages")


def test_a_clip_too_short_for_any_token_is_refused_by_the_request(loaded: LoadedModel) -> None:
    """The processor makes no placeholder of a few milliseconds: a 400 that names the attachment, not a 500."""
    with pytest.raises(InvalidRequest) as caught:
        MediaPair(loaded).prompt([user("hear", 0), {"role": "user", "content": [
            {"type": "text", "text": "and"}, audio_part(5, seconds=0.002)]}])
    assert caught.value.param == "messages"
    assert "attachment 2 of the request (audio)" in caught.value.message and "too short" in caught.value.message
