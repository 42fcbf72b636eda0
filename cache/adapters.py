"""Adapters between the engine's working cache and stored state, one per state kind.

Stored state comes in two forms. A *span* holds what full-attention layers computed for a run of tokens
(K/V per layer) and serves any resume position it covers. A *snapshot* holds, for every other layer, what
it needs to resume at exactly one position: the sliding window's K/V tail, or the conv and recurrent
states. Each adapter knows how its kind is cut, restored and split, and nothing else does.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from cache.lanes import BufferPool
from cache.state_spec import (
    ComponentSpec,
    FullAttentionSpec,
    LayerStateSpec,
    RecurrentSpec,
    SlidingWindowSpec,
)
from cache.working_cache import GrowableKVLayer


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


@dataclass(frozen=True, slots=True)
class KVPiece:
    """Keys and values, `[batch=1, kv_heads, tokens, head_dim]` each, owned (not views of working memory)."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return _nbytes(self.keys) + _nbytes(self.values)


@dataclass(frozen=True, slots=True)
class RecurrentPiece:
    """Conv and recurrent states of one layer at one position, per state index, in their own dtype."""

    conv: tuple[torch.Tensor | None, ...]
    recurrent: tuple[torch.Tensor | None, ...]

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in self.conv) + sum(_nbytes(t) for t in self.recurrent)


Piece = KVPiece | RecurrentPiece


class FullAttentionAdapter:
    def span(self, layer: Any, start: int, end: int, borrow: bool = False) -> KVPiece:
        """The layer's K/V of tokens `[start, end)`: copies, or with `borrow` views of the working buffers (valid
        until the next working cache takes them)."""
        if isinstance(layer, GrowableKVLayer):
            layer.materialize()
        keys, values = layer.keys[:, :, start:end], layer.values[:, :, start:end]
        return KVPiece(keys, values) if borrow else KVPiece(keys.clone(), values.clone())

    def restore_span(self, layer: Any, piece: KVPiece, start: int, end: int) -> None:
        """Pooled working layers take the stored piece by reference (stored pieces never change); the copy
        happens only if the forward needs the history as one tensor."""
        keys, values = piece.keys[:, :, start:end], piece.values[:, :, start:end]
        if isinstance(layer, GrowableKVLayer):
            layer.defer(keys, values)
        else:
            layer.update(keys, values)

    def snapshot(self, layer: Any) -> None:
        return None

    def restore_snapshot(self, layer: Any, piece: Piece | None, position: int) -> None:
        return None


class SlidingWindowAdapter:
    def snapshot(self, layer: Any) -> KVPiece:
        """The window tail transformers keeps: the last `window - 1` tokens (fewer early in the prompt)."""
        return KVPiece(layer.keys.clone(), layer.values.clone())

    def restore_snapshot(self, layer: Any, piece: Piece | None, position: int) -> None:
        assert isinstance(piece, KVPiece)
        # The layer replaces (never writes into) these tensors when it grows, so no copy is needed.
        layer.lazy_initialization(piece.keys, piece.values)
        layer.keys, layer.values = piece.keys, piece.values
        layer.cumulative_length = position  # masks and positions read the absolute length from here


class RecurrentAdapter:
    def snapshot(self, layer: Any) -> RecurrentPiece:
        # Cloned: the model updates these tensors in place on the next forward.
        states = range(layer.number_of_states)
        return RecurrentPiece(
            conv=tuple(layer.conv_states[i].clone() if layer.is_conv_states_initialized[i] else None
                       for i in states),
            recurrent=tuple(layer.recurrent_states[i].clone() if layer.is_recurrent_states_initialized[i] else None
                            for i in states))

    def restore_snapshot(self, layer: Any, piece: Piece | None, position: int) -> None:
        assert isinstance(piece, RecurrentPiece)
        for index, (conv, recurrent) in enumerate(zip(piece.conv, piece.recurrent, strict=True)):
            if conv is not None:
                layer.conv_states[index] = conv.clone()
                layer.conv_kernel_size[index] = conv.shape[-1]
                layer.is_conv_states_initialized[index] = True
                layer.device, layer.dtype = conv.device, conv.dtype
            if recurrent is not None:
                layer.recurrent_states[index] = recurrent.clone()
                layer.is_recurrent_states_initialized[index] = True
            layer.has_previous_state[index] = conv is not None or recurrent is not None


