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
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cache.adapters import KVPiece, ModelStateAdapter, RecurrentPiece, Snapshot, SpanState, state_bytes
from cache.blob_memory import Blob, BlobMemory
from cache.budget import CacheBudget
from cache.opening import Opening, SealedEntryError
from cache.prefix_cache import ColdPass, PrefixCache
from cache.scope import Scope, SpanHandle
from cache.sealing import TAG_BYTES, Place, Sealer, SealError
from cache.working_cache import GrowableKVLayer

__all__ = ["BLOCK_TOKENS", "Scope", "SealCost", "SealedEntryError", "SpanHandle", "StateArena", "new_prefix_cache"]

Payload = SpanState | Snapshot
BLOCK_TOKENS = 4096
"""Tokens of one head in one sealed message: 1 MiB at head dim 64 in float32. Fewer, larger messages cost less
Python before the first byte is opened, at the same opening rate (RESULTS.md, 2026-11-30)."""
SEAL_BATCH_BYTES = 8 * 1024 * 1024
"""Plaintext sealed between two looks for a waiting request (whole messages, at least one): a few milliseconds
on all cores. Counted in bytes, not messages: a span of a few hundred tokens has a hundred messages of tens of
KiB, and eight of them a call spent more time handing work to the sealing threads than sealing."""
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


def _place(copies: list[tuple[torch.Tensor, torch.Tensor, int, int]], start: int, take: int) -> None:
    """Copy rows `[start, take)` of blocks opened into scratch (scratch, its head's rows, block's first and end
    row) into place, and zero the scratch."""
    for scratch, row_target, first, end in copies:
        low, high = max(first, start), min(end, take)
        row_target[low - start:high - start].copy_(scratch[low - first:high - first])
        scratch.zero_()


