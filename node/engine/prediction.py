"""What a forward leaves for choosing the next token: the last position's scores, computed on demand.

Greedy decoding needs only the index of the largest logit. A forward that can find it without computing
every logit exactly (the CPU decoder screens its output head at half the memory traffic) says so by
overriding `greedy`; everything else computes the logits and takes their argmax.
"""

from __future__ import annotations

import torch


class Prediction:
    """The next-token scores at the last position of a forward."""

    def logits(self) -> torch.Tensor:
        """All logits `[vocab]`, float32."""
        raise NotImplementedError

    def greedy(self) -> int:
        """The index of the largest logit, the first one on a tie (as `torch.argmax`)."""
        return int(torch.argmax(self.logits()))


class Logits(Prediction):
    """Logits a forward has already computed."""

    def __init__(self, values: torch.Tensor) -> None:
        self._values = values

    def logits(self) -> torch.Tensor:
        return self._values
