"""A diffusers image pipeline whose prompt conditioning and reference-image latents are reused per scope.

A render has two encoder stages before denoising: the text encoder turns the prompt into its conditioning (and the
empty prompt into the unconditional half of classifier-free guidance), and, for an edit, the VAE encoder turns the
reference image into latents. Both depend on the content alone, so a caller that renders one prompt at eight seeds,
or edits one image eight ways, needs each once. They are kept in the node's `EncodingCache` (per scope, HMAC-keyed
by the SHA-256 of the content, sealed where sealing is on, shredded with the scope), under an encoder identity that
names the model, the stage, the dtype and, for latents, the size they were taken at.

Denoising runs for every image: it is what the seed varies. With reuse on or off a render takes the same path
from the encodings onwards (the pipeline is always handed `prompt_embeds`, and an edit's latents), so the same
seed gives the same PNG bytes either way. Image `i` of a request is drawn from seed `seed + i`, so it is the same
image whatever `n` was.

An edit's reference latents are the VAE posterior's mode, not a sample of it as diffusers' img2img draws: a
sample would depend on the job's generator, and so could not be reused across seeds.
"""

from __future__ import annotations

import hashlib
import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import DiffusionPipeline, StableDiffusionImg2ImgPipeline, StableDiffusionPipeline
from PIL import Image

from cache.encodings import EncodingCache
from cache.scope import Scope

GUIDANCE_SCALE = 7.5
"""Stable Diffusion's default: the conditional and unconditional predictions both run, so both are encoded."""
EDIT_STRENGTH = 0.75
"""How far an edit departs from its reference (diffusers' img2img default): the share of the steps that run."""


class PipelineLoadError(Exception):
    """The directory holds no diffusers pipeline this node serves."""


class RenderCancelled(Exception):
    """The job was cancelled between denoising steps."""


@dataclass(frozen=True, slots=True)
class Reference:
    """An edit's reference image. `digest` (SHA-256 of the bytes sent) keys its latents; memory-only."""

    image: Image.Image
    digest: bytes = b""

    def __repr__(self) -> str:
        return f"Reference(size={self.image.size})"


@dataclass(frozen=True, slots=True)
class ImageRequest:
    """What a request asks for (`image_request.py` parses it): `n` images of `width` x `height` pixels, from seeds
    `seed` to `seed + n - 1`, of `prompt` (and of `reference`, for an edit)."""

    model: str
    prompt: str
    n: int
    width: int
    height: int
    steps: int
    seed: int
    reference: Reference | None = None

    def __repr__(self) -> str:  # never the prompt
        return f"ImageRequest(n={self.n}, size={self.width}x{self.height}, steps={self.steps})"


@dataclass(frozen=True, slots=True)
class Render:
    """One request's job: what it asks for, for whom."""

    scope: Scope
    request: ImageRequest
    reuse: bool = True
    """False: the caller keeps nothing (`retention: none`), so nothing is looked up or stored."""


@dataclass(frozen=True, slots=True)
class EncoderUse:
    """How one encoder stage was served for a request: computed, or taken from the scope's cache."""

    encoded: int
    reused: int


@dataclass(frozen=True, slots=True)
class Rendered:
    images: tuple[bytes, ...]
    """PNG bytes, image `i` from seed `seed + i`."""
    prompt_tokens: int
    """The prompt's tokens as the text encoder took them (truncated to its context)."""
    conditionings: EncoderUse
    references: EncoderUse
    encode_s: float
    """Time in the encoders (zero when every encoding was reused)."""
    denoise_s: float


