"""The state arena: stored span and snapshot payloads by handle; plaintext in a bounded hot tier, sealed otherwise.

Only the arena and the adapters hold tensors. Handles are plain ints so the prefix index can keep them
without knowing what they point to. Each handle is one tree node's state: the span of tokens the node
covers (full-attention K/V), and optionally a snapshot taken at the node's end.

Tiers. A payload is stored in plaintext (the hot tier) and sealed by `seal_cold` after the reply, least
recently used first, until the hot tier holds at most `plaintext_bytes`; sealing zeroes the plaintext it
replaces. A sealed span opens straight into the working cache's buffers (no plaintext copy in between), in
messages of at most `BLOCK_TOKENS` tokens of one head, opened in parallel threads, for the runner while its
first chunk computes (`restore(later=True)`, `cache/opening.py`); opening leaves the entry sealed.
Everything freed or shredded is zeroed first, so no stored state outlives its entry in memory.

This module keeps the entries: their scope and tokens, which tier each part is in, the bytes of each caller,
and when to seal. How a payload's bytes are cut into messages, sealed and opened is `cache/sealed_payload.py`.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cache.adapters import ModelStateAdapter, Snapshot, SpanState, state_bytes
from cache.blob_memory import BlobMemory
from cache.budget import CacheBudget
from cache.device_copy import PAGEABLE
from cache.opening import Opening, SealedEntryError
from cache.prefix_cache import ColdPass, PrefixCache
from cache.scope import Scope, SpanHandle
from cache.sealed_payload import (
    SealedPayload,
    map_payload,
    open_payload,
    open_span,
    payload_tensors,
    seal_payload,
    zero_payload,
)
from cache.sealing import Place, Sealer, SealError

__all__ = ["Scope", "SealCost", "SealedEntryError", "SpanHandle", "StateArena", "new_prefix_cache"]

DEFER_BYTES = 32 * 1024 * 1024
"""Plaintext over the hot tier that may wait for the next pass while requests queue (1k tokens of the default
model); beyond it a waiting request waits for the seal."""


DROP_MARGIN = 2.0
"""An entry is dropped only when it opens at least this many times slower than it computes: near parity the
load-time measurement's noise must not decide, and keeping is the safe side."""


@dataclass(frozen=True, slots=True)
class SealCost:
    """One model's price of keeping state sealed, measured at load: opening a stored byte against computing a
    token again. Where opening an entry costs more than computing its tokens (small models on fast devices:
    the cipher runs on the CPU whatever computes), the entry is dropped instead of sealed."""

    open_s_per_byte: float
    recompute_s_per_token: float
    sample_bytes: int
    sample_tokens: int
    """The measured entry: when even it is not worth sealing, nothing of the model is kept past the hot tier."""

    def worth_sealing(self, nbytes: int, tokens: int) -> bool:
        return nbytes * self.open_s_per_byte <= DROP_MARGIN * max(tokens, 1) * self.recompute_s_per_token

    @property
    def model_worth_sealing(self) -> bool:
        return self.worth_sealing(self.sample_bytes, self.sample_tokens)


@dataclass(slots=True)
class _Part:
    plain: Any
    sealed: SealedPayload | None
    nbytes: int
    origin: Place | None = None
    """Where the part was sealed: the associated data its messages open with. Kept by the arena beside the
    ciphertext, not in it, so ciphertext moved to another entry does not open."""
    window: tuple[int, int] = (0, 0)
    """The token rows of the sealed K/V this part covers: all of them until a split cuts the span."""
    borrowed: bool = False
    """`plain` is views of the working buffers (the hot working cache), not the arena's own memory: sealed
    straight from there after the reply, never zeroed by the arena, copied if it must outlive them."""


@dataclass(frozen=True, slots=True)
class Borrowed:
    """A span handed to `put` as views of the working buffers: sealed from them without a copy."""

    span: SpanState


@dataclass(slots=True)
class _Entry:
    scope: Scope
    start: int
    end: int
    span: _Part
    snapshot: _Part | None
    last_used: int

    @property
    def hot(self) -> bool:
        return self.span.plain is not None or (self.snapshot is not None and self.snapshot.plain is not None)

    @property
    def nbytes(self) -> int:
        return self.span.nbytes + (self.snapshot.nbytes if self.snapshot is not None else 0)


