"""The state arena: stored span and snapshot state by handle, with exact byte accounting per caller.

Only the arena and the adapters hold tensors. Handles are plain ints so the prefix index can keep them
without knowing what they point to. Each handle is one tree node's state: the span of tokens the node
covers, and optionally a snapshot taken at the node's end.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import NewType

from cache.adapters import Snapshot, SpanState, state_bytes

SpanHandle = NewType("SpanHandle", int)


@dataclass(frozen=True, slots=True)
class Scope:
    """Whose state this is: lookups never cross scopes."""

    caller: str
    model: str


@dataclass(slots=True)
class _Entry:
    scope: Scope
    span: SpanState
    snapshot: Snapshot | None
    nbytes: int


class StateArena:
    """Holds state in memory; `bytes_total` and `bytes_of_caller` are sums of tensor bytes."""

    def __init__(self) -> None:
        self._entries: dict[SpanHandle, _Entry] = {}
        self._caller_bytes: defaultdict[str, int] = defaultdict(int)
        self._next = itertools.count(1)
        self.bytes_total = 0
        self.snapshot_bytes = 0
        """The part of `bytes_total` held in snapshots."""

    def _account(self, scope: Scope, delta: int) -> None:
        self._caller_bytes[scope.caller] += delta
        if not self._caller_bytes[scope.caller]:
            del self._caller_bytes[scope.caller]
        self.bytes_total += delta

    def put(self, scope: Scope, span: SpanState, snapshot: Snapshot | None = None) -> SpanHandle:
        handle = SpanHandle(next(self._next))
        size = state_bytes(span) + state_bytes(snapshot)
        self._entries[handle] = _Entry(scope, span, snapshot, size)
        self._account(scope, size)
        self.snapshot_bytes += state_bytes(snapshot)
        return handle

    def span(self, handle: SpanHandle) -> SpanState:
        return self._entries[handle].span

    def snapshot(self, handle: SpanHandle) -> Snapshot | None:
        return self._entries[handle].snapshot

    def nbytes(self, handle: SpanHandle) -> int:
        return self._entries[handle].nbytes

    def attach_snapshot(self, handle: SpanHandle, snapshot: Snapshot) -> None:
        """Keep `snapshot` as the state at the end of this handle's span (once; a second is ignored)."""
        entry = self._entries[handle]
        if entry.snapshot is None:
            size = state_bytes(snapshot)
            entry.snapshot, entry.nbytes = snapshot, entry.nbytes + size
            self._account(entry.scope, size)
            self.snapshot_bytes += size

    def drop_snapshot(self, handle: SpanHandle) -> int:
        entry = self._entries[handle]
        size = state_bytes(entry.snapshot)
        entry.snapshot, entry.nbytes = None, entry.nbytes - size
        self._account(entry.scope, -size)
        self.snapshot_bytes -= size
        return size

    def free(self, handle: SpanHandle) -> int:
        """Drop a handle's state; returns the bytes released."""
        entry = self._entries.pop(handle)
        self._account(entry.scope, -entry.nbytes)
        self.snapshot_bytes -= state_bytes(entry.snapshot)
        return entry.nbytes

    def split(self, handle: SpanHandle, parts: tuple[SpanState, SpanState]) -> tuple[SpanHandle, SpanHandle]:
        """Swap one span for its two halves; the snapshot stays at the end, with the second half."""
        entry = self._entries[handle]
        self.free(handle)
        return self.put(entry.scope, parts[0]), self.put(entry.scope, parts[1], entry.snapshot)

    def bytes_of_caller(self, caller: str) -> int:
        return self._caller_bytes.get(caller, 0)

    def __len__(self) -> int:
        return len(self._entries)
