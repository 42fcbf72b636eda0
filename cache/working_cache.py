"""The engine's working cache for full-attention layers: preallocated, reused buffers.

transformers' `DynamicLayer` grows by `torch.cat` on every forward, copying the whole history each decode
step; on this CPU a fresh multi-megabyte allocation also page-faults. These layers write in place into
buffers that a lane's pool keeps between requests (`cache/lanes.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicLayer

if TYPE_CHECKING:
    from cache.lanes import BufferPool  # which imports this module


class GrowableKVLayer(DynamicLayer):
    """A full-attention layer writing into a preallocated buffer instead of `torch.cat` on every step.

    `keys`/`values` are views `[batch, kv_heads, seq, head_dim]` of buffers holding `capacity` tokens, so
    transformers' length and mask logic see the ordinary shapes. Growing past the capacity doubles it.

    Restored K/V can be appended by reference (`defer`): their positions are reserved but the copy into the
    buffer waits until something reads the buffer as one tensor (`update`, `materialize`). A resumed forward
    that reads the pieces where they lie (`segments`) thus starts without copying the whole prefix, which
    is a memcpy of tens of megabytes on its time to first token.
    """

    opening: Callable[[], None] | None = None
    """Set while sealed rows of this layer are still being opened into its buffers (`cache/opening.py`):
    called, once, by `wait_rows`, before anything reads the rows: `keys` and `values` call it; `segments()`
    hands out views without reading them, and its reader calls `wait_rows` first."""

    def __init__(self, capacity: int, pool: BufferPool | None = None, slot: int = 0) -> None:
        super().__init__()
        self.capacity = max(1, capacity)
        self._pool = pool
        self._slot = slot
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        """(position, keys, values) appended by reference, in position order; immutable stored pieces."""

    _rows_plain = False
    """Whether the buffers are laid out as `append_at` requires (found when they are set)."""
    _ahead = 0
    """Rows written in place past the views by a batched step (`append_at`, `advance`); the views catch up when
    read."""

    @property  # type: ignore[override]
    def keys(self) -> torch.Tensor | None:
        self.wait_rows()
        if self._ahead:
            self._catch_up()
        return self._keys

    @keys.setter
    def keys(self, keys: torch.Tensor | None) -> None:
        self._keys, self._ahead = keys, 0

    @property  # type: ignore[override]
    def values(self) -> torch.Tensor | None:
        self.wait_rows()
        if self._ahead:
            self._catch_up()
        return self._values

    @values.setter
    def values(self, values: torch.Tensor | None) -> None:
        self._values, self._ahead = values, 0

    def append_at(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The key and value buffers and the row where one new row goes, for a batched step that writes it in
        place (`batch_forward.RowsCache` through the native kernels) and then calls `advance`: None (the step
        calls `update`) unless the layer is set up, has nothing opening or held by reference, has room, and its
        buffers are float32 `[1, kv_heads, rows, head_dim]` with rows of head_dim contiguous, keys and values
        strided alike."""
        keys, buffer = self._keys, self._key_buffer
        if self.opening is not None or self._pending or keys is None or buffer is None or not self._rows_plain:
            return None
        row = keys.shape[-2] + self._ahead
        if row >= buffer.shape[-2]:
            return None
        assert self._value_buffer is not None
        return buffer, self._value_buffer, row

    def advance(self) -> None:
        """The row `append_at` named is written: one more stored row."""
        self._ahead += 1

    def _catch_up(self) -> None:
        assert self._keys is not None and self._key_buffer is not None and self._value_buffer is not None
        end = self._keys.shape[-2] + self._ahead
        self.keys, self.values = self._key_buffer[:, :, :end], self._value_buffer[:, :, :end]

    def wait_rows(self) -> None:
        """Return once every stored row of this layer is in place (at once unless rows are still opening)."""
        if self.opening is not None:
            opening, self.opening = self.opening, None
            opening()

    def get_seq_length(self) -> int:
        """The length is known while rows are still opening: it does not wait for them."""
        keys = self._keys
        if not self.is_initialized or keys is None or keys.dim() < 2:
            return 0
        return int(keys.shape[-2]) + self._ahead

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self.wait_rows()  # rows still opening may reach past the stored ones, where these are written
        self.materialize()
        self._write(key_states, value_states)
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    def defer(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append `keys`/`values` `[batch, kv_heads, n, head_dim]` by reference; they must not change."""
        start = self._reserve(keys, values)
        self._pending.append((start, keys, values))

    def materialize(self) -> None:
        """Copy the pieces appended by reference into the buffer."""
        for position, keys, values in self._pending:
            assert self._key_buffer is not None and self._value_buffer is not None
            self._key_buffer[:, :, position:position + keys.shape[-2]].copy_(keys)
            self._value_buffer[:, :, position:position + values.shape[-2]].copy_(values)
        self._pending.clear()

    def reserve(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Room for new K/V rows after the current length, for a caller that writes them in place: `like` has
        their shape `[batch, kv_heads, n, head_dim]`, dtype and device. Returns the key and value buffer views
        to write and `segments()`, which already covers the new rows."""
        start = self._reserve(like, like)
        assert self._key_buffer is not None and self._value_buffer is not None
        end = start + like.shape[-2]
        return self._key_buffer[:, :, start:end], self._value_buffer[:, :, start:end], self.segments()

    def write_rows(self, keys_like: torch.Tensor, values_like: torch.Tensor, spare: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Views of the buffers for new K/V rows after the current length (`*_like` give their shapes and dtype),
        which the caller writes before anything reads this layer, extended by up to `spare` rows the buffers
        hold past them; and the row they start at."""
        start = self._reserve(keys_like, values_like)
        assert self._key_buffer is not None and self._value_buffer is not None
        end = min(start + keys_like.shape[-2] + spare, self._key_buffer.shape[2], self._value_buffer.shape[2])
        return self._key_buffer[:, :, start:end], self._value_buffer[:, :, start:end], start

    def segments(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) pieces covering positions `[0, length)` in order: buffer views and pieces held by
        reference."""
        assert self._key_buffer is not None and self._value_buffer is not None and self._keys is not None
        pieces, position, end = [], 0, self.get_seq_length()  # views only: the rows are not read here
        for start, keys, values in self._pending:
            if start > position:
                pieces.append((self._key_buffer[:, :, position:start], self._value_buffer[:, :, position:start]))
            pieces.append((keys, values))
            position = start + keys.shape[-2]
        if position < end:
            pieces.append((self._key_buffer[:, :, position:end], self._value_buffer[:, :, position:end]))
        return pieces

    def _write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        start = self._reserve(key_states, value_states)
        assert self._key_buffer is not None and self._value_buffer is not None
        end = start + key_states.shape[-2]
        self._key_buffer[:, :, start:end].copy_(key_states)
        self._value_buffer[:, :, start:end].copy_(value_states)

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor) -> int:
        """Make room for `key_states`' tokens after the current length; returns where they start."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if self._key_buffer is None or end > self._key_buffer.shape[-2]:
            grown = max(end, 2 * self.capacity) if self._key_buffer is not None else max(end, self.capacity)
            self._grow(key_states, value_states, grown, start)
        assert self._key_buffer is not None and self._value_buffer is not None
        self.keys = self._key_buffer[:, :, :end]
        self.values = self._value_buffer[:, :, :end]
        return start

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

    def truncate(self, length: int, capacity: int) -> bool:
        """Keep only the first `length` tokens, for a next request that continues them with room for `capacity`
        in all; False (nothing changed) when this layer cannot: pieces held by reference, fewer tokens, or a
        buffer too small."""
        if (self._pending or self._key_buffer is None or self._value_buffer is None or self.keys is None
                or self.keys.shape[-2] < length or self._key_buffer.shape[-2] < capacity):
            return False
        self.keys, self.values = self._key_buffer[:, :, :length], self._value_buffer[:, :, :length]
        return True

    def _grow(self, keys: torch.Tensor, values: torch.Tensor, capacity: int, filled: int) -> None:
        self.wait_rows()  # its rows are about to be copied into a new buffer
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
        strides = key_buffer.stride()
        self._rows_plain = (key_buffer.dtype == value_buffer.dtype == torch.float32 and key_buffer.shape[0] == 1
                            and key_buffer.shape == value_buffer.shape and strides == value_buffer.stride()
                            and strides[2] == key_buffer.shape[3] and strides[3] == 1)
        self.keys, self.values = key_buffer[:, :, :filled], value_buffer[:, :, :filled]
