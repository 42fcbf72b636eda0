"""What the native kernels are handed: weights in their panel layout, an output head with its int8 screen, rows
of keys and values by address, and a Llama-shaped decoder as the C structs `tz_decoder_forward` reads.

These are the memory layouts Python and `kernels/cpu_kernels.cpp` share; the calls that read them are in
`cpu_kernels.py`. Kept apart so a reader of a layout sees every field the C side dereferences in one place,
and the calls' module holds only what each call checks and passes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

ALIGNMENT = 64
"""Bytes: packed panels are read with aligned vector loads."""

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


@dataclass(frozen=True, slots=True)
class RowsAt:
    """Rows of keys and values by address, one entry per sequence: float32 buffers whose heads (`kv_heads`) lie
    `strides[r]` floats apart, each head's rows of head_dim floats contiguous, `lengths[r]` rows from
    `keys[r]`/`values[r]`. What the native decode attention reads, without a tensor view per sequence."""

    keys: list[int]
    values: list[int]
    strides: list[int]
    lengths: list[int]
    kv_heads: int


PANEL_COLUMNS = 32
"""Output columns per panel of a packed weight (the kernels' `NR`)."""


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A linear layer's weight in the kernels' panel layout: `[ceil(out / 32), in, 32]`, 64-byte aligned."""

    data: torch.Tensor
    in_features: int
    out_features: int
    bias: torch.Tensor | None

    def columns(self, start: int, width: int) -> PackedWeight | None:
        """Output columns `[start, start + width)` as a weight of their own: a view of these panels, no copy (a
        fused projection's parts, such as q, k and v); None unless `start` begins a panel."""
        if start % PANEL_COLUMNS or not 0 <= start < start + width <= self.out_features:
            return None
        end = min(self.data.numel(), -(-(start + width) // PANEL_COLUMNS) * PANEL_COLUMNS * self.in_features)
        bias = None if self.bias is None else self.bias[start:start + width]
        return PackedWeight(self.data[start * self.in_features:end], self.in_features, width, bias)


@dataclass(frozen=True, slots=True)
class Int8Head:
    """An output head's rows as int8 codes over a per-row scale, for a library's int8 matrix product with the
    rows of x coded alike (`CpuKernels.head_argmax` from `LIBRARY_SCREEN_ROWS` rows)."""

    codes: torch.Tensor
    """int8 `[in, out]`, a transposed view of `[out, in]` (`torch._int_mm`'s right operand)."""
    scale: torch.Tensor
    """float32 `[out]`: row n's weights are about `scale[n] * codes[:, n]`."""
    norm: torch.Tensor
    """float64 `[out]`: each row's Euclidean norm."""
    residual: torch.Tensor
    """float64 `[out]`: the norm of each row's difference from its codes times its scale."""


@dataclass(frozen=True, slots=True)
class PackedHead:
    """An output head `[out, in]`: its float32 panels, and a screen of int8 codes over a per-row scale that
    finds the greedy token at a quarter of the head's memory traffic (`CpuKernels.head_argmax`)."""

    weight: PackedWeight
    codes: torch.Tensor
    scale: torch.Tensor
    slack: torch.Tensor
    """float64 `[out]`: times |x|, how far a row's screened logit can be from its float32 one."""
    bias_slack: torch.Tensor | None
    rows: Int8Head | None = None
    """The screen for a library's int8 product, where this CPU computes one exactly (`int8_products_exact`)."""

    @property
    def in_features(self) -> int:
        return self.weight.in_features

    @property
    def out_features(self) -> int:
        return self.weight.out_features


def decode_work_floats(heads: int, kv_heads: int, head_dim: int, longest: int) -> int:
    """Scratch floats the native decode attention needs (`tz_decode_attention`): for a chunk of up to
    `max(32, heads // kv_heads)` queries, their scaled and gathered copies, outputs and scores."""
    return max(32, heads // kv_heads) * (3 * head_dim + 4 + longest)


def aligned_empty(count: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised `[count]` tensor whose first element lies on an `ALIGNMENT` boundary."""
    size = torch.empty(0, dtype=dtype).element_size()
    spare = ALIGNMENT // size
    raw = torch.empty(count + spare, dtype=dtype)
    offset = (-raw.data_ptr() % ALIGNMENT) // size
    return raw[offset:offset + count]


class _Linear(ctypes.Structure):
    _fields_ = [("packed", _ptr), ("in_features", _i64), ("out_features", _i64), ("bias", _ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("qkv", _Linear), ("output", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("new_keys", _ptr), ("new_values", _ptr),
                ("new_head_stride", _i64), ("segments", ctypes.c_int), ("seg_keys", _ptr), ("seg_values", _ptr),
                ("seg_head_stride", _ptr), ("seg_len", _ptr)]


class _Model(ctypes.Structure):
    _fields_ = [("embedding", _ptr), ("hidden", _i64), ("intermediate", _i64), ("heads", _i64), ("kv_heads", _i64),
                ("head_dim", _i64), ("eps", _f32), ("scale", _f32), ("final_norm", _ptr), ("final_eps", _f32),
                ("after", _ptr)]


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One Llama-shaped decoder layer, packed."""

    input_norm: torch.Tensor
    qkv: PackedWeight
    """q, k and v projections as one `[(heads + 2 * kv_heads) * head_dim, hidden]` weight."""
    output: PackedWeight
    post_norm: torch.Tensor
    gate_up: PackedWeight
    """Gate and up projections as one `[2 * intermediate, hidden]` weight."""
    down: PackedWeight


class NativeLayer:
    """A layer's description for `tz_decoder_forward`; its cache part is set before every forward."""

    def __init__(self, struct: _Layer, head_dim: int) -> None:
        self._struct = struct
        self._head_dim = head_dim
        self._room = 0
        self._keys = self._values = (ctypes.c_void_p * 0)()
        self._strides = self._lengths = (ctypes.c_int64 * 0)()

    def set_cache(self, new_keys: torch.Tensor, new_values: torch.Tensor,
                  segments: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Where the forward writes this layer's new K/V (`[1, kv_heads, T, head_dim]` views with contiguous rows)
        and the pieces `[1, kv_heads, n, head_dim]` it attends over, in position order, the new rows included."""
        assert new_keys.stride() == new_values.stride() and new_keys.stride(2) == self._head_dim
        count, struct = len(segments), self._struct
        if count > self._room:  # the arrays the struct points at, kept and refilled from one forward to the next
            self._room = max(count, 2 * self._room, 4)
            self._keys, self._values = (ctypes.c_void_p * self._room)(), (ctypes.c_void_p * self._room)()
            self._strides, self._lengths = (ctypes.c_int64 * self._room)(), (ctypes.c_int64 * self._room)()
            struct.seg_keys, struct.seg_values = ctypes.addressof(self._keys), ctypes.addressof(self._values)
            struct.seg_head_stride, struct.seg_len = ctypes.addressof(self._strides), ctypes.addressof(self._lengths)
        for index, (keys, values) in enumerate(segments):
            stride = keys.stride()
            assert stride == values.stride() and stride[3] == 1 and stride[2] == self._head_dim
            self._keys[index], self._values[index] = keys.data_ptr(), values.data_ptr()
            self._strides[index], self._lengths[index] = stride[1], keys.shape[2]
        struct.new_keys, struct.new_values = new_keys.data_ptr(), new_values.data_ptr()
        struct.new_head_stride = new_keys.stride(1)
        struct.segments = count


class NativeDecoder:
    """A Llama-shaped model's packed layers as `tz_decoder_forward` reads them."""

    def __init__(self, embedding: torch.Tensor, layers: Sequence[LayerWeights], heads: int, kv_heads: int,
                 head_dim: int, eps: float, scale: float, final_norm: torch.Tensor, final_eps: float,
                 head: PackedHead) -> None:
        assert embedding.is_contiguous() and embedding.dtype == torch.float32
        self._weights = (embedding, tuple(layers), final_norm, head)  # what the structs point into
        self.vocab = embedding.shape[0]
        self.structs = (_Layer * len(layers))()
        for struct, layer in zip(self.structs, layers, strict=True):
            struct.input_norm, struct.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            for name in ("qkv", "output", "gate_up", "down"):
                weight: PackedWeight = getattr(layer, name)
                setattr(struct, name, _Linear(weight.data.data_ptr(), weight.in_features, weight.out_features,
                                              None if weight.bias is None else weight.bias.data_ptr()))
        self.layers = [NativeLayer(struct, head_dim) for struct in self.structs]
        first = layers[0]
        self.model = _Model(embedding.data_ptr(), first.qkv.in_features, first.down.in_features, heads, kv_heads,
                            head_dim, eps, scale, final_norm.data_ptr(), final_eps, start_address(head))
        self.hidden, self.intermediate = first.qkv.in_features, first.down.in_features
        self.qkv_width = first.qkv.out_features

    def work_floats(self, tokens: int) -> int:
        """Scratch `tz_decoder_forward` needs for a chunk of `tokens`."""
        q_width = self.model.heads * self.model.head_dim
        return tokens * (2 * self.hidden + self.qkv_width + q_width + 3 * self.intermediate)


def start_address(weight: PackedWeight | PackedHead | None) -> int | None:
    """Where a kernel reading `weight` starts reading (a head's screen reads its codes first)."""
    if weight is None:
        return None
    return (weight.codes if isinstance(weight, PackedHead) else weight.data).data_ptr()
