"""Deterministic randomly initialised vision-language models, written with their processors as Hugging Face directories.

The text side of each is the same recipe and tokenizer as the text families in `synthetic`, with the model's
image tokens added after the trained vocabulary; the vision side is a tiny tower of the kind the real model
uses. Everything is seeded, so two machines build byte-identical directories, and nothing is fetched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForImageTextToText,
    CLIPVisionConfig,
    Gemma3Config,
    LlavaConfig,
    LlavaProcessor,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    ProcessorMixin,
    Qwen2VLConfig,
    SiglipVisionConfig,
)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.gemma3.processing_gemma3 import Gemma3Processor
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig, Qwen2VLVisionConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from node.engine.qwen2_vl_processor import Qwen2VLImageProcessorOnly
from node.engine.synthetic import FAMILIES, SEED, SIZES, Size, UnknownArchitectureError, build_tokenizer

MERGE = 2
"""Qwen2-VL merges each 2x2 block of patches into one token (the real models' value)."""


@dataclass(frozen=True, slots=True)
class VisionSize:
    """The vision tower's shapes; the text model beside it takes the `synthetic.SIZES` entry of the same name."""

    image: int
    """Side in pixels of the square Llava and Gemma3 images; Qwen2-VL keeps the aspect ratio and resizes
    to between `image**2` and `(2 * image)**2` pixels."""
    patch: int
    hidden: int
    layers: int
    heads: int
    intermediate: int


VISION_SIZES: dict[str, VisionSize] = {
    # A 224-pixel image is 256 Llava tokens, 64 to 256 Qwen2-VL tokens and 64 Gemma3 tokens beside the
    # default text model.
    "default": VisionSize(image=224, patch=14, hidden=512, layers=4, heads=8, intermediate=1376),
    # For tests: a 56-pixel image is 16 Llava tokens, 4 to 16 Qwen2-VL tokens and 4 Gemma3 tokens.
    "small": VisionSize(image=56, patch=14, hidden=64, layers=2, heads=4, intermediate=128),
}


@dataclass(frozen=True, slots=True)
class VisionLanguageRecipe:
    """How one vision-language family is built: its image tokens, its config and its processor."""

    image_tokens: tuple[tuple[str, str], ...]
    """(tokenizer attribute, token) pairs, added after the trained vocabulary in this order."""
    image_part: str
    """What the chat template writes for an image part; the processor expands it into the image's tokens."""
    config: Callable[[Size, VisionSize, PreTrainedTokenizerFast], PretrainedConfig]
    processor: Callable[[VisionSize, PreTrainedTokenizerFast, PretrainedConfig, str], ProcessorMixin]
    zero_initialised: tuple[str, ...] = ()
    """Parameters the family's init sets to zero, drawn at random here instead: a zero projection would
    make every image the same to the text model."""


def chat_template(image_part: str, types: tuple[str, ...] = ("image", "image_url")) -> str:
    """The text models' ChatML template, where a message's content may also be an OpenAI list of parts; `image_part`
    is written for a part of one of `types` (an audio model's parts are audio ones)."""
    return (
        "{% for message in messages %}"
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}"
        f"{{% elif part['type'] in {types!r} %}}{image_part}"
        "{% else %}{{ raise_exception('unsupported content part type: ' ~ part['type']) }}{% endif %}"
        "{% endfor %}{% endif %}"
        "<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def _with_vocabulary(config: PretrainedConfig, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """A text family's config widened to the tokenizer with its image tokens."""
    config.vocab_size = len(tokenizer)
    return config


def _tower(vision: VisionSize) -> dict[str, Any]:
    """The settings a CLIP and a SigLIP vision config share."""
    return {"hidden_size": vision.hidden, "intermediate_size": vision.intermediate, "num_hidden_layers": vision.layers,
            "num_attention_heads": vision.heads, "image_size": vision.image, "patch_size": vision.patch}


def _llava(size: Size, vision: VisionSize, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """A CLIP tower before the Llama text model, features from its second-to-last layer without CLS (Llava 1.5)."""
    return LlavaConfig(
        vision_config=CLIPVisionConfig(**_tower(vision)),
        text_config=_with_vocabulary(FAMILIES["llama"](size), tokenizer),
        image_token_index=tokenizer.image_token_id, image_seq_length=(vision.image // vision.patch) ** 2,
        vision_feature_select_strategy="default", vision_feature_layer=-2)


def _llava_processor(vision: VisionSize, tokenizer: PreTrainedTokenizerFast, config: PretrainedConfig,
                     template: str) -> ProcessorMixin:
    square = {"height": vision.image, "width": vision.image}
    images = CLIPImageProcessorPil(size={"shortest_edge": vision.image}, crop_size=square)
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=vision.patch,
                          vision_feature_select_strategy=config.vision_feature_select_strategy,
                          num_additional_image_tokens=1, chat_template=template)


def _mrope_section(head_dim: int) -> list[int]:
    """Rotary frequencies per (time, height, width), in the real models' 16:24:24 ratio."""
    half = head_dim // 2
    time = half // 4
    height = (half - time) // 2
    return [time, height, half - time - height]


def _qwen2_vl(size: Size, vision: VisionSize, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """Qwen2-VL's own tower (2D rotary patches, 2x2 merge) before its multimodal-rotary text model."""
    head_dim = size.hidden // size.heads
    return Qwen2VLConfig(
        text_config=Qwen2VLTextConfig(
            vocab_size=len(tokenizer), hidden_size=size.hidden, intermediate_size=size.intermediate,
            num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
            max_position_embeddings=size.context, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                             "mrope_section": _mrope_section(head_dim)}),
        vision_config=Qwen2VLVisionConfig(depth=vision.layers, embed_dim=vision.hidden, hidden_size=size.hidden,
                                          num_heads=vision.heads, patch_size=vision.patch,
                                          spatial_merge_size=MERGE),
        image_token_id=tokenizer.image_token_id, video_token_id=tokenizer.video_token_id,
        vision_start_token_id=tokenizer.vision_start_token_id, vision_end_token_id=tokenizer.vision_end_token_id)


def _qwen2_vl_processor(vision: VisionSize, tokenizer: PreTrainedTokenizerFast, config: PretrainedConfig,
                        template: str) -> ProcessorMixin:
    pixels = {"shortest_edge": vision.image**2, "longest_edge": (2 * vision.image) ** 2}
    images = Qwen2VLImageProcessorPil(size=pixels, patch_size=vision.patch, merge_size=MERGE)
    return Qwen2VLImageProcessorOnly(image_processor=images, tokenizer=tokenizer, chat_template=template)


def _gemma3(size: Size, vision: VisionSize, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """A SigLIP tower whose patches are average-pooled 2x2 into soft tokens before the Gemma3 text model."""
    return Gemma3Config(
        vision_config=SiglipVisionConfig(**_tower(vision)),
        text_config=_with_vocabulary(FAMILIES["gemma3"](size), tokenizer),
        mm_tokens_per_image=(vision.image // vision.patch // 2) ** 2, boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id, image_token_index=tokenizer.image_token_id)


def _gemma3_processor(vision: VisionSize, tokenizer: PreTrainedTokenizerFast, config: PretrainedConfig,
                      template: str) -> ProcessorMixin:
    images = Gemma3ImageProcessorPil(size={"height": vision.image, "width": vision.image})
    return Gemma3Processor(image_processor=images, tokenizer=tokenizer, chat_template=template,
                           image_seq_length=config.mm_tokens_per_image)


VISION_LANGUAGE: dict[str, VisionLanguageRecipe] = {
    "vlm-llava": VisionLanguageRecipe(
        image_tokens=(("image_token", "<image>"),), image_part="<image>", config=_llava,
        processor=_llava_processor),
    "vlm-qwen2": VisionLanguageRecipe(
        image_tokens=(("vision_start_token", "<|vision_start|>"), ("vision_end_token", "<|vision_end|>"),
                      ("image_token", "<|image_pad|>"), ("video_token", "<|video_pad|>")),
        image_part="<|vision_start|><|image_pad|><|vision_end|>", config=_qwen2_vl, processor=_qwen2_vl_processor),
    "vlm-gemma3": VisionLanguageRecipe(
        image_tokens=(("boi_token", "<start_of_image>"), ("eoi_token", "<end_of_image>"),
                      ("image_token", "<image_soft_token>")),
        image_part="<start_of_image>", config=_gemma3, processor=_gemma3_processor,
        zero_initialised=("model.multi_modal_projector.mm_input_projection_weight",)),
}


def init_vision_language_model(arch: str, out_dir: Path, size: str) -> Path:
    """Write a seeded random vision-language model, its tokenizer and its processor to out_dir (must not exist)."""
    if size not in VISION_SIZES:
        raise UnknownArchitectureError(
            f"size {size!r} has no vision-language recipe; choose one of: {', '.join(sorted(VISION_SIZES))}")
    recipe, text_size, vision = VISION_LANGUAGE[arch], SIZES[size], VISION_SIZES[size]
    template = chat_template(recipe.image_part)
    tokenizer = build_tokenizer(text_size.context, dict(recipe.image_tokens), template)
    config = recipe.config(text_size, vision, tokenizer)
    torch.manual_seed(SEED)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name in recipe.zero_initialised:
            model.get_parameter(name).normal_(std=config.initializer_range)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=False)
    model.save_pretrained(out_dir)
    recipe.processor(vision, tokenizer, config, template).save_pretrained(out_dir)
    return out_dir
