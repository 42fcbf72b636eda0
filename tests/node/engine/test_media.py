"""Image attachments through the engine (`node/engine/media.py`): prefill chunks on input embeddings against the
models' own forward, reuse on against reuse off over conversations that keep, swap, drop and repeat an image, and
the encoder calls each turn makes, for the Llava, Qwen2-VL and Gemma3 shapes."""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from cache.arena import Scope
from node.engine.loader import LoadedModel, load_model
from node.engine.media import MEDIA_KEY, SequenceMedia
from node.engine.runner import GenerationRequest, ModelRunner, StepPlan
from node.engine.sampling import SamplingParams
from node.engine.synthetic import init_model
from node.engine.synthetic_vlm import VISION_LANGUAGE
from tests.node.engine.media_pairs import MediaPair, chunked_logits, keep_swap_drop_repeat

ARCHS = sorted(VISION_LANGUAGE)
AGREEMENT = 1e-5
"""Largest |difference| of logits from the model's own forward, relative to the largest |logit|."""


def picture(seed: int) -> Image.Image:
    """A random picture; seeds from 100 give a larger one (another grid for Qwen2-VL)."""
    width, height = (70, 50) if seed < 100 else (112, 84)
    pixels = torch.rand(height, width, 3, generator=torch.Generator().manual_seed(seed))
    return Image.fromarray((pixels * 255).to(torch.uint8).numpy())


