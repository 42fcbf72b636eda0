"""Choosing the next token: greedy, or temperature with top-k and nucleus (top-p) sampling under a seed; logit biases
and presence/frequency penalties (over the tokens generated so far, as OpenAI defines them) adjust the
logits first."""

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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_k: int = 0
    """Sample among the `top_k` most likely tokens only (ties at the k-th kept); 0: no such limit."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def argmax_only(self) -> bool:
        """Whether the next token is the argmax of the model's own logits (`Prediction.greedy`)."""
        return self.greedy and not self.adjusts_logits


class Sampler:
    """One per request: a seeded request draws the same tokens every time, whatever else runs."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._generator: torch.Generator | None = None
        """Made on the first draw: greedy decoding needs none."""

    def _logits(self, prediction: Prediction, generated: list[int]) -> torch.Tensor:
        logits = prediction.logits().float().cpu()
        params = self.params
        if not params.adjusts_logits:
            return logits
        logits = logits.clone()
        if params.logit_bias:
            ids = torch.tensor([token for token, _ in params.logit_bias])
            logits.index_add_(0, ids, torch.tensor([bias for _, bias in params.logit_bias]))
        if generated and (params.presence_penalty or params.frequency_penalty):
            counts = torch.bincount(torch.tensor(generated), minlength=logits.shape[0])[:logits.shape[0]].float()
            logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
        return logits

    def next_token(self, prediction: Prediction, generated: list[int] | None = None) -> int:
        """The token after the last position of `prediction`'s forward; `generated`: this reply's tokens so far
        (what the penalties count)."""
        if self.params.argmax_only:
            return prediction.greedy()
        logits = self._logits(prediction, generated or [])
        if self.params.greedy:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / self.params.temperature, dim=-1)
        if 0 < self.params.top_k < probs.shape[0]:
            kth = torch.topk(probs, self.params.top_k).values[-1]
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
            probs /= probs.sum()
        if self.params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            outside = before >= self.params.top_p
            outside[0] = False  # the most likely token is always in the nucleus: top_p 0 keeps it alone
            sorted_probs[outside] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if self._generator is None:
            self._generator = torch.Generator()
            if self.params.seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(self.params.seed)
        return int(torch.multinomial(probs, 1, generator=self._generator))
