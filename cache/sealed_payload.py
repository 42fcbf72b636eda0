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
from cache.device_copy import PAGEABLE, HostCopies, byte_view, to_device, to_host
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


def _on(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor of `meta`'s shape and dtype on `device`, one element expanded (nothing allocated per row)."""
    return torch.empty((), dtype=meta.dtype, device=device).expand(meta.shape)


def _place(copies: list[tuple[torch.Tensor, torch.Tensor, int, int]], start: int, take: int) -> None:
    """Copy rows `[start, take)` of blocks opened into scratch (scratch, its target's rows from `start` on, the
    scratch's first and end row; rows on dim -2: a head's block, or all heads' rows staged for a device) into
    place, and zero the scratch."""
    for scratch, row_target, first, end in copies:
        low, high = max(first, start), min(end, take)
        to_device(scratch[..., low - first:high - first, :], row_target[..., low - start:high - start, :])
        scratch.zero_()


@dataclass(slots=True)
class SealedPayload:
    blob: Blob
    nonces: list[bytes]
    skeleton: Any
    """The payload's structure with meta tensors: shapes and dtypes, no data."""
    offsets: list[int]
    """Where each message starts in the blob, and its end: one more than the messages."""
    device: torch.device
    """Where the plaintext was, and where it opens to."""


class _HostSide:
    """A payload's tensors as the cipher reads them: where they lie in host memory, else staged there one tensor
    at a time (`HostCopies`), each staging zeroed once its messages are sealed."""

    def __init__(self, tensors: list[torch.Tensor], copies: HostCopies) -> None:
        self._tensors = tensors
        self._copies = copies
        self._staged: dict[int, torch.Tensor] = {}

    def tensor(self, index: int) -> torch.Tensor:
        tensor = self._tensors[index]
        if not self._copies.staged(tensor.device):
            return tensor
        if index not in self._staged:
            self._staged[index] = to_host(tensor, self._copies.staging(tuple(tensor.shape), tensor.dtype))
        return self._staged[index]

    def done_before(self, index: int) -> None:
        """Zero and let go the staging of the tensors before `index`: their messages are all sealed."""
        for staged in [staged for staged in self._staged if staged < index]:
            self._staged.pop(staged).zero_()

    def wipe(self) -> None:
        self.done_before(len(self._tensors))


def seal_payload(sealer: Sealer, memory: BlobMemory, scope: Scope, place: Place, plain: Any,
                 stop: Callable[[], bool], host_copies: HostCopies = PAGEABLE) -> SealedPayload | None:
    """`plain` sealed under `scope` at `place` into a blob of `memory`, in batches of about `SEAL_BATCH_BYTES`;
    None (the blob wiped, `plain` untouched) when `stop()`, asked between two batches, interrupts it. The caller
    zeroes the plaintext it replaces; tensors on a device are sealed from host staging (`host_copies`), zeroed
    here."""
    tensors = payload_tensors(plain)
    parts = [(index, block) for index, t in enumerate(tensors) for block in _blocks(t)]
    sizes = [_part(tensors[index], block).nbytes for index, block in parts]
    blob = memory.blob(sum(sizes) + TAG_BYTES * len(sizes))
    nonces: list[bytes] = []
    offset = 0
    host = _HostSide(tensors, host_copies)
    try:
        for first, last in _batches(sizes, SEAL_BATCH_BYTES):
            if first and stop():
                blob.wipe()
                return None  # the nonces it took are never used again
            # One head's rows are contiguous also in a view of the working buffers: sealed where they lie.
            batch = [byte_view(m if m.is_contiguous() else m.contiguous())
                     for m in (_part(host.tensor(index), block) for index, block in parts[first:last])]
            end = offset + sum(m.nbytes + TAG_BYTES for m in batch)
            nonces += sealer.seal(scope, place, batch, memoryview(blob.data)[offset:end], first=first)
            offset = end
            host.done_before(parts[last - 1][0])
    finally:
        host.wipe()
    skeleton = map_payload(plain, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))
    offsets = list(itertools.accumulate([0] + [size + TAG_BYTES for size in sizes]))
    return SealedPayload(blob, nonces, skeleton, offsets, tensors[0].device if tensors else torch.device("cpu"))


