"""Adapters between the engine's working cache and stored spans, one per state kind.

The engine works on a transformers `DynamicCache`; the arena stores per-span pieces. Each adapter knows
how its kind of layer is cut into pieces, restored from them and split, and nothing else does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from cache.state_spec import FullAttentionSpec, LayerStateSpec, UnsupportedLayerKindError


class BufferPool:
    """Working buffers kept between requests, so each request does not page-fault fresh memory.

    Requests run one at a time per model; a buffer handed out is valid until the next `take` of the same
    slot, and still holds what the last request wrote, which lets the next request of the same scope
    continue from it (see `GrowableKVLayer.adopt`). Stored spans are always clones, never views of these.
    """

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}

    def take(self, slot: int, like: torch.Tensor, shape: tuple[int, ...], keep: int = 0) -> torch.Tensor:
        """A tensor of `shape` (seq on dim 2) with `like`'s dtype and device, backed by slot's buffer.

        The first `keep` tokens of the slot's previous contents survive a reallocation.
        """
        held = self._buffers.get(slot)
        if (held is None or held.dtype != like.dtype or held.device != like.device
                or held.shape[:2] + held.shape[3:] != shape[:2] + shape[3:] or held.shape[2] < shape[2]):
            fresh = like.new_empty(shape)
            if keep and held is not None:
                fresh[:, :, :keep].copy_(held[:, :, :keep])
            held = self._buffers[slot] = fresh
        return held[:, :, :shape[2]]

    def held(self, slot: int) -> torch.Tensor | None:
        return self._buffers.get(slot)


class GrowableKVLayer(DynamicLayer):
    """A full-attention layer writing into a preallocated buffer instead of `torch.cat` on every step.

    `keys`/`values` are views `[batch, kv_heads, seq, head_dim]` of buffers holding `capacity` tokens, so
    transformers' length and mask logic see the ordinary shapes. Growing past the capacity doubles it.
    """

    def __init__(self, capacity: int, pool: BufferPool | None = None, slot: int = 0) -> None:
        super().__init__()
        self.capacity = max(1, capacity)
        self._pool = pool
        self._slot = slot
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if self._key_buffer is None or end > self._key_buffer.shape[-2]:
            self._grow(key_states, value_states, max(end, 2 * self.capacity if self._key_buffer is not None
                                                     else self.capacity), start)
        assert self._key_buffer is not None and self._value_buffer is not None
        self._key_buffer[:, :, start:end].copy_(key_states)
        self._value_buffer[:, :, start:end].copy_(value_states)
        self.keys = self._key_buffer[:, :, :end]
        self.values = self._value_buffer[:, :, :end]
        return self.keys, self.values

    def adopt(self, length: int) -> bool:
        """Start from the first `length` tokens the pool's buffers hold from the previous request.

        The caller vouches that those tokens are this request's prefix in the same scope.
        """
        assert self._pool is not None and not self.is_initialized
        held_keys, held_values = self._pool.held(2 * self._slot), self._pool.held(2 * self._slot + 1)
        if held_keys is None or held_values is None or held_keys.shape[2] < length:
            return False
        self.device, self.is_initialized = held_keys.device, True
        self.keys, self.values = held_keys[:, :, :length], held_values[:, :, :length]
        self._grow(held_keys, held_values, max(self.capacity, length), filled=length)
        return True

    def _grow(self, keys: torch.Tensor, values: torch.Tensor, capacity: int, filled: int) -> None:
        batch, heads, _, head_dim = keys.shape
        key_shape, value_shape = (batch, heads, capacity, head_dim), (batch, heads, capacity, values.shape[-1])
        if self._pool is not None:
            key_buffer = self._pool.take(2 * self._slot, keys, key_shape, keep=filled)
            value_buffer = self._pool.take(2 * self._slot + 1, values, value_shape, keep=filled)
        else:
            key_buffer, value_buffer = keys.new_empty(key_shape), values.new_empty(value_shape)
            if filled:
                assert self.keys is not None and self.values is not None
                key_buffer[:, :, :filled].copy_(self.keys)
                value_buffer[:, :, :filled].copy_(self.values)
        self._key_buffer, self._value_buffer, self.capacity = key_buffer, value_buffer, capacity
        self.keys, self.values = key_buffer[:, :, :filled], value_buffer[:, :, :filled]


@dataclass(frozen=True, slots=True)
class KVPiece:
    """Keys and values of one span, `[batch=1, kv_heads, span_len, head_dim]` each, owned (not views)."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


