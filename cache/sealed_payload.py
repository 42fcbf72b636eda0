"""A payload's sealed form: the messages it is cut into, sealed in batches into one blob, opened back whole or
straight into a working cache's buffers; and the walk over a payload's tensors that fixes the messages' order.

A message is one head's rows of K/V, at most `BLOCK_TOKENS` tokens of them, or one index of dim 1 of another
state tensor, each sealed under associated data naming its place (`cache/sealing.py`). This module decides
where each byte goes; the arena (`cache/arena.py`) decides which entry is sealed, when, and under which scope and
place it may open: its entries and tiers are bookkeeping around these bytes, and read apart from them.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from cache.adapters import KVPiece, ModelStateAdapter, RecurrentPiece
from cache.blob_memory import Blob, BlobMemory
from cache.opening import Opening, SealedEntryError
from cache.scope import Scope, SpanHandle
from cache.sealing import TAG_BYTES, Place, Sealer, SealError
from cache.working_cache import GrowableKVLayer

BLOCK_TOKENS = 4096
"""Tokens of one head in one sealed message: 1 MiB at head dim 64 in float32. Fewer, larger messages cost less
Python before the first byte is opened, at the same opening rate (RESULTS.md, 2026-11-30)."""
SEAL_BATCH_BYTES = 8 * 1024 * 1024
"""Plaintext sealed between two looks for a waiting request (whole messages, at least one): a few milliseconds
on all cores. Counted in bytes, not messages: a span of a few hundred tokens has a hundred messages of tens of
KiB, and eight of them a call spent more time handing work to the sealing threads than sealing."""


def map_payload(payload: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The same structure with every tensor replaced by `fn(tensor)`, in a fixed walk order."""
    if payload is None:
        return None
    if isinstance(payload, KVPiece):
        return KVPiece(fn(payload.keys), fn(payload.values))
    if isinstance(payload, RecurrentPiece):
        return RecurrentPiece(tuple(None if t is None else fn(t) for t in payload.conv),
                              tuple(None if t is None else fn(t) for t in payload.recurrent))
    return tuple(map_payload(part, fn) for part in payload)


def payload_tensors(payload: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_payload(payload, lambda t: found.append(t) or t)  # type: ignore[func-returns-value]
    return found


@torch.inference_mode()
def zero_payload(payload: Any) -> None:
    """Overwrite with zeros (in inference mode: the engine's tensors are inference tensors)."""
    for tensor in payload_tensors(payload):
        tensor.zero_()


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


def _place(copies: list[tuple[torch.Tensor, torch.Tensor, int, int]], start: int, take: int) -> None:
    """Copy rows `[start, take)` of blocks opened into scratch (scratch, its head's rows, block's first and end
    row) into place, and zero the scratch."""
    for scratch, row_target, first, end in copies:
        low, high = max(first, start), min(end, take)
        row_target[low - start:high - start].copy_(scratch[low - first:high - first])
        scratch.zero_()


@dataclass(slots=True)
class SealedPayload:
    blob: Blob
    nonces: list[bytes]
    skeleton: Any
    """The payload's structure with meta tensors: shapes and dtypes, no data."""
    offsets: list[int]
    """Where each message starts in the blob, and its end: one more than the messages."""


def seal_payload(sealer: Sealer, memory: BlobMemory, scope: Scope, place: Place, plain: Any,
                 stop: Callable[[], bool]) -> SealedPayload | None:
    """`plain` sealed under `scope` at `place` into a blob of `memory`, in batches of about `SEAL_BATCH_BYTES`;
    None (the blob wiped, `plain` untouched) when `stop()`, asked between two batches, interrupts it. The caller
    zeroes the plaintext it replaces."""
    tensors = payload_tensors(plain)
    # One head's rows are contiguous also in a view of the working buffers: sealed where they lie.
    messages = [_bytes(m if m.is_contiguous() else m.contiguous())
                for t in tensors for m in (_part(t, b) for b in _blocks(t))]
    blob = memory.blob(sum(m.nbytes for m in messages) + TAG_BYTES * len(messages))
    nonces: list[bytes] = []
    offset = 0
    for first, last in _batches([m.nbytes for m in messages], SEAL_BATCH_BYTES):
        if first and stop():
            blob.wipe()
            return None  # the nonces it took are never used again
        batch = messages[first:last]
        end = offset + sum(m.nbytes + TAG_BYTES for m in batch)
        nonces += sealer.seal(scope, place, batch, memoryview(blob.data)[offset:end], first=first)
        offset = end
    skeleton = map_payload(plain, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))
    offsets = list(itertools.accumulate([0] + [m.nbytes + TAG_BYTES for m in messages]))
    return SealedPayload(blob, nonces, skeleton, offsets)