@torch.inference_mode()
def _shred(part: _Part | None) -> None:
    """Zero a part's memory, plaintext or sealed, before it is let go."""
    if part is None:
        return
    if part.plain is not None and not part.borrowed:
        zero_payload(part.plain)
    if part.sealed is not None:
        part.sealed.blob.users -= 1
        if not part.sealed.blob.users:
            part.sealed.blob.wipe()
    part.plain, part.sealed = None, None


class StateArena:
    """Holds payloads in memory; `bytes_total` and `bytes_of_caller` are sums of plaintext tensor bytes (a sealed
    payload takes 16 bytes more per message)."""

    def __init__(self, sealer: Sealer | None = None, plaintext_bytes: int = 0) -> None:
        self.sealer = sealer
        """None: nothing is sealed (tests of the index alone, and `--no-seal`)."""
        self.plaintext_bytes = plaintext_bytes
        self._entries: dict[SpanHandle, _Entry] = {}
        self._adapters: dict[str, ModelStateAdapter] = {}
        self._costs: dict[str, SealCost] = {}
        self._caller_bytes: defaultdict[str, int] = defaultdict(int)
        self._next = itertools.count(1)
        self._clock = itertools.count(1).__next__
        self.bytes_total = 0
        self.snapshot_bytes = 0
        """The part of `bytes_total` held in snapshots."""
        self.hot_bytes = 0
        """The part of `bytes_total` held in plaintext."""
        self.sealed_bytes = 0
        self.open_failures = 0
        self.unsealed_drops = 0
        """Entries dropped rather than sealed: opening them would cost more than computing them again."""
        self._borrowed: set[SpanHandle] = set()
        self.written = 0
        """The highest working-buffer row an opening wrote since the engine last read it (rows past a restore's
        length included: they hold state until overwritten or wiped)."""
        self.scratch: list[torch.Tensor] = []
        """Plaintext opened for the current request outside the working buffers; zeroed by `wipe_scratch`."""
        self.memory = BlobMemory()
        """Where ciphertext goes: slabs reserved at start (`new_prefix_cache`), else memory of its own."""
        self.host_copies = PAGEABLE
        """How state on a device reaches the cipher (host staging, pinned or not): the node sets it at start."""

    def register_model(self, model: str, adapter: ModelStateAdapter, cost: SealCost | None = None) -> None:
        """`cost` None: every entry of the model is worth sealing."""
        self._adapters[model] = adapter
        if cost is not None:
            self._costs[model] = cost

    @property
    def sealing(self) -> bool:
        return self.sealer is not None

    def _account(self, scope: Scope, delta: int) -> None:
        self._caller_bytes[scope.caller] += delta
        if not self._caller_bytes[scope.caller]:
            del self._caller_bytes[scope.caller]
        self.bytes_total += delta

    def _add(self, part: _Part, sign: int) -> None:
        if part.plain is not None:
            self.hot_bytes += sign * part.nbytes
        else:
            self.sealed_bytes += sign * part.nbytes

    def put(self, scope: Scope, start: int, end: int, span: SpanState | Borrowed) -> SpanHandle:
        if isinstance(span, Borrowed):
            handle = self._insert(scope, start, end, _Part(span.span, None, state_bytes(span.span), borrowed=True))
            self._borrowed.add(handle)
            return handle
        return self._insert(scope, start, end, _Part(span, None, state_bytes(span)))

    def own_borrowed(self) -> None:
        """Copy every part still borrowing the working buffers, which the next working cache overwrites."""
        for handle in list(self._borrowed):
            entry = self._entries.get(handle)
            if entry is not None and entry.span.borrowed and entry.span.plain is not None:
                entry.span.plain = self._adapters[entry.scope.model].own(entry.span.plain)
                entry.span.borrowed = False
        self._borrowed.clear()

    def _insert(self, scope: Scope, start: int, end: int, part: _Part) -> SpanHandle:
        handle = SpanHandle(next(self._next))
        self._entries[handle] = _Entry(scope, start, end, part, None, self._clock())
        self._account(scope, part.nbytes)
        self._add(part, 1)
        return handle

    def nbytes(self, handle: SpanHandle) -> int:
        return self._entries[handle].nbytes

    def has_snapshot(self, handle: SpanHandle) -> bool:
        return self._entries[handle].snapshot is not None

    def snapshot_nbytes(self, handle: SpanHandle) -> int:
        snapshot = self._entries[handle].snapshot
        return 0 if snapshot is None else snapshot.nbytes

    def held_bytes(self, handle: SpanHandle) -> tuple[int, int]:
        """The handle's bytes held in plaintext (the hot tier) and sealed, as `hot_bytes` and `sealed_bytes`
        count them."""
        hot = sealed = 0
        for part in (self._entries[handle].span, self._entries[handle].snapshot):
            if part is not None and part.plain is not None:
                hot += part.nbytes
            elif part is not None:
                sealed += part.nbytes
        return hot, sealed

    def is_sealed(self, handle: SpanHandle) -> bool:
        entry = self._entries[handle]
        return entry.span.sealed is not None and (entry.snapshot is None or entry.snapshot.sealed is not None)

    def attach_snapshot(self, handle: SpanHandle, snapshot: Snapshot) -> None:
        """Keep `snapshot` as the state at the end of this handle's span (once; a second is ignored)."""
        entry = self._entries[handle]
        if entry.snapshot is None:
            entry.snapshot = _Part(snapshot, None, state_bytes(snapshot))
            entry.last_used = self._clock()
            self._account(entry.scope, entry.snapshot.nbytes)
            self._add(entry.snapshot, 1)
            self.snapshot_bytes += entry.snapshot.nbytes

    def drop_snapshot(self, handle: SpanHandle) -> int:
        entry = self._entries[handle]
        if entry.snapshot is None:
            return 0
        size = entry.snapshot.nbytes
        self._add(entry.snapshot, -1)
        _shred(entry.snapshot)
        entry.snapshot = None
        self._account(entry.scope, -size)
        self.snapshot_bytes -= size
        return size

    def free(self, handle: SpanHandle) -> int:
        """Drop a handle's state, zeroed first; returns the bytes released."""
        entry = self._entries.pop(handle)
        size = entry.nbytes
        self._account(entry.scope, -size)
        for part in (entry.span, entry.snapshot):
            if part is not None:
                self._add(part, -1)
                _shred(part)
        if entry.snapshot is not None:
            self.snapshot_bytes -= entry.snapshot.nbytes
        return size

    def split(self, handle: SpanHandle, offset: int) -> tuple[SpanHandle, SpanHandle]:
        """Swap one span for its two halves; the snapshot stays at the end, with the second half. A hot span is
        cut into two plaintext copies; a sealed one into two windows on its ciphertext, nothing opened."""
        entry = self._entries[handle]
        scope, start, end, snapshot = entry.scope, entry.start, entry.end, entry.snapshot
        span = entry.span
        if span.plain is not None:
            halves = self._adapters[scope.model].split(span.plain, offset)
            parts = [_Part(half, None, state_bytes(half)) for half in halves]
        else:
            assert span.sealed is not None
            lo, hi = span.window
            per_token = span.nbytes // (hi - lo)
            span.sealed.blob.users += 2
            parts = [_Part(None, span.sealed, per_token * (window[1] - window[0]), span.origin, window)
                     for window in ((lo, lo + offset), (lo + offset, hi))]
        entry.snapshot = None  # moves to the right half as it is, its bytes counted all along
        self.free(handle)
        left = self._insert(scope, start, start + offset, parts[0])
        right = self._insert(scope, start + offset, end, parts[1])
        self._entries[right].snapshot = snapshot
        return left, right

    def _plain(self, handle: SpanHandle, entry: _Entry, kind: str, part: _Part) -> Any:
        """A part's plaintext: itself when hot, else opened into fresh tensors (kept in `scratch`)."""
        if part.plain is not None:
            return part.plain
        assert part.sealed is not None and part.origin is not None and self.sealer is not None
        try:
            opened = open_payload(self.sealer, entry.scope, part.origin, part.sealed, self.host_copies)
        except SealError:
            self.open_failures += 1
            raise SealedEntryError([handle]) from None
        self.scratch.extend(payload_tensors(opened))
        lo, hi = part.window
        if kind == "span" and (lo, hi) != (0, payload_tensors(opened)[0].shape[2]):
            return map_payload(opened, lambda t: t[:, :, lo:hi])
        return opened

    # -- restoring into a working cache ------------------------------------------------------------------

    def restore(self, adapter: ModelStateAdapter, cache: Any, spans: Sequence[tuple[SpanHandle, int]], skip: int,
                snapshot: SpanHandle | None, position: int, later: bool = False) -> Opening | None:
        """Fill a new working cache to resume at `position`: `spans` cover `[0, position)` in order, (handle,
        tokens to take); the first `skip` tokens are already in the cache (an adopted prefix). Hot spans are
        taken by reference, sealed ones opened into the working buffers. Raises SealedEntryError naming the
        entries that failed to open (the cache is then unusable: start a fresh one).

        `later`: sealed rows of pooled layers may still be opening on return, in the returned `Opening` (see
        `cache/opening.py`), which the caller must `finish` before anything but the cache's own layers reads
        them; a failure of those rows is raised there."""
        offset, now = 0, self._clock()
        opening = Opening(self._count_failure) if later and self.sealer is not None else None
        try:
            for handle, take in spans:
                entry = self._entries[handle]
                entry.last_used = now
                start = max(0, skip - offset)
                if start < take:
                    if entry.span.plain is not None:
                        adapter.restore_span(cache, entry.span.plain, start, take)
                    else:
                        self._open_span(adapter, cache, handle, entry, start, take, opening,
                                        last=handle == spans[-1][0])
                offset += take
            if snapshot is not None:
                entry = self._entries[snapshot]
                entry.last_used = now
                assert entry.snapshot is not None
                adapter.restore_snapshot(cache, self._plain(snapshot, entry, "snapshot", entry.snapshot), position)
        except SealedEntryError:
            if opening is not None:
                opening.settle()  # no thread may write into the cache once it is given up
            raise
        return opening if opening is not None and opening.layers else None

    def _count_failure(self) -> None:
        self.open_failures += 1

    def _open_span(self, adapter: ModelStateAdapter, cache: Any, handle: SpanHandle, entry: _Entry, start: int,
                   take: int, opening: Opening | None = None, last: bool = True) -> None:
        """Open tokens `[start, take)` of a sealed span into the working cache (`open_span`); the rows it opens in
        place count in `written`."""
        span = entry.span
        assert span.sealed is not None and span.origin is not None and self.sealer is not None
        lo = span.window[0]  # a split span is a window on the sealed tensors' rows
        open_span(self.sealer, span.sealed, entry.scope, span.origin, adapter, cache, (lo + start, lo + take),
                  handle=handle, opening=opening, last=last, wrote=self._wrote, failed=self._count_failure,
                  host_copies=self.host_copies)

    def _wrote(self, row: int) -> None:
        self.written = max(self.written, row)

    # -- tiers --------------------------------------------------------------------------------------------

    def seal_cold(self, stop: Callable[[], bool] = lambda: False) -> ColdPass:
        """Seal plaintext, least recently used first, until the hot tier holds at most `plaintext_bytes`.
        Entries not worth sealing (`SealCost`) are left as they are and named in the result, for the index to
        drop. Every `SEAL_BATCH_BYTES`, a waiting request (`stop()`) goes first, once at most `DEFER_BYTES`
        are left over the hot tier (an entry it interrupts stays plaintext, sealed by the next pass): the
        plaintext beyond the hot tier stays bounded under any load."""
        if self.sealer is None or self.hot_bytes <= self.plaintext_bytes:
            self.own_borrowed()
            return ColdPass(0, ())
        sealed, unkept, unkept_bytes, given_way = 0, [], 0, stop

        def stop_now() -> bool:
            return self.hot_bytes - unkept_bytes - self.plaintext_bytes <= DEFER_BYTES and given_way()

        stop = stop_now
        for _, handle in sorted((entry.last_used, handle) for handle, entry in self._entries.items() if entry.hot):
            if self.hot_bytes - unkept_bytes <= self.plaintext_bytes or stop():
                break
            entry = self._entries[handle]
            cost = self._costs.get(entry.scope.model)
            # A snapshot stands for every token before it: without it, a resume starts at an earlier snapshot
            # or at 0, so it weighs as its whole prefix (keeping it when unsure); a span weighs as its tokens.
            tokens = entry.end if entry.snapshot is not None else entry.end - entry.start
            if cost is not None and not cost.worth_sealing(entry.nbytes, tokens):
                unkept.append((entry.scope, handle))
                unkept_bytes += sum(part.nbytes for part in (entry.span, entry.snapshot)
                                    if part is not None and part.plain is not None)
                continue
            for kind, part in (("span", entry.span), ("snapshot", entry.snapshot)):
                if part is not None and part.plain is not None:
                    if not self._seal(handle, entry, kind, part, stop):
                        return self._cold_pass(sealed, unkept)
                    sealed += part.nbytes
        return self._cold_pass(sealed, unkept)

    def _cold_pass(self, sealed: int, unkept: list[tuple[Scope, SpanHandle]]) -> ColdPass:
        """Own what stays in the hot tier; what the index is about to drop is not copied first."""
        self._borrowed.difference_update(handle for _, handle in unkept)
        self.own_borrowed()
        self.unsealed_drops += len(unkept)
        return ColdPass(sealed, tuple(unkept))

    @torch.inference_mode()
    def _seal(self, handle: SpanHandle, entry: _Entry, kind: str, part: _Part, stop: Callable[[], bool]) -> bool:
        """Seal one part (`seal_payload`); False (nothing changed) when `stop()` interrupts it."""
        assert self.sealer is not None
        place = Place(handle, entry.start, entry.end, kind)
        sealed = seal_payload(self.sealer, self.memory, entry.scope, place, part.plain, stop, self.host_copies)
        if sealed is None:
            return False
        self._add(part, -1)
        if not part.borrowed:  # the working buffers are the hot working cache: the engine wipes them
            zero_payload(part.plain)
        rows = entry.end - entry.start if kind == "span" else 0
        part.plain, part.sealed, part.borrowed = None, sealed, False
        part.origin, part.window = place, (0, rows)
        self._add(part, 1)
        return True

    def take_scratch(self) -> list[torch.Tensor]:
        """The plaintext opened outside the working buffers since the last call, for the caller to zero."""
        scratch, self.scratch = self.scratch, []
        return scratch

    @torch.inference_mode()
    def wipe_scratch(self) -> None:
        for tensor in self.scratch:
            tensor.zero_()
        self.scratch.clear()

    def forget(self, scope: Scope) -> None:
        """The scope's key dies (its entries must be freed already): nothing sealed under it opens again."""
        if self.sealer is not None:
            self.sealer.forget(scope)

    def bytes_of_caller(self, caller: str) -> int:
        return self._caller_bytes.get(caller, 0)

    def describe(self) -> dict[str, Any]:
        return {"entries": len(self._entries), "bytes": self.bytes_total, "plaintext_bytes": self.hot_bytes,
                "sealed_bytes": self.sealed_bytes, "hot_tier_bytes": self.plaintext_bytes,
                "open_failures": self.open_failures, "unsealed_drops": self.unsealed_drops,
                "reserve_bytes": self.memory.reserved_bytes, "reserve_free_bytes": self.memory.free_bytes}

    def __len__(self) -> int:
        return len(self._entries)


def new_prefix_cache(budget: CacheBudget, sealed: bool = True, plaintext_bytes: int = 0,
                     threads: int | None = None, reserve_bytes: int = 0, compute_threads: int = 0) -> PrefixCache:
    """A prefix cache over a new arena: sealed under a new boot master key unless `sealed` is False, into
    `reserve_bytes` of memory written now (`BlobMemory`); `compute_threads`: the forward's CPU threads."""
    arena = StateArena(Sealer(threads, compute_threads) if sealed else None, plaintext_bytes)
    if sealed:
        arena.memory.reserve(reserve_bytes)
    return PrefixCache(budget, arena)
