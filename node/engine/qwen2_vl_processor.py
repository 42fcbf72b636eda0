"""Qwen2-VL's processor for images only, the one transformers can build without torchvision.

transformers (5.x) builds every video processor on torchvision, and `Qwen2VLProcessor` requires one: without
torchvision neither its constructor nor `AutoProcessor.from_pretrained` can make it, even for images. The node
serves images and text, so this subclass leaves the video processor out and is otherwise Qwen2-VL's processor:
the same image processor, placeholder expansion (`grid_t * grid_h * grid_w / merge_size**2` tokens per image)
and token ids. Importing this module registers it with `AutoProcessor` under its own name, which
`save_pretrained` writes into `processor_config.json`.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoProcessor, Qwen2VLConfig, Qwen2VLProcessor


class Qwen2VLImageProcessorOnly(Qwen2VLProcessor):
    """`Qwen2VLProcessor` whose only sub-processors are the image processor and the tokenizer."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                 **kwargs: Any) -> None:
        # ProcessorMixin takes the sub-processors from this signature, so the video processor is not one.
        super().__init__(image_processor, tokenizer, video_processor=None, chat_template=chat_template, **kwargs)


AutoProcessor.register(Qwen2VLConfig, Qwen2VLImageProcessorOnly, exist_ok=True)
