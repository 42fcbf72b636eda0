"""`tenzro models init --arch diffusion`: a small seeded, randomly initialised Stable-Diffusion-shaped pipeline.

Written with diffusers' `save_pretrained`, so that `DiffusionPipeline.from_pretrained(DIR)` loads it offline like
any local diffusers directory: a CLIP text encoder with a byte-level CLIP tokenizer built here (no merges, so each
character is a token: nothing is downloaded), a conditional UNet, a KL autoencoder and a DDIM scheduler. It is
small enough that a few denoising steps of a 64x64 image run in well under a second on a CPU, which is what the
tests and `tenzro bench media` need; its images are noise, but deterministic noise, which is what reuse is
checked against.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from tokenizers.pre_tokenizers import ByteLevel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

DIFFUSION = "diffusion"
"""The architecture name `tenzro models init --arch` takes."""
SEED = 0
TEXT_POSITIONS = 32
"""The text encoder's context: prompts are truncated to it, as Stable Diffusion's 77."""
HIDDEN = 32
SAMPLE_SIZE = 64
"""Pixels per side of the default image: the VAE downsamples by 2 (two blocks), so latents are 32x32."""


def build_tokenizer() -> CLIPTokenizer:
    """A CLIP tokenizer whose vocabulary is the 256 byte-level symbols, alone and word-final, and no merges."""
    symbols = sorted(ByteLevel.alphabet())
    vocabulary = ["<|startoftext|>", "<|endoftext|>", *symbols, *(symbol + "</w>" for symbol in symbols)]
    return CLIPTokenizer(vocab={token: i for i, token in enumerate(vocabulary)}, merges=[],
                         model_max_length=TEXT_POSITIONS)


def build_pipeline(tokenizer: CLIPTokenizer) -> Any:
    """The components from the seed, in a fixed order, so every build is the same bytes. (A
    `StableDiffusionPipeline`, typed `Any`: diffusers' lazy modules give mypy no types.)"""
    torch.manual_seed(SEED)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=TEXT_POSITIONS, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    unet = UNet2DConditionModel(
        sample_size=SAMPLE_SIZE // 2, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=HIDDEN, attention_head_dim=8,
        norm_num_groups=8)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 32),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), layers_per_block=1, norm_num_groups=8,
        sample_size=SAMPLE_SIZE)
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    return StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)


def init_diffusion_model(out_dir: Path) -> Path:
    """Write the pipeline to `out_dir` (created; must not exist)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=False)
    pipeline = build_pipeline(build_tokenizer())
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
