"""Linear layers laid out for the CPU matrix kernel: weights stored transposed, `[in, out]`, contiguous.

`nn.Linear` keeps `[out, in]` and multiplies by its transpose; on one CPU thread the few-token matmuls of
a resumed prefill run faster against a contiguous `[in, out]` weight, whose rows the kernel streams in order
(RESULTS.md, 2026-11-30). The swap replaces each layer's weight rather than copying it. Tied weights (an output
head sharing the embedding) are left alone.

Inputs of two rows or more (a batched decode step, a prefill chunk) run on a second copy of the weight that
oneDNN packed at load, through torch's own `mkldnn._linear_pointwise`, which is faster for them than either
layout of the plain weight; for one row the transposed weight is the faster (`scripts/native_ab.py`). The copy
doubles the memory of the linear layers.

Where the node's CPU decoder runs (the `native-cpu` forward), it hands each layer a view of its own packed panels
(`native`), and inputs of up to `NATIVE_ROWS` rows run on those through the native GEMM, which beats both torch
arms there; longer ones stay with oneDNN, which wins from about 64 rows (`scripts/native_ab.py`, RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from node.engine.cpu_kernels import CpuKernels
from node.engine.kernel_operands import PackedWeight

PACKED = torch.backends.mkldnn.is_available()
"""Whether linear layers also keep a oneDNN-packed copy of their weight, for inputs of two rows or more."""
PACK_ROWS_HINT = 32
"""The rows oneDNN lays the packed weight out for; it serves any number."""
NATIVE_ROWS = 48
"""Most input rows a layer with `native` panels multiplies on them: the rows of a batched decode step of up to 48
sequences, or a short chunk (where the native GEMM led oneDNN's in the A/B; from 64 rows it trailed)."""


@dataclass(frozen=True, slots=True)
class NativeLinear:
    """A layer's weight as panels of the CPU decoder's packed copy (`PackedWeight.columns`), and the kernels that
    multiply by them."""

    kernels: CpuKernels
    weight: PackedWeight


class TransposedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = linear.bias
        self.packed: torch.Tensor | None = None
        self.native: NativeLinear | None = None
        """Set by the CPU decoder (`CpuDecoder.lend_panels`): up to NATIVE_ROWS rows run on its panels."""
        self.repack()

    def repack(self) -> None:
        """Pack the weight for oneDNN again (after it was changed in place: the packed copy does not follow)."""
        weight = self.weight.detach()
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)
                       if PACKED and weight.dtype == torch.float32 and weight.device.type == "cpu" else None)

    @property
    def weight(self) -> torch.Tensor:
        """The `[out, in]` view models expect to read (dtype, device, shape)."""
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x`: `[..., in]` -> `[..., out]`."""
        rows = x.reshape(-1, self.in_features)
        native = self.native
        if native is not None and 0 < rows.shape[0] <= NATIVE_ROWS and rows.dtype == torch.float32:
            rows = rows if rows.stride(1) == 1 else rows.contiguous()
            out = rows.new_empty(rows.shape[0], self.out_features)
            native.kernels.gemm(rows, native.weight, out)
            return out.reshape(*x.shape[:-1], self.out_features)
        if self.packed is not None and rows.shape[0] > 1:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
            return out.reshape(*x.shape[:-1], self.out_features)
        out = rows @ self.weight_t
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)



def transpose_linear_weights(model: nn.Module) -> int:
    """Swap every untied `nn.Linear` of `model` for a `TransposedLinear`; returns how many were swapped."""
    counts: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        counts[id(parameter)] = counts.get(id(parameter), 0) + 1
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and counts[id(child.weight)] == 1:
                setattr(module, name, TransposedLinear(child))
                swapped += 1
    return swapped
