"""Deterministic randomly initialised audio-language models, written with their processors as Hugging Face directories.

The family is Audio Flamingo 3 (`audioflamingo3` in transformers): a Whisper-style audio encoder whose frames are
pooled 2:1 and projected into a Qwen2 text model, the shape of Qwen2-Audio. Qwen2-Audio itself is not the one
built: its transformers class encodes audio only inside its forward (it has no `get_audio_features`), so the node
could encode an attachment apart from the prompt only with a copy of that forward; Audio Flamingo 3's class has the
method, as the vision-language models do (`media.py` calls it).

The text side is the tokenizer and Qwen2 shape of the text families in `synthetic`, with the audio token added
after the trained vocabulary; the processor's feature extractor is Whisper's, built from parameters. Everything
is seeded and nothing is fetched.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AudioFlamingo3Config,
    AudioFlamingo3EncoderConfig,
    AudioFlamingo3ForConditionalGeneration,
    AudioFlamingo3Processor,
    Qwen2Config,
    WhisperFeatureExtractor,
)

from node.engine.synthetic import SEED, SIZES, Size, UnknownArchitectureError, build_tokenizer
from node.engine.synthetic_vlm import chat_template

SAMPLING_RATE = 16_000
"""Whisper's rate: the extractor's, which the node resamples nothing to (`attachments.decode_audio`)."""
HOP = 160
"""Samples per mel frame (10 ms at 16 kHz), Whisper's."""
AUDIO_TOKEN = "<sound>"
AUDIO_PART = "<sound>"
"""What the chat template writes for an audio part; the processor repeats the token once per encoder row."""


@dataclass(frozen=True, slots=True)
class AudioSize:
    """The audio encoder's shapes; the text model beside it takes the `synthetic.SIZES` entry of the same name."""

    window: int
    """Seconds of audio per encoder window (the extractor's `chunk_length`): longer audio takes several windows,
    each `window * 25` rows (100 mel frames a second, halved by a convolution, halved by pooling)."""
    mels: int
    hidden: int
    layers: int
    heads: int
    intermediate: int


AUDIO_SIZES: dict[str, AudioSize] = {
    # The real model's window and mel bins; a 30 s window is 750 rows.
    "default": AudioSize(window=30, mels=128, hidden=256, layers=4, heads=4, intermediate=1024),
    # For tests: a 2 s window of 50 rows, so that a second of audio is 25 rows and 3 s take two windows.
    "small": AudioSize(window=2, mels=32, hidden=64, layers=2, heads=4, intermediate=128),
}


def _config(size: Size, audio: AudioSize, vocab: int, audio_token_id: int, eos: int, pad: int) -> AudioFlamingo3Config:
    text = Qwen2Config(vocab_size=vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
                       num_hidden_layers=size.layers, num_attention_heads=size.heads,
                       num_key_value_heads=size.kv_heads, max_position_embeddings=size.context, bos_token_id=None,
                       eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=False)
    encoder = AudioFlamingo3EncoderConfig(num_mel_bins=audio.mels, hidden_size=audio.hidden,
                                          num_hidden_layers=audio.layers, num_attention_heads=audio.heads,
                                          intermediate_size=audio.intermediate,
                                          max_source_positions=audio.window * SAMPLING_RATE // HOP // 2)
    return AudioFlamingo3Config(audio_config=encoder, text_config=text, audio_token_id=audio_token_id)


def init_audio_language_model(arch: str, out_dir: Path, size: str) -> Path:
    """Write a seeded random audio-language model, its tokenizer and its processor to out_dir (must not exist)."""
    if arch not in AUDIO_LANGUAGE:
        raise UnknownArchitectureError(f"unknown audio-language architecture {arch!r}")
    if size not in AUDIO_SIZES:
        raise UnknownArchitectureError(
            f"size {size!r} has no audio-language recipe; choose one of: {', '.join(sorted(AUDIO_SIZES))}")
    text_size, audio = SIZES[size], AUDIO_SIZES[size]
    template = chat_template(AUDIO_PART, ("input_audio", "audio"))
    tokenizer = build_tokenizer(text_size.context, {"audio_token": AUDIO_TOKEN}, template)
    config = _config(text_size, audio, len(tokenizer), tokenizer.audio_token_id, tokenizer.eos_token_id,
                     tokenizer.pad_token_id)
    torch.manual_seed(SEED)
    model = AudioFlamingo3ForConditionalGeneration(config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=False)
    model.save_pretrained(out_dir)
    features = WhisperFeatureExtractor(feature_size=audio.mels, sampling_rate=SAMPLING_RATE, hop_length=HOP,
                                       chunk_length=audio.window, n_fft=400, return_attention_mask=True)
    AudioFlamingo3Processor(features, tokenizer, chat_template=template, audio_token=AUDIO_TOKEN).save_pretrained(
        out_dir)
    return out_dir


AUDIO_LANGUAGE = ("alm-audioflamingo3",)
"""What `tenzro models init --arch` builds here (`node.cli.AUDIO_LANGUAGE_FAMILIES` names the same)."""
