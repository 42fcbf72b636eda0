"""A model proves at load time that resuming from stored state gives what one pass gives.

Every layer kind has an adapter, but a model can still get continuation wrong inside its own code (the
Mamba-1 torch path restarted every multi-token forward from a zero state; Zamba's mixer still does).
Rather than trust a list, the node runs the model once through the real store-and-restore path and
compares with one full pass; a model that fails is served without reuse, with the difference logged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cache.adapters import ModelStateAdapter
from node.engine.prediction import Prediction

PREFIX, SUFFIX = 48, 16
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
"""Largest allowed |difference| relative to the largest |logit|. Float32 noise is about 1e-6; half
precision runs different kernels for different shapes (2 to 8% measured), so it is checked at 0.15."""
HALF_TOLERANCE = 0.15


@dataclass(frozen=True, slots=True)
class ReuseCheck:
    passed: bool
    relative_difference: float


Forward = Callable[[list[int], int, Any], Prediction]
"""(ids, start position, working cache) -> the last position's prediction: the engine's forward."""


@torch.inference_mode()
def check_reuse(forward: Forward, state: ModelStateAdapter, vocab_size: int, dtype: torch.dtype) -> ReuseCheck:
    """Prefill a prefix, store it and its snapshot, restore into a fresh cache, run a multi-token suffix,
    all through the forward that will serve."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(min(100, vocab_size - 1), vocab_size, (PREFIX + SUFFIX,), generator=generator).tolist()
    whole = state.working_cache(PREFIX + SUFFIX)
    expected = forward(ids, 0, whole).logits()
    work = state.working_cache(PREFIX + SUFFIX)
    forward(ids[:PREFIX], 0, work)
    spans, snapshot = [(state.extract(work, 0, PREFIX), PREFIX)], state.snapshot(work)
    resumed = state.working_cache(PREFIX + SUFFIX)
    state.restore(resumed, spans, snapshot=snapshot, position=PREFIX)
    got = forward(ids[PREFIX:], PREFIX, resumed).logits()
    difference = float((got - expected).abs().max() / expected.abs().max().clamp(min=1.0))
    return ReuseCheck(difference <= TOLERANCE.get(dtype, HALF_TOLERANCE), difference)
