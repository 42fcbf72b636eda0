"""When each scope's state was last shredded, so that a request accepted before cannot store into it after.

A caller's `DELETE /v1/cache` (or its key's removal) destroys its state on the engine's worker thread, but its
requests already accepted (rendered, queued, taken for a lane, running) end later and would store their state,
replies and attachment encodings into the scope the caller has just emptied. Each request is stamped with this
clock's `now` when it is accepted (`GenerationRequest.stamp`); a shred moves the clock on and marks the scope (or
caller) with the new time; every store of a request asks `shredded_since` of the one scope it writes. A request
stamped before the shred stores nothing there, one stamped after stores as usual, whatever the order in which they
are admitted. Only the scope's own mark and its caller's are read: whether a request stores never depends on
another scope.

The worker thread alone shreds; the event loop reads `now` to stamp a request (an int read, atomic). The mark is
written before the clock moves, so a request stamped while a shred is under way counts as accepted before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cache.prefix_cache import belongs_to
from cache.scope import Scope


@dataclass(slots=True)
class ShredClock:
    """Counts shreds; remembers, per scope and per removed caller, the count at its last one (an int each, kept for
    the node's life: a request stamped earlier may still be waiting, however long ago that was)."""

    now: int = 0
    """A request accepted now is stamped with this."""
    _scopes: dict[Scope, int] = field(default_factory=dict)
    _callers: dict[str, int] = field(default_factory=dict)
    """Removed callers (a router's: its callers' scopes too, `belongs_to`), and trust groups (`group:NAME`)."""

    def shred(self, scope: Scope) -> None:
        """`scope`'s state was destroyed (`DELETE /v1/cache`)."""
        self._scopes[scope] = self.now + 1
        self.now += 1

    def shred_caller(self, caller: str) -> None:
        """Every scope of `caller` (`belongs_to`) was destroyed: its key, or its trust group, was removed."""
        self._callers[caller] = self.now + 1
        self.now += 1

    def shredded_since(self, scope: Scope, stamp: int) -> bool:
        """Whether `scope` was shredded after a request stamped `stamp` was accepted: it then stores nothing there."""
        if self._scopes.get(scope, 0) > stamp:
            return True
        return any(at > stamp and belongs_to(scope, caller) for caller, at in self._callers.items())
