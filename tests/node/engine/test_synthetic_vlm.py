"""Generated vision-language models load with their processors, expand an image into the tokens their config
implies, generate deterministically and are written byte-identically."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, PretrainedConfig, ProcessorMixin

from node.cli import VISION_LANGUAGE_FAMILIES, build_parser
from node.engine.synthetic import UnknownArchitectureError, build_tokenizer, init_model
from node.engine.synthetic_vlm import VISION_LANGUAGE, chat_template

WIDTH, HEIGHT = 84, 56
"""Not square, so Qwen2-VL's tokens follow the aspect ratio while Llava and Gemma3 resize to their square."""
Conversation = Any
"""transformers annotates conversations as `list[dict[str, str]]`, narrower than the content lists it renders."""
CHAT: Conversation = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}]


def picture(shade: int) -> Image.Image:
    image = Image.new("RGB", (WIDTH, HEIGHT))
    image.putdata([((x * 7 + shade) % 256, (y * 5) % 256, (x * y) % 256) for y in range(HEIGHT) for x in range(WIDTH)])
    return image


def qwen2_vl_tokens(config: PretrainedConfig) -> int:
    """The image is resized to multiples of patch * merge (its pixel count is within the processor's bounds),
    cut into patches, and each merge x merge block of patches is one token."""
    patch, merge = config.vision_config.patch_size, config.vision_config.spatial_merge_size
    height, width = (round(side / (patch * merge)) * patch * merge for side in (HEIGHT, WIDTH))
    return (height // patch) * (width // patch) // merge**2


IMAGE_TOKENS = {
    # One token per patch of the square image; the CLS feature is dropped ("default" strategy).
    "vlm-llava": lambda config: (config.vision_config.image_size // config.vision_config.patch_size) ** 2,
    "vlm-qwen2": qwen2_vl_tokens,
    # The patches are average-pooled to a fixed number of soft tokens.
    "vlm-gemma3": lambda config: config.mm_tokens_per_image,
}
EXACT_IMAGE_TOKENS = {"vlm-llava": 16, "vlm-qwen2": 6, "vlm-gemma3": 4}


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlm")
    return {arch: init_model(arch, root / arch, size="small") for arch in VISION_LANGUAGE}


def inputs_for(processor: ProcessorMixin, image: Image.Image) -> dict[str, torch.Tensor]:
    text = processor.apply_chat_template(CHAT, add_generation_prompt=True)
    return dict(processor(text=text, images=[image], return_tensors="pt"))


def greedy(model_dir: Path) -> tuple[list[int], list[int]]:
    """(prompt ids, 3 greedy tokens) from a fresh load of the model and its processor."""
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    inputs = inputs_for(AutoProcessor.from_pretrained(model_dir), picture(0))
    prompt = inputs["input_ids"][0].tolist()
    output = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    return prompt, output[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", sorted(VISION_LANGUAGE))
def test_the_processor_expands_the_image_into_the_tokens_the_config_implies(
        arch: str, model_dirs: dict[str, Path]) -> None:
    config = AutoModelForImageTextToText.from_pretrained(model_dirs[arch]).config
    prompt, generated = greedy(model_dirs[arch])
    assert prompt.count(config.image_token_id) == IMAGE_TOKENS[arch](config) == EXACT_IMAGE_TOKENS[arch]
    assert len(generated) == 3
    assert greedy(model_dirs[arch]) == (prompt, generated)


def test_the_placeholders_sit_between_the_families_image_markers(model_dirs: dict[str, Path]) -> None:
    texts = {}
    for arch in ("vlm-qwen2", "vlm-gemma3"):
        processor = AutoProcessor.from_pretrained(model_dirs[arch])
        texts[arch] = processor.tokenizer.decode(inputs_for(processor, picture(0))["input_ids"][0])
    assert texts["vlm-qwen2"] == ("<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 6 + "<|vision_end|>"
                                  "What is in the picture?<|im_end|>\n<|im_start|>assistant\n")
    assert texts["vlm-gemma3"] == ("<|im_start|>user\n\n\n<start_of_image>" + "<image_soft_token>" * 4
                                   + "<end_of_image>\n\nWhat is in the picture?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("arch", sorted(VISION_LANGUAGE))
def test_the_image_reaches_the_text_model(arch: str, model_dirs: dict[str, Path]) -> None:
    """Gemma3's init zeroes its image projection, which made every image the same to the text model (a
    difference of exactly 0.0): reuse tests could not tell one image from another."""
    model = AutoModelForImageTextToText.from_pretrained(model_dirs[arch])
    processor = AutoProcessor.from_pretrained(model_dirs[arch])
    with torch.no_grad():
        first, second = (model(**inputs_for(processor, picture(shade))).logits[0, -1] for shade in (0, 128))
    assert (first - second).abs().max().item() > 1e-2


@pytest.mark.parametrize("arch", sorted(VISION_LANGUAGE))
def test_two_builds_are_byte_identical(arch: str, model_dirs: dict[str, Path], tmp_path: Path) -> None:
    again = init_model(arch, tmp_path / arch, size="small")
    assert digest(again) == digest(model_dirs[arch])
    assert set(digest(again)) == {"chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
                                  "processor_config.json", "tokenizer.json", "tokenizer_config.json"}


def test_the_chat_template_renders_openai_content_parts() -> None:
    tokenizer = build_tokenizer(4096, {"image_token": "<image>"}, chat_template("<image>"))
    parts = [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]
    chat: Conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    assert rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nLook: <image><|im_end|>\n"
    assert tokenizer.convert_tokens_to_ids("<image>") == 32000 == len(tokenizer) - 1
    audio: Conversation = [{"role": "user", "content": [{"type": "input_audio"}]}]
    with pytest.raises(Exception, match="unsupported content part type: input_audio"):
        tokenizer.apply_chat_template(audio, tokenize=False)


def test_the_text_models_tokenizer_files_are_unchanged(tmp_path: Path) -> None:
    """`extra_special_tokens=None` writes `"extra_special_tokens": []`, which changed every text model's files."""
    build_tokenizer(4096).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == {
        "backend": "tokenizers", "eos_token": "<|im_end|>", "model_max_length": 4096, "pad_token": "<|endoftext|>",
        "tokenizer_class": "TokenizersBackend"}


def test_the_command_line_offers_every_vision_language_model_and_refuses_the_1b_size(tmp_path: Path) -> None:
    assert VISION_LANGUAGE_FAMILIES == tuple(VISION_LANGUAGE)
    assert build_parser().parse_args(["models", "init", "--arch", "vlm-qwen2", "--size", "small", "out"]).arch == (
        "vlm-qwen2")
    with pytest.raises(UnknownArchitectureError, match="size '1b' has no vision-language recipe; choose one of: "
                                                       "default, small"):
        init_model("vlm-llava", tmp_path / "big", size="1b")
    assert not (tmp_path / "big").exists()