def open_payload(sealer: Sealer, scope: Scope, origin: Place, sealed: SealedPayload,
                 host_copies: HostCopies = PAGEABLE) -> Any:
    """The whole payload opened into fresh tensors on the device it was sealed from (through host staging,
    `host_copies`, zeroed here); raises SealError, with what it opened zeroed, when a message does not open under
    `scope` at `origin`."""
    staged = host_copies.staged(sealed.device)
    opened = map_payload(sealed.skeleton, lambda t: host_copies.staging(tuple(t.shape), t.dtype) if staged
                         else torch.empty(t.shape, dtype=t.dtype))
    outs = [byte_view(_part(t, b)) for t in payload_tensors(opened) for b in _blocks(t)]
    try:
        sealer.run_open(sealer.open_jobs(scope, origin, sealed.nonces, sealed.blob.data, outs))
    except SealError:
        zero_payload(opened)
        raise
    if not staged:
        return opened
    on_device = map_payload(sealed.skeleton, lambda t: torch.empty(t.shape, dtype=t.dtype, device=sealed.device))
    for host, target in zip(payload_tensors(opened), payload_tensors(on_device), strict=True):
        to_device(host, target)
    zero_payload(opened)
    return on_device


def open_span(sealer: Sealer, sealed: SealedPayload, scope: Scope, origin: Place, adapter: ModelStateAdapter,
              cache: Any, rows: tuple[int, int], *, handle: SpanHandle, opening: Opening | None, last: bool,
              wrote: Callable[[int], None], failed: Callable[[], None], host_copies: HostCopies = PAGEABLE
              ) -> None:
    """Open rows `[start, take)` (`rows`) of a sealed span's tensors into the working cache: whole blocks straight
    into the layers' buffers, a block cut by `start` or `take` through a scratch block. With `opening`, the
    messages of pooled layers are handed to the sealing threads in layer order and left opening there (named
    `handle` when they fail), once all are built: threads woken while the rest are still being built take the
    interpreter lock from it back and forth. `last`: no span is restored after this one. `wrote(row)` hears, before
    anything opens, the end row in the cache of each block opened in place: those rows hold plaintext whether or
    not the opening succeeds. A message opened now that does not open is counted (`failed()`) and raises
    SealedEntryError naming `handle`. Buffers on a device (`host_copies`) are opened into host staging, all blocks
    of a layer's keys or values in one, copied to the device where a scratch block would be (then zeroed)."""
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
        # The skeleton's meta tensors stand on the device the state opens to: fresh buffers are made there.
        *targets, cache_row = adapter.span_rows(cache, layer_index, _on(keys, sealed.device),
                                                _on(values, sealed.device), take - start, spare=BLOCK_TOKENS)
        for meta, target in ((keys, targets[0]), (values, targets[1])):
            # Rows `[low, low + room)` of the span are writable in `into`, `[heads, rows, head_dim]`.
            into, low, room = target[0], start, target.shape[2]
            staged = host_copies.staged(target.device)
            if staged:  # staging from the first block's first row to the last block's end: every block fits
                low = start - start % BLOCK_TOKENS
                room = min(take + (-take) % BLOCK_TOKENS, meta.shape[2]) - low
                into = host_copies.staging((meta.shape[1], room, meta.shape[-1]), meta.dtype)
                copies.append((into, target[0], low, low + room))
                wrote(cache_row + take - start)
            # One byte view of the layer's rows, `[heads, rows, head_dim * itemsize]`: a message's target is
            # a slice of it (a head's rows are contiguous), far cheaper than a tensor view per message.
            target_bytes = into.view(torch.uint8).numpy()
            for head, first, end in _blocks(meta):
                if end > start and first < take:
                    if first >= low and end - low <= room:
                        out = target_bytes[head, first - low:end - low]
                        if not staged:
                            wrote(cache_row + end - start)
                    else:
                        scratch = torch.empty((end - first, meta.shape[-1]), dtype=meta.dtype)
                        copies.append((scratch, target[0, head], first, end))
                        out = byte_view(scratch)
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
