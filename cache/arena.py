"""The state arena: stored span state by handle, with exact byte accounting per scope.

Only the arena and the adapters hold tensors. Handles are plain ints so the prefix index can keep them
without knowing what they point to.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import NewType

from cache.adapters import ModelStateAdapter, SpanState

SpanHandle = NewType("SpanHandle", int)


@dataclass(frozen=True, slots=True)
class Scope:
    """Whose state this is: lookups never cross scopes."""

    caller: str
    model: str


class StateArena:
    """Holds span state in memory; `bytes_total` and `bytes_of_caller` are sums of tensor bytes."""

    def __init__(self) -> None:
        self._states: dict[SpanHandle, SpanState] = {}
        self._sizes: dict[SpanHandle, int] = {}
        self._owners: dict[SpanHandle, Scope] = {}
        self._caller_bytes: defaultdict[str, int] = defaultdict(int)
        self._next = itertools.count(1)
        self.bytes_total = 0

    def put(self, scope: Scope, state: SpanState) -> SpanHandle:
        handle = SpanHandle(next(self._next))
        size = ModelStateAdapter.nbytes(state)
        self._states[handle], self._sizes[handle], self._owners[handle] = state, size, scope
        self._caller_bytes[scope.caller] += size
        self.bytes_total += size
        return handle

    def get(self, handle: SpanHandle) -> SpanState:
        return self._states[handle]

    def free(self, handle: SpanHandle) -> int:
        """Drop a span's state; returns the bytes released."""
        size = self._sizes.pop(handle)
        scope = self._owners.pop(handle)
        del self._states[handle]
        self._caller_bytes[scope.caller] -= size
        if not self._caller_bytes[scope.caller]:
            del self._caller_bytes[scope.caller]
        self.bytes_total -= size
        return size

    def replace(self, handle: SpanHandle, parts: tuple[SpanState, SpanState]) -> tuple[SpanHandle, SpanHandle]:
        """Swap one span for its two halves (after a split), keeping the owner."""
        scope = self._owners[handle]
        self.free(handle)
        return self.put(scope, parts[0]), self.put(scope, parts[1])

    def bytes_of_caller(self, caller: str) -> int:
        return self._caller_bytes.get(caller, 0)

    def __len__(self) -> int:
        return len(self._states)
