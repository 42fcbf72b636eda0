"""Float comparisons stated relative to the scale of what is compared.

Float32 kernels of different machines (AVX2 or AVX-512, another BLAS blocking) sum in another order, and
the rounding that leaves grows with the magnitude of the values: an absolute bound that holds on one CPU
fails on another for logits of 8 that differ by 1e-4. So every bound here is a fraction of the largest
|value| of the reference, with a floor of 1 so that values near zero are not held to their own tiny scale.
"""

from __future__ import annotations

import torch


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max(1, max |want|)."""
    want = want.to(got.dtype) if want.dtype != got.dtype else want
    return float((got - want).abs().max()) / max(1.0, float(want.abs().max()))
