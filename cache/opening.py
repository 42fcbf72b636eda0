"""Sealed rows of one restore that open while the forward that reads them starts.

A sealed hit used to open all its rows before its first chunk ran. Its forward reads them a layer at a time,
so the arena hands each layer's messages to the sealing threads in the forward's order and returns: the first
layer computes while the later ones open. A layer waits for its own rows when its attention first reads them
(`GrowableKVLayer.opening`: the native forward calls it between layers, transformers' through `keys` and
`values`), and the runner calls `finish` after the chunk, before anything else reads the cache. A message that
fails authentication is found there, not during the restore: the chunk's result is thrown away and the
request starts over without the entry, as after a failed restore.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from cache.scope import SpanHandle
from cache.sealing import SealError


class SealedEntryError(SealError):
    """Entries of a restore failed authentication; `handles` names them, to drop."""

    def __init__(self, handles: list[SpanHandle]) -> None:
        super().__init__(f"{len(handles)} sealed entr{'y' if len(handles) == 1 else 'ies'} failed authentication")
        self.handles = handles


class Opening:
    """The openings of one restore still in flight, by layer of the working cache."""

    def __init__(self, on_failure: Callable[[], None]) -> None:
        self._layers: dict[int, list[tuple[SpanHandle, list[Future[None]], Callable[[], None]]]] = {}
        self._failed: list[SpanHandle] = []
        self._on_failure = on_failure
        self.lease: Any = None
        """What keeps the entries stored until they are open (the runner's lease), released after `finish`."""

    def add(self, layer: int, handle: SpanHandle, futures: list[Future[None]], after: Callable[[], None]) -> None:
        """Messages of `handle` opening into `layer`'s rows (`futures`); `after` runs once they are done (rows
        opened through a scratch block are copied into place there)."""
        self._layers.setdefault(layer, []).append((handle, futures, after))

    @property
    def layers(self) -> list[int]:
        return sorted(self._layers)

    def wait(self, layer: int) -> None:
        """Block until `layer`'s rows are open. A failure is only recorded: `finish` raises it."""
        for handle, futures, after in self._layers.pop(layer, ()):
            for future in futures:
                try:
                    future.result()
                except SealError:
                    if handle not in self._failed:
                        self._failed.append(handle)
                        self._on_failure()
            after()

    def settle(self) -> None:
        """Wait for every layer, whether or not it opens: afterwards no thread writes into the cache."""
        try:
            self.finish()
        except SealedEntryError:
            pass

    def finish(self) -> None:
        """Wait for every layer; raise SealedEntryError naming the entries that failed to open (the cache's rows
        from them are then unusable)."""
        for layer in self.layers:
            self.wait(layer)
        if self._failed:
            raise SealedEntryError(list(self._failed))