COMPONENT_ADAPTERS: dict[type, Any] = {
    FullAttentionSpec: FullAttentionAdapter(),
    SlidingWindowSpec: SlidingWindowAdapter(),
    RecurrentSpec: RecurrentAdapter(),
}

SpanState = tuple[KVPiece | None, ...]
"""What one span holds: per decoder layer, the full-attention K/V of its tokens, or None."""

Snapshot = tuple[tuple[Piece | None, ...], ...]
"""What resuming at one position needs besides spans: per layer, per state component."""


def copy_snapshot(snapshot: Snapshot) -> Snapshot:
    """Clones of every tensor of `snapshot`: a state another owner keeps (and seals or zeroes), for a second one."""
    def clone(piece: Piece | None) -> Piece | None:
        if isinstance(piece, KVPiece):
            return KVPiece(piece.keys.clone(), piece.values.clone())
        if isinstance(piece, RecurrentPiece):
            return RecurrentPiece(tuple(None if t is None else t.clone() for t in piece.conv),
                                  tuple(None if t is None else t.clone() for t in piece.recurrent))
        return piece

    return tuple(tuple(clone(piece) for piece in pieces) for pieces in snapshot)


def state_bytes(state: SpanState | Snapshot | None) -> int:
    if state is None:
        return 0
    total = 0
    for part in state:
        if isinstance(part, tuple):
            total += sum(piece.nbytes for piece in part if piece is not None)
        elif part is not None:
            total += part.nbytes
    return total