class ImagePipeline:
    """The served pipeline: text-to-image and its image-to-image twin over the same components."""

    def __init__(self, model_id: str, text: Any, encodings: EncodingCache | None) -> None:
        """`text`: a loaded `StableDiffusionPipeline` (typed `Any`: diffusers' lazy modules give mypy no types)."""
        self.model_id = model_id
        self.text = text
        self.edit = _image_to_image(text)
        self.text.set_progress_bar_config(disable=True)
        self.edit.set_progress_bar_config(disable=True)
        self.encodings = encodings
        """None with `--no-reuse`: every render encodes."""
        self.device = text.device
        self.dtype = text.unet.dtype
        self.base_size = int(text.unet.config.sample_size) * int(text.vae_scale_factor)
        self.sizes = tuple(f"{side}x{side}" for side in (self.base_size // 2, self.base_size, self.base_size * 2))
        """What `size` may be: the trained size, half and double it (as OpenAI's 256, 512 and 1024 squares)."""
        self.text_encoder_calls = 0
        self.vae_encoder_calls = 0

    @classmethod
    def load(cls, model_id: str, path: Path, device: torch.device, dtype: torch.dtype,
             encodings: EncodingCache | None) -> ImagePipeline:
        try:
            pipe = DiffusionPipeline.from_pretrained(path, dtype=dtype, local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PipelineLoadError(f"cannot load the diffusers pipeline in {path}: {exc}") from exc
        if not isinstance(pipe, StableDiffusionPipeline):
            raise PipelineLoadError(f"{path} holds a {type(pipe).__name__}; this node serves Stable Diffusion "
                                    "shaped pipelines (a CLIP text encoder, a UNet and a KL autoencoder)")
        text: Any = pipe
        return cls(model_id, text.to(device), encodings)

    def encoder_identity(self, stage: str) -> str:
        return f"{self.model_id}/{stage}/{self.dtype}"

    def prompt_tokens(self, prompt: str) -> int:
        tokenizer = self.text.tokenizer
        return len(tokenizer(prompt, truncation=True, max_length=tokenizer.model_max_length)["input_ids"])

    @torch.inference_mode()
    def render(self, job: Render, cancelled: Callable[[], bool] = lambda: False) -> Rendered:
        started = time.perf_counter()
        cache = self.encodings if job.reuse else None
        asked = job.request
        conditioning, conditionings = self._conditioning(job.scope, asked.prompt, cache)
        negative, positive = conditioning[0:1], conditioning[1:2]
        latents, references = (None, EncoderUse(0, 0)) if asked.reference is None else self._reference_latents(
            job.scope, asked.reference, asked.width, asked.height, cache)
        encoded = time.perf_counter()

        def step_end(pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            if cancelled():
                raise RenderCancelled
            return tensors

        images = []
        for index in range(asked.n):
            generator = torch.Generator(self.device).manual_seed(asked.seed + index)
            common = {"prompt_embeds": positive, "negative_prompt_embeds": negative, "generator": generator,
                      "num_inference_steps": asked.steps, "guidance_scale": GUIDANCE_SCALE, "output_type": "pil",
                      "callback_on_step_end": step_end}
            if latents is None:
                out = self.text(height=asked.height, width=asked.width, **common)
            else:
                out = self.edit(image=latents, strength=EDIT_STRENGTH, **common)
            images.append(_png(out.images[0]))
        encode_s = encoded - started if conditionings.encoded or references.encoded else 0.0
        return Rendered(tuple(images), self.prompt_tokens(asked.prompt), conditionings, references, encode_s,
                        time.perf_counter() - encoded)

    def _conditioning(self, scope: Scope, prompt: str, cache: EncodingCache | None
                      ) -> tuple[torch.Tensor, EncoderUse]:
        """[2, positions, hidden]: the empty prompt's encoding, then the prompt's (guidance's two halves)."""
        digest, encoder = hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).digest(), self.encoder_identity(
            "text_encoder")
        found = cache.get(scope, digest, encoder) if cache is not None else None
        if found is not None:
            return found, EncoderUse(0, 1)
        self.text_encoder_calls += 1
        positive, negative = self.text.encode_prompt(prompt, self.device, 1, True)
        conditioning = torch.cat([negative, positive]).clone()
        if cache is not None:
            cache.put(scope, digest, encoder, conditioning)
        return conditioning, EncoderUse(1, 0)

    def _reference_latents(self, scope: Scope, reference: Reference, width: int, height: int,
                           cache: EncodingCache | None) -> tuple[torch.Tensor, EncoderUse]:
        """[1, latent channels, height / scale, width / scale]: the reference resized to the output's size,
        encoded, scaled as the UNet takes latents."""
        encoder = f"{self.encoder_identity('vae')}/{width}x{height}"
        found = cache.get(scope, reference.digest, encoder) if cache is not None else None
        if found is not None:
            return found, EncoderUse(0, 1)
        self.vae_encoder_calls += 1
        pixels = self.text.image_processor.preprocess(reference.image, height=height, width=width)
        vae = self.text.vae
        posterior = vae.encode(pixels.to(self.device, vae.dtype)).latent_dist
        latents = (posterior.mode() * vae.config.scaling_factor).clone()
        if cache is not None:
            cache.put(scope, reference.digest, encoder, latents)
        return latents, EncoderUse(1, 0)


def _image_to_image(text: Any) -> Any:
    """The image-to-image pipeline over `text`'s components (the same modules, not copies)."""
    return StableDiffusionImg2ImgPipeline(**{name: text.components[name] for name in (
        "vae", "text_encoder", "tokenizer", "unet", "scheduler", "safety_checker", "feature_extractor")},
        requires_safety_checker=False)


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
