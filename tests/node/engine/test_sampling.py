"""Sampling (`node/engine/sampling.py`): top-k keeps the k most likely tokens, whatever the seed draws."""

from __future__ import annotations

import torch

from node.engine.prediction import Logits
from node.engine.sampling import Sampler, SamplingParams


def test_top_k_draws_only_among_the_k_most_likely_tokens() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9, -1.0, 2.8])
    drawn = {Sampler(SamplingParams(1, temperature=2.0, seed=seed, top_k=2)).next_token(Logits(logits))
             for seed in range(200)}
    assert drawn == {1, 3}
    everything = {Sampler(SamplingParams(1, temperature=2.0, seed=seed)).next_token(Logits(logits))
                  for seed in range(200)}
    assert len(everything) > 2  # without top_k the high temperature reaches further: the test can fail
    assert {Sampler(SamplingParams(1, temperature=2.0, seed=seed, top_k=1)).next_token(Logits(logits))
            for seed in range(50)} == {1}
