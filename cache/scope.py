"""Whose state an entry is, and the plain handle by which the prefix index names it; no tensors here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NewType

SpanHandle = NewType("SpanHandle", int)


@dataclass(frozen=True, slots=True)
class Scope:
    """Whose state this is: lookups never cross scopes."""

    caller: str
    model: str


def past_ttl(scope: Scope, used: float, ttl_of: Callable[[str], float | None], now: float) -> bool:
    """Whether `scope`, last used at `used`, has been idle longer than its caller's time to live (None: no limit)."""
    ttl = ttl_of(scope.caller)
    return ttl is not None and now - used > ttl
