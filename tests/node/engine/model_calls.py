"""Forward calls shared by the scan tests: explicit positions and `cache=`, as the engine calls models."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache


@torch.inference_mode()
def forward(model: Any, ids: list[int], start: int, cache: DynamicCache | None) -> torch.Tensor:
    """Logits `[len, vocab]` for `ids` at positions `[start, start + len)`."""
    out = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(start, start + len(ids)).unsqueeze(0),
                cache=cache, use_cache=cache is not None)
    return out.logits[0].float()


def prefill(model: Any, ids: list[int], start: int, cache: DynamicCache, chunks: list[int]) -> torch.Tensor:
    """Run `ids` in chunks of the given lengths; logits `[len, vocab]` of all of them."""
    assert sum(chunks) == len(ids)
    logits, offset = [], 0
    for length in chunks:
        logits.append(forward(model, ids[offset:offset + length], start + offset, cache))
        offset += length
    return torch.cat(logits)
