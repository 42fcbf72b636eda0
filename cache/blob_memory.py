"""Memory for sealed state, reserved at start.

Every sealed entry's ciphertext needs memory. Allocated fresh, it is populated and locked when it is made
(`mlockall(MCL_FUTURE)`, `node/hygiene.py`), in the engine's thread, while the callers of the wave that just ended
wait for their next turns. On a VM whose free memory the host has taken back (virtio-balloon's free page
reporting) each fresh page costs a fault the host serves, which can cost more than the rest of sealing
(`node/engine/BATCHING.md`, "Fresh memory on a VM"; RESULTS.md, 2026-12-03). vLLM reserves its KV cache at start too.

`BlobMemory` holds slabs written once at start (`cache.reserve_bytes`, as the lanes are, `limits.lane_bytes`) and
hands out their byte ranges first fit; an entry that goes gives its range back zeroed, for the next ciphertext. A
blob larger than a slab, or one that finds no free range, is allocated on its own, as before. Only ciphertext and
zeros live in the slabs.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

SLAB_BYTES = 32 * 1024 * 1024
"""Bytes of one slab. A turn of a conversation seals a few MiB, a 1k-token prompt 31 MiB on the default model; a
longer prompt's span is allocated on its own."""
ALIGN = 64


@dataclass(slots=True)
class Blob:
    """Ciphertext, shared by the halves of a split sealed span; `wipe`d when the last of them goes: zeroed, then
    its range given back (`release`, where it came from a `BlobMemory`)."""

    data: bytearray | memoryview
    users: int = 1
    release: Callable[[], None] | None = None

    def wipe(self) -> None:
        if len(self.data):
            torch.frombuffer(self.data, dtype=torch.uint8).zero_()
        if self.release is not None:
            self.release()
            self.release = None


class BlobMemory:
    """Free ranges of slabs written at start, taken first fit. Used from the arena's thread only, as the arena is."""

    def __init__(self) -> None:
        self._slabs: list[torch.Tensor] = []
        self._free: list[list[tuple[int, int]]] = []
        """Per slab, its free `[start, end)` ranges in order, none adjacent."""
        self.free_bytes = 0

    @property
    def reserved_bytes(self) -> int:
        return len(self._slabs) * SLAB_BYTES

    def reserve(self, nbytes: int) -> int:
        """Write slabs of zeros until at least `nbytes` are reserved (whole slabs); returns the bytes reserved."""
        while self.reserved_bytes < nbytes:
            self._slabs.append(torch.zeros(SLAB_BYTES, dtype=torch.uint8))
            self._free.append([(0, SLAB_BYTES)])
            self.free_bytes += SLAB_BYTES
        return self.reserved_bytes

    def blob(self, nbytes: int) -> Blob:
        """A blob of `nbytes`: a free range, given back when the blob is wiped, else a new `bytearray`."""
        taken = self.take(nbytes)
        if taken is None:
            return Blob(bytearray(nbytes))
        return Blob(taken[0], 1, functools.partial(self.give, taken[1]))

    def take(self, nbytes: int) -> tuple[memoryview, tuple[int, int, int]] | None:
        """A writable view of `nbytes` reserved bytes (zeros or old zeroed ciphertext) and its place, for `give`;
        None where no free range holds it."""
        size = -(-nbytes // ALIGN) * ALIGN
        for slab, ranges in enumerate(self._free):
            for index, (start, end) in enumerate(ranges):
                if end - start >= size:
                    if end - start == size:
                        del ranges[index]
                    else:
                        ranges[index] = (start + size, end)
                    self.free_bytes -= size
                    view = memoryview(self._slabs[slab].numpy())[start:start + nbytes]  # type: ignore[arg-type]
                    return view, (slab, start, start + size)
        return None

    def give(self, place: tuple[int, int, int]) -> None:
        """Take back a range from `take`, which the caller has zeroed."""
        slab, start, end = place
        ranges = self._free[slab]
        index = bisect.bisect(ranges, (start, end))
        if index < len(ranges) and ranges[index][0] == end:  # joins the next range
            end = ranges.pop(index)[1]
        if index and ranges[index - 1][1] == start:  # and the one before
            index -= 1
            start = ranges.pop(index)[0]
        ranges.insert(index, (start, end))
        self.free_bytes += place[2] - place[1]