def open_payload(sealer: Sealer, scope: Scope, origin: Place, sealed: SealedPayload) -> Any:
    """The whole payload opened into fresh tensors; raises SealError, with what it opened zeroed, when a message
    does not open under `scope` at `origin`."""
    opened = map_payload(sealed.skeleton, lambda t: torch.empty(t.shape, dtype=t.dtype))
    outs = [_bytes(_part(t, b)) for t in payload_tensors(opened) for b in _blocks(t)]
    try:
        sealer.run_open(sealer.open_jobs(scope, origin, sealed.nonces, sealed.blob.data, outs))
    except SealError:
        zero_payload(opened)
        raise
    return opened


def open_span(sealer: Sealer, sealed: SealedPayload, scope: Scope, origin: Place, adapter: ModelStateAdapter,
              cache: Any, rows: tuple[int, int], *, handle: SpanHandle, opening: Opening | None, last: bool,
              wrote: Callable[[int], None], failed: Callable[[], None]) -> None:
    """Open rows `[start, take)` (`rows`) of a sealed span's tensors into the working cache: whole blocks straight
    into the layers' buffers, a block cut by `start` or `take` through a scratch block. With `opening`, the
    messages of pooled layers are handed to the sealing threads in layer order and left opening there (named
    `handle` when they fail), once all are built: threads woken while the rest are still being built take the
    interpreter lock from it back and forth. `last`: no span is restored after this one. `wrote(row)` hears, before
    anything opens, the end row in the cache of each block opened in place: those rows hold plaintext whether or
    not the opening succeeds. A message opened now that does not open is counted (`failed()`) and raises
    SealedEntryError naming `handle`."""
    start, take = rows
    offsets = sealed.offsets
    outs, copies, index = [], [], 0
    later: list[tuple[int, list[tuple[Any, ...]], Callable[[], None]]] = []
    pieces = iter(payload_tensors(sealed.skeleton))
    blob = memoryview(sealed.blob.data)
    # A block that `take` cuts opens in place past it, over rows the next span or the new tokens write. The
    # new tokens' writes wait for it (`GrowableKVLayer.opening`); a next span's would not: a cut span that is
    # not the last opens now.
    if not last and any(first < take < end for tensor in payload_tensors(sealed.skeleton)[:1]
                        for _, first, end in _blocks(tensor)):
        opening = None
    for layer_index, piece in enumerate(sealed.skeleton):
        if piece is None:
            continue
        keys, values = next(pieces), next(pieces)
        # Rows past `take` in the buffers are free (the new tokens or the next span write there): a block
        # that `take` cuts opens in place when it fits, else through a scratch block.
        *targets, cache_row = adapter.span_rows(cache, layer_index, keys, values, take - start, spare=BLOCK_TOKENS)
        for meta, target in ((keys, targets[0]), (values, targets[1])):
            # One byte view of the layer's rows, `[heads, rows, head_dim * itemsize]`: a message's target is
            # a slice of it (a head's rows are contiguous), far cheaper than a tensor view per message.
            target_bytes = target[0].view(torch.uint8).numpy()
            for head, first, end in _blocks(meta):
                if end > start and first < take:
                    if first >= start and end - start <= target.shape[2]:
                        out = target_bytes[head, first - start:end - start]
                        wrote(cache_row + end - start)
                    else:
                        scratch = torch.empty((end - first, meta.shape[-1]), dtype=meta.dtype)
                        copies.append((scratch, target[0, head], first, end))
                        out = _bytes(scratch)
                    outs.append((index, sealed.nonces[index], blob[offsets[index]:offsets[index + 1]], out))
                index += 1
        if opening is not None and isinstance(cache.layers[layer_index], GrowableKVLayer):
            later.append((layer_index, sealer.open_jobs_at(scope, origin, outs),
                          functools.partial(_place, copies, start, take)))
            cache.layers[layer_index].opening = functools.partial(opening.wait, layer_index)
            outs, copies = [], []
    for layer_index, layer_jobs, after in later:
        assert opening is not None
        opening.add(layer_index, handle, sealer.open_later(layer_jobs), after)
    jobs = sealer.open_jobs_at(scope, origin, outs)
    try:
        sealer.run_open(jobs)
    except SealError:
        failed()
        raise SealedEntryError([handle]) from None
    finally:
        _place(copies, start, take)
    adapter.finish_rows(cache, take - start)
