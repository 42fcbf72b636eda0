"""Transposed linear layers compute what nn.Linear computes, and leave tied weights alone."""

from __future__ import annotations

import torch
from torch import nn

from node.engine.cpu_layout import TransposedLinear, transpose_linear_weights


def test_transposed_linear_matches_linear() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(16, 24)
    x = torch.randn(2, 5, 16)
    assert torch.allclose(TransposedLinear(linear)(x), linear(x), atol=1e-6, rtol=0)


def test_tied_weights_are_not_swapped() -> None:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10, bias=False))
    model[2].weight = model[0].weight
    assert transpose_linear_weights(model) == 1
    assert isinstance(model[1], TransposedLinear) and isinstance(model[2], nn.Linear)