class FullAttentionAdapter:
    def working_layer(self, capacity: int, pool: BufferPool, slot: int) -> DynamicLayer:
        return GrowableKVLayer(capacity, pool, slot)

    def extract(self, layer: Any, start: int, end: int) -> KVPiece:
        return KVPiece(layer.keys[:, :, start:end].clone(), layer.values[:, :, start:end].clone())

    def adopt(self, layer: Any, length: int) -> bool:
        return bool(layer.adopt(length))

    def restore(self, layer: Any, piece: KVPiece, start: int, end: int) -> None:
        layer.update(piece.keys[:, :, start:end], piece.values[:, :, start:end])

    def split(self, piece: KVPiece, offset: int) -> tuple[KVPiece, KVPiece]:
        # Clones, so that evicting one half frees its bytes: views would keep the whole storage alive.
        return (KVPiece(piece.keys[:, :, :offset].clone(), piece.values[:, :, :offset].clone()),
                KVPiece(piece.keys[:, :, offset:].clone(), piece.values[:, :, offset:].clone()))


ADAPTERS: dict[type, FullAttentionAdapter] = {FullAttentionSpec: FullAttentionAdapter()}

SpanState = tuple[KVPiece, ...]
"""The stored state of one span: one piece per decoder layer."""


class ModelStateAdapter:
    """Cuts and restores the whole stack of one model, layer by layer, through the per-kind adapters."""

    def __init__(self, specs: Sequence[LayerStateSpec], config: Any) -> None:
        missing = sorted({type(spec).__name__ for spec in specs if type(spec) not in ADAPTERS})
        if missing:
            raise UnsupportedLayerKindError(f"no state adapter for {', '.join(missing)}")
        self.specs = tuple(specs)
        self._config = config
        self._adapters = tuple(ADAPTERS[type(spec)] for spec in specs)
        self._pool = BufferPool()

    def new_cache(self, capacity: int, adopt: int = 0) -> tuple[DynamicCache, int]:
        """A working cache sized for `capacity` tokens (prompt plus the reply's budget).

        Its buffers are reused by the next `new_cache`: one working cache is live at a time. With `adopt`,
        the cache starts from that many tokens left in the buffers by the previous working cache, when they
        are still there; returns the cache and the tokens it starts with (`adopt` or 0).
        """
        cache = DynamicCache(config=self._config)
        cache.layers = [adapter.working_layer(capacity, self._pool, slot)
                        for slot, adapter in enumerate(self._adapters)]
        if adopt and all(adapter.adopt(layer, adopt)
                         for adapter, layer in zip(self._adapters, cache.layers, strict=True)):
            return cache, adopt
        if adopt:
            cache.layers = [adapter.working_layer(capacity, self._pool, slot)
                            for slot, adapter in enumerate(self._adapters)]
        return cache, 0

    def extract(self, cache: DynamicCache, start: int, end: int) -> SpanState:
        return tuple(adapter.extract(layer, start, end)
                     for adapter, layer in zip(self._adapters, cache.layers, strict=True))

    def restore(self, cache: DynamicCache, spans: Sequence[tuple[SpanState, int]], skip: int = 0) -> None:
        """Append stored spans, in order, after the first `skip` tokens; `take` tokens of each span.

        `skip` is what the working cache already holds (an adopted prefix).
        """
        position = 0
        for state, take in spans:
            start = max(0, skip - position)
            if start < take:
                for adapter, layer, piece in zip(self._adapters, cache.layers, state, strict=True):
                    adapter.restore(layer, piece, start, take)
            position += take

    def split(self, state: SpanState, offset: int) -> tuple[SpanState, SpanState]:
        halves = [adapter.split(piece, offset) for adapter, piece in zip(self._adapters, state, strict=True)]
        return tuple(left for left, _ in halves), tuple(right for _, right in halves)

    @staticmethod
    def nbytes(state: SpanState) -> int:
        return sum(piece.nbytes for piece in state)