def data_url(seed: int) -> str:
    out = io.BytesIO()
    picture(seed).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def user(text: str, *images: int) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        *({"type": "image_url", "image_url": {"url": data_url(seed)}}
                                          for seed in images)]}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    root = tmp_path_factory.mktemp("vlm")
    return {arch: load_model(arch, init_model(arch, root / arch, size="small"), device="cpu") for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_chunks_on_input_embeddings_give_the_models_own_forward(models: dict[str, LoadedModel], arch: str) -> None:
    """Prefill chunks that start or end inside the image (outside it for Gemma3, whose image attends both ways),
    and a decode step after them, against the model's forward over the processor's whole input."""
    loaded = models[arch]
    family = loaded.media
    assert family is not None and loaded.media_blocker is None
    model, image = loaded.model, picture(1)
    whole = AutoProcessor.from_pretrained(loaded.path)(text=["look " + family.part + " now"], images=[image],
                                                      return_tensors="pt")
    with torch.inference_mode():
        reference = model(**whole).logits[0].float()
    ids = whole["input_ids"][0].tolist()
    expanded = family.expand(image)
    offset = ids.index(family.placeholder) - expanded.start
    assert ids[offset:offset + len(expanded.ids)] == expanded.ids
    media = family.prompt_media(ids, [(offset, expanded, bytes(32))])
    item = media.items[0]
    held = SequenceMedia(media, {0: family.encode(expanded.inputs)})
    scale = float(reference.abs().max())
    for cuts in ([len(ids)], [item.start + 1, len(ids)], [2, item.end - 1, len(ids)]):
        cuts = media.chunk_stops(cuts)
        if media.whole:
            assert all(media.inside(cut) is None for cut in cuts)
        logits, cache = chunked_logits(model, held, ids, cuts)
        assert float((logits - reference).abs().max()) <= AGREEMENT * scale
    following = int(reference[-1].argmax())
    more = {name: value for name, value in whole.items() if name != "attention_mask"}
    for name in ("input_ids", "token_type_ids", "mm_token_type_ids"):
        if name in more:
            value = following if name == "input_ids" else 0
            more[name] = torch.cat([more[name], torch.full((1, 1), value, dtype=more[name].dtype)], dim=1)
    with torch.inference_mode():
        expected = model(**more).logits[0, -1].float()
        step = model(input_ids=torch.tensor([[following]]), position_ids=torch.tensor([[len(ids) + media.delta]]),
                     cache=cache, use_cache=True).logits[0, -1].float()
    assert float((step - expected).abs().max()) <= AGREEMENT * scale
    assert arch != "vlm-qwen2" or media.delta < 0  # its image takes fewer positions than tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_reuse_on_equals_reuse_off_and_each_image_is_encoded_once(models: dict[str, LoadedModel], arch: str) -> None:
    """A conversation about one image: greedy replies equal with reuse on and off at every turn; the image is
    encoded once (later turns restore past it, or find its encoding), a swapped image is encoded, a dropped one
    is not, and the same image sent again in a new message is found in the caller's encoding cache."""
    pair = MediaPair(models[arch])
    if arch == "vlm-qwen2":
        models[arch].model.model.rope_deltas = None  # the model's own forward (the test above) sets it
    second = keep_swap_drop_repeat(pair, user, "describe this", "and more?")
    assert second.cached_read_tokens > 0
    if arch == "vlm-qwen2":
        assert models[arch].model.model.rope_deltas is None  # positions passed per request, never left on the model


def test_another_caller_encodes_the_same_image_again(models: dict[str, LoadedModel]) -> None:
    pair = MediaPair(models["vlm-llava"])
    mine = pair.turn([user("what is it", 3)], caller="a")
    again = pair.turn([user("what is it", 3)], caller="a")
    theirs = pair.turn([user("what is it", 3)], caller="b")
    assert (mine.attachments_encoded, again.attachments_encoded, theirs.attachments_encoded) == (1, 0, 1)
    assert (again.cached_read_tokens, theirs.cached_read_tokens) == (again.prompt_tokens - 1, 0)
    cache = pair.on.reuse.encodings
    assert cache is not None
    pair.on.drop_caller("b")
    assert cache.counts(Scope("b", "vlm-llava")).entries == 0
    assert cache.counts(Scope("a", "vlm-llava")).entries == 1


def test_a_request_accepted_before_its_caller_shreds_keeps_no_encoding(models: dict[str, LoadedModel]) -> None:
    """Queued when its caller shreds (`DELETE /v1/cache`): its image is encoded for it and kept nowhere; the
    caller's next request encodes it again and keeps it."""
    pair = MediaPair(models["vlm-llava"])
    scope, prompt = Scope("a", "vlm-llava"), pair.prompt([user("what is it", 3)])
    reuse = pair.on.reuse
    assert reuse.encodings is not None and reuse.prefix_cache is not None

    def request() -> GenerationRequest:  # accepted now
        return GenerationRequest(scope, prompt.ids, SamplingParams(max_tokens=6, temperature=0.0),
                                 boundaries=prompt.rendered.boundaries, media=prompt.media, stamp=reuse.shreds.now)

    waiting = request()
    pair.on.shred(scope)
    late = pair.on.generate(waiting, lambda _: None, lambda: False)
    assert (late.attachments_encoded, late.cached_write_tokens, late.retained) == (1, 0, False)
    assert (reuse.encodings.counts(scope).entries, reuse.prefix_cache.holdings(scope).tokens) == (0, 0)
    again = pair.on.generate(request(), lambda _: None, lambda: False)
    assert (again.attachments_encoded, again.cached_write_tokens, again.output_ids) == (
        1, again.prompt_tokens, late.output_ids)
    assert reuse.encodings.counts(scope).entries == 1


def test_prompts_with_different_images_diverge_at_the_image(models: dict[str, LoadedModel]) -> None:
    """The prefix index keys an image's placeholders by the image: equal up to the image, different inside it,
    equal for the same image; the ids the model reads are the placeholders either way."""
    pair = MediaPair(models["vlm-llava"])
    one, two, same = (pair.prompt([user("see", seed)]) for seed in (4, 5, 4))
    assert one.media is not None and two.media is not None and same.media is not None
    item = one.media.items[0]
    assert one.ids == two.ids  # the same placeholders
    assert one.media.keys[:item.start] == two.media.keys[:item.start]
    assert all(a != b and a >= MEDIA_KEY for a, b in zip(one.media.keys[item.start:item.end],
                                                         two.media.keys[item.start:item.end], strict=True))
    assert one.media.keys == same.media.keys
    assert one.media.keys[item.end:] == one.ids[item.end:]


def test_gemma3_holds_no_resume_point_or_chunk_end_inside_an_image(models: dict[str, LoadedModel]) -> None:
    pair = MediaPair(models["vlm-gemma3"])
    media = pair.prompt([user("see", 6)]).media
    assert media is not None and media.whole
    item = media.items[0]
    middle = (item.start + item.end) // 2
    assert media.resume_limit(middle) == item.start and media.resume_limit(item.end) == item.end
    assert media.chunk_stops([1, middle, item.end + 2]) == [1, item.end, item.end + 2]
    llava = MediaPair(models["vlm-llava"]).prompt([user("see", 6)]).media
    assert llava is not None and not llava.whole  # its image attends causally: it may be cut anywhere
    assert llava.resume_limit(llava.items[0].start + 1) == llava.items[0].start + 1


@pytest.mark.parametrize("arch", ["vlm-qwen2", "vlm-gemma3"])
def test_sequences_with_images_decode_as_one_batch_as_they_would_alone(models: dict[str, LoadedModel],
                                                                        arch: str) -> None:
    """Two requests with different images (Qwen2-VL: different position deltas) step as one batched forward and
    reply what each replies alone."""
    pair = MediaPair(models[arch])
    prompts = [pair.prompt([user("tell me", seed)]) for seed in (7, 108)]
    deltas = {prompt.media.delta for prompt in prompts if prompt.media is not None}
    assert len(deltas) == (2 if arch == "vlm-qwen2" else 1)
    requests = [GenerationRequest(Scope("a", arch), prompt.ids, SamplingParams(max_tokens=6, temperature=0.0),
                                  media=prompt.media) for prompt in prompts]
    alone = [pair.off.generate(request, lambda _: None, lambda: False).output_ids for request in requests]
    runner = ModelRunner(models[arch], None)
    seqs = [runner.start(request, lambda _: None, lambda: False, lane=lane) for lane, request in enumerate(requests)]
    done: dict[int, list[int]] = {}
    while len(done) < 2:
        live = tuple(seq for seq in seqs if seq.lane not in done)
        outcome = runner.run(StepPlan(prefill=live, decode=live))
        assert not outcome.failed
        done.update({seq.lane: result.output_ids for seq, result in outcome.finished})
    assert runner.batched_steps > 0
    assert [done[0], done[1]] == alone