class ModelStateAdapter:
    """Cuts and restores the whole stack of one model, layer by layer, through the per-kind adapters, and builds
    its working caches over the buffers it is given (the lanes', `cache/lanes.py`, own them)."""

    def __init__(self, specs: Sequence[LayerStateSpec], config: Any) -> None:
        self.specs = tuple(specs)
        self._config = config
        self._components: tuple[tuple[tuple[ComponentSpec, Any], ...], ...] = tuple(
            tuple((component, COMPONENT_ADAPTERS[type(component)]) for component in spec.components)
            for spec in specs)
        self._full = FullAttentionAdapter()
        self.needs_snapshots = any(spec.needs_snapshot for spec in specs)
        # Building a DynamicCache walks the config (on every request's time to first token; RESULTS.md, 2026-11-30);
        # one of only plain full-attention layers and known fields is copied instead.
        template = DynamicCache(config=config)
        copyable = (set(vars(template)) <= {"layers", "layer_class_to_replicate", "offloading"}
                    and all(type(layer) is DynamicLayer for layer in template.layers))
        self._template = template if copyable else None
        self._unwritten: list[tuple[Any, tuple[torch.Tensor, torch.Tensor]]] = []

    def working_cache(self, capacity: int, pool: BufferPool | None = None) -> DynamicCache:
        """A fresh working cache sized for `capacity` tokens (prompt plus the reply's budget): its plain
        full-attention layers write into `pool`'s buffers (a lane's, `Lanes.new_cache`), or without one into
        buffers of their own; layers of other kinds are transformers' own."""
        if self._template is not None:
            cache = copy.copy(self._template)
            cache.layers = [GrowableKVLayer(capacity, pool, slot) for slot in range(len(self._template.layers))]
            return cache
        cache = DynamicCache(config=self._config)
        cache.layers = [GrowableKVLayer(capacity, pool, slot) if type(layer) is DynamicLayer else layer
                        for slot, layer in enumerate(cache.layers)]
        return cache

    def extract(self, cache: DynamicCache, start: int, end: int, borrow: bool = False) -> SpanState:
        return tuple(self._full.span(layer, start, end, borrow) if spec.keeps_spans else None
                     for spec, layer in zip(self.specs, cache.layers, strict=True))

    def own(self, state: SpanState) -> SpanState:
        """Copies of a borrowed span's views."""
        return tuple(None if p is None else KVPiece(p.keys.clone(), p.values.clone()) for p in state)

    def snapshot(self, cache: DynamicCache) -> Snapshot:
        return tuple(tuple(adapter.snapshot(layer) for _, adapter in components)
                     for components, layer in zip(self._components, cache.layers, strict=True))

    def restore_span(self, cache: DynamicCache, state: SpanState, start: int, take: int) -> None:
        """Append tokens `[start, take)` of a stored span to the cache's full-attention layers, by reference."""
        for layer, piece in zip(cache.layers, state, strict=True):
            if piece is not None:
                self._full.restore_span(layer, piece, start, take)

    def span_rows(self, cache: DynamicCache, index: int, keys: torch.Tensor, values: torch.Tensor, count: int,
                  spare: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for `count` new K/V rows of layer `index` after its current length, to be written by the caller
        (`keys`/`values` give heads, head dim, dtype and device), and the cache row they start at: views of the
        working buffers, extended by up to `spare` rows the buffers hold past them (the layer's length grows by
        `count` only); for a layer without buffers, fresh tensors of `count` rows that `finish_rows` appends."""
        layer = cache.layers[index]
        key_shape = (1, keys.shape[1], count, keys.shape[3])
        value_shape = (1, values.shape[1], count, values.shape[3])
        if isinstance(layer, GrowableKVLayer):
            # Shapes only: one row, expanded without copying.
            key_like = keys.new_empty((1, keys.shape[1], 1, keys.shape[3])).expand(key_shape)
            value_like = values.new_empty((1, values.shape[1], 1, values.shape[3])).expand(value_shape)
            return layer.write_rows(key_like, value_like, spare)
        rows = keys.new_empty(key_shape), values.new_empty(value_shape)
        self._unwritten.append((layer, rows))
        return rows[0], rows[1], 0

    def finish_rows(self, cache: DynamicCache, count: int) -> None:
        """Append the rows `span_rows` handed out as fresh tensors, then zero those."""
        for layer, (keys, values) in self._unwritten:
            layer.update(keys, values)
            keys.zero_()
            values.zero_()
        self._unwritten.clear()

    def restore_snapshot(self, cache: DynamicCache, snapshot: Snapshot, position: int) -> None:
        """Restore the state at `position` of the layers that need one."""
        for components, layer, pieces in zip(self._components, cache.layers, snapshot, strict=True):
            for (_, adapter), piece in zip(components, pieces, strict=True):
                adapter.restore_snapshot(layer, piece, position)

    def restore(self, cache: DynamicCache, spans: Sequence[tuple[SpanState, int]], skip: int = 0,
                snapshot: Snapshot | None = None, position: int = 0) -> None:
        """Fill a new working cache to resume at `position` from plaintext state.

        `spans` cover `[0, position)` in order, (state, tokens to take); the first `skip` tokens are already
        in the cache (an adopted prefix). `snapshot` is the state at `position` for the layers that need one.
        """
        offset = 0
        for state, take in spans:
            start = max(0, skip - offset)
            if start < take:
                self.restore_span(cache, state, start, take)
            offset += take
        if snapshot is not None:
            self.restore_snapshot(cache, snapshot, position)

    def materialize(self, cache: DynamicCache) -> None:
        """Copy restored pieces held by reference into the working buffers (see `GrowableKVLayer.defer`)."""
        for layer in cache.layers:
            if isinstance(layer, GrowableKVLayer):
                layer.materialize()

    def split(self, state: SpanState, offset: int) -> tuple[SpanState, SpanState]:
        """Cut a span; clones, so that evicting one half frees its bytes (views would keep all alive)."""
        left = tuple(None if p is None else KVPiece(p.keys[:, :, :offset].clone(), p.values[:, :, :offset].clone())
                     for p in state)
        right = tuple(None if p is None else KVPiece(p.keys[:, :, offset:].clone(), p.values[:, :, offset:].clone())
                      for p in state)
        return left, right
