"""Choosing the next token: greedy, or temperature with nucleus (top-p) sampling under a seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from node.engine.prediction import Prediction


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """One per request: a seeded request draws the same tokens every time, whatever else runs."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._generator: torch.Generator | None = None
        """Made on the first draw: greedy decoding needs none."""

    def next_token(self, prediction: Prediction) -> int:
        """The token after the last position of `prediction`'s forward."""
        if self.params.greedy:
            return prediction.greedy()
        probs = torch.softmax(prediction.logits().float().cpu() / self.params.temperature, dim=-1)
        if self.params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            sorted_probs[before >= self.params.top_p] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if self._generator is None:
            self._generator = torch.Generator()
            if self.params.seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(self.params.seed)
        return int(torch.multinomial(probs, 1, generator=self._generator))