def _map(payload: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The same structure with every tensor replaced by `fn(tensor)`, in a fixed walk order."""
    if payload is None:
        return None
    if isinstance(payload, KVPiece):
        return KVPiece(fn(payload.keys), fn(payload.values))
    if isinstance(payload, RecurrentPiece):
        return RecurrentPiece(tuple(None if t is None else fn(t) for t in payload.conv),
                              tuple(None if t is None else fn(t) for t in payload.recurrent))
    return tuple(_map(part, fn) for part in payload)


def _tensors(payload: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map(payload, lambda t: found.append(t) or t)  # type: ignore[func-returns-value]
    return found


def _blocks(tensor: torch.Tensor) -> Iterator[tuple[int, int, int]]:
    """The messages one tensor is sealed as: (head, first token, end token) for K/V `[1, heads, n, dim]`, else
    one per index of dim 1 (the whole tensor when it has fewer dims), as (index, 0, 0)."""
    if tensor.dim() == 4 and tensor.shape[0] == 1:
        for head in range(tensor.shape[1]):
            for start in range(0, tensor.shape[2], BLOCK_TOKENS):
                yield head, start, min(start + BLOCK_TOKENS, tensor.shape[2])
    elif tensor.dim() >= 2 and tensor.shape[0] == 1:
        for index in range(tensor.shape[1]):
            yield index, 0, 0
    else:
        yield -1, 0, 0


def _batches(sizes: list[int], limit: int) -> Iterator[tuple[int, int]]:
    """Consecutive `[first, last)` runs of messages of at most `limit` bytes in all, or one message."""
    first, total = 0, 0
    for index, size in enumerate(sizes):
        if index > first and total + size > limit:
            yield first, index
            first, total = index, 0
        total += size
    if first < len(sizes):
        yield first, len(sizes)


def _part(tensor: torch.Tensor, block: tuple[int, int, int]) -> torch.Tensor:
    index, start, end = block
    if index < 0:
        return tensor.reshape(-1)
    if tensor.dim() == 4:
        return tensor[0, index, start:end]
    return tensor[0, index]


def _bytes(tensor: torch.Tensor) -> Any:
    """A writable byte buffer over `tensor`'s memory (no copy); `tensor` must be contiguous."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


@dataclass(slots=True)
class _Sealed:
    blob: Blob
    nonces: list[bytes]
    skeleton: Any
    """The payload's structure with meta tensors: shapes and dtypes, no data."""
    offsets: list[int]
    """Where each message starts in the blob, and its end: one more than the messages."""


@dataclass(slots=True)
class _Part:
    plain: Any
    sealed: _Sealed | None
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
def _zero(payload: Any) -> None:
    """Overwrite with zeros (in inference mode: the engine's tensors are inference tensors)."""
    for tensor in _tensors(payload):
        tensor.zero_()


@torch.inference_mode()
def _shred(part: _Part | None) -> None:
    """Zero a part's memory, plaintext or sealed, before it is let go."""
    if part is None:
        return
    if part.plain is not None and not part.borrowed:
        _zero(part.plain)
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
        sealed = part.sealed
        opened = _map(sealed.skeleton, lambda t: torch.empty(t.shape, dtype=t.dtype))
        outs = [_bytes(_part(t, b)) for t in _tensors(opened) for b in _blocks(t)]
        try:
            self.sealer.run_open(self.sealer.open_jobs(entry.scope, part.origin, sealed.nonces, sealed.blob.data, outs))
        except SealError:
            self.open_failures += 1
            _zero(opened)
            raise SealedEntryError([handle]) from None
        self.scratch.extend(_tensors(opened))
        lo, hi = part.window
        if kind == "span" and (lo, hi) != (0, _tensors(opened)[0].shape[2]):
            return _map(opened, lambda t: t[:, :, lo:hi])
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
        """Open tokens `[start, take)` of a sealed span into the working cache: whole blocks straight into the
        layers' buffers, a block cut by `start` or `take` through a scratch block. With `opening`, the messages
        of pooled layers are handed to the sealing threads in layer order and left opening there, once all are
        built: threads woken while the rest are still being built take the interpreter lock from it back and forth."""
        assert entry.span.sealed is not None and entry.span.origin is not None and self.sealer is not None
        sealed = entry.span.sealed
        lo = entry.span.window[0]
        start, take = lo + start, lo + take  # rows of the sealed tensors (a split span is a window on them)
        offsets = sealed.offsets
        outs, copies, index = [], [], 0
        later: list[tuple[int, list[tuple[Any, ...]], Callable[[], None]]] = []
        pieces = iter(_tensors(sealed.skeleton))
        blob = memoryview(sealed.blob.data)
        # A block that `take` cuts opens in place past it, over rows the next span or the new tokens write. The
        # new tokens' writes wait for it (`GrowableKVLayer.opening`); a next span's would not: a cut span that is
        # not the last opens now.
        if not last and any(first < take < end for tensor in _tensors(sealed.skeleton)[:1]
                            for _, first, end in _blocks(tensor)):
            opening = None
        for layer_index, piece in enumerate(sealed.skeleton):
            if piece is None:
                continue
            keys, values = next(pieces), next(pieces)
            # Rows past `take` in the buffers are free (the new tokens or the next span write there): a block
            # that `take` cuts opens in place when it fits, else through a scratch block.
            *rows, cache_row = adapter.span_rows(cache, layer_index, keys, values, take - start, spare=BLOCK_TOKENS)
            for meta, target in ((keys, rows[0]), (values, rows[1])):
                # One byte view of the layer's rows, `[heads, rows, head_dim * itemsize]`: a message's target is
                # a slice of it (a head's rows are contiguous), far cheaper than a tensor view per message.
                target_bytes = target[0].view(torch.uint8).numpy()
                for head, first, end in _blocks(meta):
                    if end > start and first < take:
                        if first >= start and end - start <= target.shape[2]:
                            out = target_bytes[head, first - start:end - start]
                            self.written = max(self.written, cache_row + end - start)
                        else:
                            scratch = torch.empty((end - first, meta.shape[-1]), dtype=meta.dtype)
                            copies.append((scratch, target[0, head], first, end))
                            out = _bytes(scratch)
                        outs.append((index, sealed.nonces[index], blob[offsets[index]:offsets[index + 1]], out))
                    index += 1
            if opening is not None and isinstance(cache.layers[layer_index], GrowableKVLayer):
                later.append((layer_index, self.sealer.open_jobs_at(entry.scope, entry.span.origin, outs),
                              functools.partial(_place, copies, start, take)))
                cache.layers[layer_index].opening = functools.partial(opening.wait, layer_index)
                outs, copies = [], []
        for layer_index, layer_jobs, after in later:
            assert opening is not None
            opening.add(layer_index, handle, self.sealer.open_later(layer_jobs), after)
        jobs = self.sealer.open_jobs_at(entry.scope, entry.span.origin, outs)
        try:
            self.sealer.run_open(jobs)
        except SealError:
            self.open_failures += 1
            raise SealedEntryError([handle]) from None
        finally:
            _place(copies, start, take)
        adapter.finish_rows(cache, take - start)

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
        """Seal one part in batches of messages; False (nothing changed) when `stop()` interrupts it."""
        assert self.sealer is not None
        tensors = _tensors(part.plain)
        # One head's rows are contiguous also in a view of the working buffers: sealed where they lie.
        messages = [_bytes(m if m.is_contiguous() else m.contiguous())
                    for t in tensors for m in (_part(t, b) for b in _blocks(t))]
        blob = self.memory.blob(sum(m.nbytes for m in messages) + TAG_BYTES * len(messages))
        nonces: list[bytes] = []
        place = Place(handle, entry.start, entry.end, kind)
        offset = 0
        for first, last in _batches([m.nbytes for m in messages], SEAL_BATCH_BYTES):
            if first and stop():
                blob.wipe()
                return False  # the nonces it took are never used again
            batch = messages[first:last]
            end = offset + sum(m.nbytes + TAG_BYTES for m in batch)
            nonces += self.sealer.seal(entry.scope, place, batch, memoryview(blob.data)[offset:end], first=first)
            offset = end
        skeleton = _map(part.plain, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))
        self._add(part, -1)
        if not part.borrowed:  # the working buffers are the hot working cache: the engine wipes them
            _zero(part.plain)
        rows = entry.end - entry.start if kind == "span" else 0
        offsets = list(itertools.accumulate([0] + [m.nbytes + TAG_BYTES for m in messages]))
        part.plain, part.sealed, part.borrowed = None, _Sealed(blob, nonces, skeleton, offsets), False
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
