"""The image pipeline's reuse: conditionings and reference latents encoded once per scope and content, the same
PNG bytes with reuse on and off (sealed or not), another scope encoding again, and denoising for every image."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from cache.encodings import EncodingCache
from cache.scope import Scope
from cache.sealing import Sealer
from node.media.pipeline import EncoderUse, ImagePipeline, ImageRequest, Reference, Render, RenderCancelled
from tests.node.media.images import png

ALICE = Scope(caller="alice", model="tiny")
BOB = Scope(caller="bob", model="tiny")
STEPS = 3


def load(diffusion_dir: Path, encodings: EncodingCache | None) -> ImagePipeline:
    torch.set_num_threads(1)
    return ImagePipeline.load("tiny", diffusion_dir, torch.device("cpu"), torch.float32, encodings)


@pytest.fixture(scope="module")
def plain(diffusion_dir: Path) -> ImagePipeline:
    """Reuse off: every render encodes."""
    return load(diffusion_dir, None)


def reference() -> Reference:
    data = png()
    return Reference(Image.open(io.BytesIO(data)).convert("RGB"), hashlib.sha256(data).digest())


def render(scope: Scope, seed: int, n: int = 1, edit: bool = False, prompt: str = "a red cat") -> Render:
    return Render(scope, ImageRequest("tiny", prompt, n, 64, 64, STEPS, seed, reference() if edit else None))


@pytest.mark.parametrize("sealed", [False, True])
def test_renders_of_one_prompt_encode_it_once_and_give_the_bytes_reuse_off_gives(
        diffusion_dir: Path, plain: ImagePipeline, sealed: bool) -> None:
    cache = EncodingCache(Sealer(threads=1) if sealed else None)
    reusing = load(diffusion_dir, cache)
    outputs = [reusing.render(render(ALICE, seed)) for seed in (1, 2, 3)]
    assert [out.conditionings for out in outputs] == [EncoderUse(1, 0), EncoderUse(0, 1), EncoderUse(0, 1)]
    assert reusing.text_encoder_calls == 1
    assert outputs[0].encode_s > 0 and outputs[1].encode_s == 0.0
    assert [out.images for out in outputs] == [plain.render(render(ALICE, seed)).images for seed in (1, 2, 3)]
    assert len({out.images for out in outputs}) == 3  # the seed varies the image
    assert outputs[0].images[0].startswith(b"\x89PNG\r\n\x1a\n")
    assert Image.open(io.BytesIO(outputs[0].images[0])).size == (64, 64)
    assert cache.counts(ALICE).encoded == 1 and cache.counts(ALICE).reused == 2


def test_edits_of_one_reference_encode_its_latents_once_and_give_the_bytes_reuse_off_gives(
        diffusion_dir: Path, plain: ImagePipeline) -> None:
    reusing = load(diffusion_dir, EncodingCache())
    outputs = [reusing.render(render(ALICE, seed, edit=True)) for seed in (5, 6)]
    assert [out.references for out in outputs] == [EncoderUse(1, 0), EncoderUse(0, 1)]
    assert reusing.vae_encoder_calls == 1
    assert [out.images for out in outputs] == [plain.render(render(ALICE, seed, edit=True)).images
                                               for seed in (5, 6)]
    # Latents are taken at the output's size: another size encodes the reference again.
    other = reusing.render(Render(ALICE, ImageRequest("tiny", "a red cat", 1, 32, 32, STEPS, 5, reference())))
    assert other.references == EncoderUse(1, 0)
    assert Image.open(io.BytesIO(other.images[0])).size == (32, 32)


def test_another_scope_with_the_same_prompt_and_image_encodes_again(diffusion_dir: Path) -> None:
    reusing = load(diffusion_dir, EncodingCache())
    reusing.render(render(ALICE, 1, edit=True))
    theirs = reusing.render(render(BOB, 1, edit=True))
    assert (theirs.conditionings, theirs.references) == (EncoderUse(1, 0), EncoderUse(1, 0))
    assert (reusing.text_encoder_calls, reusing.vae_encoder_calls) == (2, 2)


def test_image_i_of_a_request_is_the_image_of_seed_plus_i_whatever_n(plain: ImagePipeline) -> None:
    three = plain.render(render(ALICE, 10, n=3))
    assert three.conditionings == EncoderUse(1, 0)  # one encoding serves the request's images
    assert three.images[2] == plain.render(render(ALICE, 12)).images[0]


def test_a_render_that_keeps_nothing_stores_nothing(diffusion_dir: Path) -> None:
    cache = EncodingCache()
    reusing = load(diffusion_dir, cache)
    for _ in range(2):
        job = Render(ALICE, ImageRequest("tiny", "a red cat", 1, 64, 64, STEPS, 1), reuse=False)
        assert reusing.render(job).conditionings == EncoderUse(1, 0)
    assert cache.describe()["entries"] == 0


def test_a_cancelled_render_stops_at_its_next_denoising_step(plain: ImagePipeline) -> None:
    with pytest.raises(RenderCancelled):
        plain.render(render(ALICE, 1), cancelled=lambda: True)


def test_a_render_names_no_prompt_in_its_repr() -> None:
    assert "cat" not in repr(render(ALICE, 1, edit=True))
    assert "Reference(size=(48, 40))" == repr(reference())
