"""The lanes: the working memory of running sequences, one sequence in a lane at a time, kept between requests.

A lane's buffers outlive its requests: reserved and written once at start, so that no request page-faults fresh
memory on its time to first token, and holding the last request's rows, so that the next request of the same
scope continues from them without a copy (`GrowableKVLayer.adopt`). `Lanes` is their one owner: it hands a lane's
buffers to a new working cache, counts the rows written in each lane since it was last wiped, wipes idle lanes
(giving way to waiting work) and reserves them at start. The model state adapter only builds a working cache over
the buffers it is given (`ModelStateAdapter.working_cache`); the reuse manager decides which rows stay hot.

Bytes, per kind of layer. Only plain full-attention layers keep token rows in a lane's buffers (batch 1):

    bytes per row = Σ_full-attention layers 2 · kv_heads · head_dim · dtype bytes          (keys and values)
    rows per lane = ⌊min(context, ⌊budget / (lanes · bytes per row)⌋) / ROWS_GRAIN⌋ · ROWS_GRAIN   (at start)
    lane bytes    = rows · bytes per row

A lane holds the rows reserved at start, or more: the largest capacity it was asked for (prompt plus the reply's
budget) rounded up to a whole `ROWS_GRAIN`, doubling when a forward outgrows it. Sliding-window layers (their
`W - 1` token window tail) and recurrent layers (conv and recurrent states of one position) keep their state in
transformers' own tensors in the working cache, sized by the window or the state, not by rows: they take no row
of a lane, and a model without full-attention layers reserves nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping

import torch
from transformers import DynamicCache

from cache.working_cache import GrowableKVLayer

FRESH_BUFFER_HOOKS: list[Callable[[int, int], object]] = []
"""Called with (address, bytes) of each working buffer the pool allocates: the node excludes them from core
dumps (`node.hygiene.exclude_from_dumps`); this package cannot import the node."""


WIPE_BATCH_BYTES = 8 * 1024 * 1024
"""Bytes of rows zeroed between two looks for a waiting request (`BufferPool.zero_rows`): a millisecond or two.
An idle lane of an 8k-token request of the default model holds 256 MiB, which one wipe zeroes in tens of
milliseconds that a request arriving meanwhile would otherwise wait on its time to first token."""


ROWS_GRAIN = 512
"""Buffers hold a multiple of this many token rows: a lane whose requests grow by a turn at a time (a chat
re-sent with one more exchange) reallocates, and page-faults, once per grain, not on every request."""


def _never() -> bool:
    return False


class BufferPool:
    """One lane's working buffers: per slot (keys and values of each full-attention layer), one tensor
    `[1, kv_heads, rows, head_dim]`.

    A buffer handed out is valid until the next `take` of the same slot, and still holds what the lane's last
    sequence wrote, which lets the next request of the same scope continue from it (see `GrowableKVLayer.adopt`).
    """

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}
        self._home: dict[int, torch.Tensor] = {}
        """Per slot, the lane's rows of the lanes' slab (`Lanes.reserve(contiguous=True)`), where its buffer
        returns whenever a request fits them."""

    def settle(self, slot: int, home: torch.Tensor) -> None:
        """Make `home` (this lane's rows of a slab, zeroed) slot's buffer from now on, wherever a request fits it."""
        held = self._buffers.get(slot)
        self._home[slot] = self._replace(slot, held if held is not home else None, home, 0)

    def take(self, slot: int, like: torch.Tensor, shape: tuple[int, ...], keep: int = 0) -> torch.Tensor:
        """A tensor of `shape` (seq on dim 2) with `like`'s dtype and device, backed by slot's buffer: its home in
        the slab where it fits there.

        The first `keep` tokens of the slot's previous contents survive a reallocation.
        """
        held, home = self._buffers.get(slot), self._home.get(slot)
        if home is not None and held is not home and _fits(home, like, shape):
            held = self._replace(slot, held, home, keep)
        if held is None or not _fits(held, like, shape):
            rows = -(-shape[2] // ROWS_GRAIN) * ROWS_GRAIN
            fresh = like.new_empty((*shape[:2], rows, *shape[3:]))
            for hook in FRESH_BUFFER_HOOKS if fresh.device.type == "cpu" else ():  # host pages only
                hook(fresh.data_ptr(), fresh.numel() * fresh.element_size())
            held = self._replace(slot, held, fresh, keep)
        return held[:, :, :shape[2]]

    def _replace(self, slot: int, held: torch.Tensor | None, new: torch.Tensor, keep: int) -> torch.Tensor:
        """Make `new` slot's buffer, with the first `keep` rows of `held`, which is then zeroed: a request's state
        must not outlive the buffer it was in."""
        if held is not None:
            if keep:
                new[:, :, :keep].copy_(held[:, :, :keep])
            with torch.inference_mode():
                held.zero_()
        self._buffers[slot] = new
        return new

    def held(self, slot: int) -> torch.Tensor | None:
        return self._buffers.get(slot)

    @property
    def row_bytes(self) -> int:
        """Bytes one token row takes across the pool's buffers."""
        return sum(buffer.nbytes // buffer.shape[2] for buffer in self._buffers.values())

    def reserve(self, like: BufferPool, rows: int) -> None:
        """Hold buffers of at least `rows` token rows, shaped as `like`'s, and write zeros to them: their pages
        are faulted in now, not on a request's time to first token."""
        for slot, buffer in like._buffers.items():
            self.take(slot, buffer, (*buffer.shape[:2], rows, *buffer.shape[3:]))
        self.zero_rows(0, max(buffer.shape[2] for buffer in self._buffers.values()))

    @torch.inference_mode()
    def zero_rows(self, start: int, end: int, stop: Callable[[], bool] = _never) -> int:
        """Zero token rows `[start, end)` of every buffer, from the last row down in batches of about
        `WIPE_BATCH_BYTES`, looking at `stop()` before each. Returns the end of the rows still to zero: `start`
        once all are, less than `end` by the batches done when `stop()` interrupted."""
        rows = max(1, WIPE_BATCH_BYTES // max(1, self.row_bytes))
        while end > start and not stop():
            first = max(start, end - rows)
            for buffer in self._buffers.values():
                buffer[:, :, first:end].zero_()
            end = first
        return max(start, end)


def _fits(buffer: torch.Tensor, like: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """Whether `buffer` holds a tensor of `shape` (rows on dim 2) of `like`'s dtype and device."""
    return (buffer.dtype == like.dtype and buffer.device == like.device
            and buffer.shape[:2] + buffer.shape[3:] == shape[:2] + shape[3:] and buffer.shape[2] >= shape[2])


def rows_per_lane(budget: int, lanes: int, row_bytes: int, context: int) -> int:
    """Token rows each of `lanes` lanes gets from `budget` bytes in all, rows of `row_bytes` each: at most
    `context`, rounded down to whole `ROWS_GRAIN`s (0 when not even one grain fits)."""
    return min(budget // (lanes * row_bytes), context) // ROWS_GRAIN * ROWS_GRAIN


class Lanes:
    """The working memory of one model's running sequences, lane by lane (see the module docstring).

    Used from the engine's worker thread only, as the working caches it hands out are.
    """

    def __init__(self, build: Callable[[int, BufferPool], DynamicCache]) -> None:
        """`build(capacity, pool)`: a fresh working cache for `capacity` tokens over `pool`'s buffers
        (`ModelStateAdapter.working_cache`)."""
        self._build = build
        self._pools: dict[int, BufferPool] = {}
        self._last: dict[int, DynamicCache] = {}
        """Per lane, the working cache handed out last (one is live per lane), which a continuing request takes
        over."""
        self._written: dict[int, int] = {}
        """Per lane, rows of its buffers written since they were last wiped."""
        self.rows = 0
        """Token rows each lane's buffers were given at start (`reserve`)."""
        self.slabs: dict[int, torch.Tensor] = {}
        """Per buffer slot, `[lanes + 1, kv_heads, rows, head_dim]`, whose index i holds lane i's buffer and the last
        is scratch, when the lanes were reserved `contiguous` (else empty): what a static decode step reads and
        writes at fixed addresses (`node/engine/static_decode.py`)."""

    def new_cache(self, lane: int, capacity: int, adopt: int = 0) -> tuple[DynamicCache, int]:
        """A working cache sized for `capacity` tokens (prompt plus the reply's budget), in `lane`'s buffers.

        Plain full-attention layers get the lane's buffers, reused by the lane's next `new_cache`: one working
        cache is live per lane. With `adopt`, the cache starts from that many tokens the lane's previous working
        cache left in the buffers; returns the cache and the tokens it starts with (`adopt` or 0).
        """
        last = self._last.pop(lane, None)
        if (last is not None and all(isinstance(layer, GrowableKVLayer) for layer in last.layers)
                and not self._away(lane, last, capacity)):
            # The last working cache itself, cut back (to nothing without `adopt`): no layer objects or buffer
            # views to rebuild.
            if all(layer.truncate(adopt, capacity) for layer in last.layers):  # type: ignore[union-attr]
                self._last[lane] = last
                return last, adopt
        cache = self._fresh(lane, capacity)
        layers = [layer for layer in cache.layers if isinstance(layer, GrowableKVLayer)]
        if adopt and layers and len(layers) == len(cache.layers):
            if not all(layer.adopt(adopt) for layer in layers):
                cache, adopt = self._fresh(lane, capacity), 0
        else:
            adopt = 0
        self._last[lane] = cache
        return cache, adopt

    def _away(self, lane: int, cache: DynamicCache, capacity: int) -> bool:
        """Whether `cache`, the lane's last, outgrew the lane's rows of the slabs while `capacity` fits them again:
        a fresh cache then takes the rows home (`BufferPool.take`)."""
        if not self.slabs or capacity > self.rows:
            return False
        buffer = cache.layers[0]._key_buffer  # type: ignore[union-attr]
        return buffer is not None and buffer.data_ptr() != self.slabs[0][lane].data_ptr()

    def _fresh(self, lane: int, capacity: int) -> DynamicCache:
        return self._build(capacity, self._pools.setdefault(lane, BufferPool()))

    def row_bytes(self, lane: int = 0) -> int:
        """Bytes one token row takes in `lane`'s buffers (0 before it holds any)."""
        pool = self._pools.get(lane)
        return 0 if pool is None else pool.row_bytes

    def mark_written(self, lane: int, rows: int) -> None:
        """Rows `[0, rows)` of `lane`'s buffers hold state now: the lane's next wipe zeroes them."""
        self._written[lane] = max(self._written.get(lane, 0), rows)

    def written(self, lane: int) -> int:
        """Rows of `lane`'s buffers written since they were last wiped."""
        return self._written.get(lane, 0)

    def wipe(self, lane: int, keep: int, end: int, stop: Callable[[], bool] = _never) -> int:
        """Zero rows `[keep, end)` of `lane`'s buffers: what they hold there is no longer hot state. Returns the
        end of the rows still to zero (`keep` when done; more when `stop()` interrupted it). Counts nothing:
        `wipe_idle` wipes what `mark_written` counted."""
        pool = self._pools.get(lane)
        left = keep if pool is None else pool.zero_rows(keep, end, stop)
        last = self._last.get(lane)
        if (not keep and left == keep and last is not None
                and not all(isinstance(layer, GrowableKVLayer) for layer in last.layers)):
            del self._last[lane]  # its sliding-window and recurrent tensors are not hot state either
        return left

    def wipe_idle(self, busy: Container[int], keep: Mapping[int, int], stop: Callable[[], bool] = _never) -> None:
        """Wipe the rows written in every lane not in `busy`, but its first `keep[lane]` (the hot working cache),
        lane by lane in the order they were first written; a lane's wipe gives way to `stop()`, and the rows it
        leaves stay counted for the next one."""
        for lane, written in list(self._written.items()):
            if lane not in busy:
                kept = keep.get(lane, 0)
                self._written[lane] = max(kept, self.wipe(lane, kept, written, stop))

    def reserve(self, lanes: int, budget: int, context: int, probe: Callable[[DynamicCache], object],
                contiguous: bool = False) -> int:
        """At start: give lanes `[0, lanes)` buffers of `rows_per_lane` token rows, written with zeros. Their
        shapes (heads, head dim, dtype per layer) come from lane 0's, learnt from `probe` (one token run in a
        working cache) if lane 0 holds none yet. Returns the rows each lane holds (0: nothing reserved; lanes
        then allocate when first used). Lanes still grow past it when a request needs more. `contiguous`: each
        slot's buffers of all lanes are one tensor (`slabs`), with one lane more as scratch; a lane that outgrew
        its rows returns to them when a request fits again."""
        if lanes <= 0 or budget <= 0:
            return 0
        if not self.row_bytes(0):
            with torch.inference_mode():
                cache, _ = self.new_cache(0, 1)
                probe(cache)
                self.wipe(0, 0, 1)
        row_bytes = self.row_bytes(0)
        if not row_bytes:
            return 0  # no layer keeps K/V rows in lane buffers (recurrent models)
        rows = rows_per_lane(budget, lanes, row_bytes, context)
        if rows:
            model = self._pools[0]
            if contiguous:
                self.slabs = {slot: buffer.new_zeros((lanes + 1, buffer.shape[1], rows, *buffer.shape[3:]))
                              for slot, buffer in model._buffers.items()}
                for slab in self.slabs.values():
                    for hook in FRESH_BUFFER_HOOKS if slab.device.type == "cpu" else ():  # host pages only
                        hook(slab.data_ptr(), slab.numel() * slab.element_size())
            for lane in range(lanes):
                pool = self._pools.setdefault(lane, BufferPool())
                if contiguous:
                    for slot, slab in self.slabs.items():
                        pool.settle(slot, slab[lane:lane + 1])
                else:
                    pool.reserve(model, rows)
                self._last.pop(lane, None)  # its views may be of buffers just replaced
        self.rows = rows
        return rows
