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


GROUP = "group:"
"""Starts the caller name of a trust group's scope (`group:NAME`). Caller names never hold ':', so a group's scope
is told apart from every caller's, and is never any caller's own."""


def group_scope(group: str, model: str) -> Scope:
    """The scope holding the prefixes the members of trust group `group` share: sealed under its own key, as every
    scope's state is, and looked up only for a request of a member that asks for it (`SharedPrefix`)."""
    return Scope(caller=GROUP + group, model=model)


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """A request's prompt up to `length` belongs in its trust group's `scope`: it is resumed from there and stored
    there, billed to the member who wrote it; what follows stays in the caller's own scope."""

    scope: Scope
    length: int
    """Prompt tokens `[0, length)` shared: at least 1, at most the prompt's length."""


def past_ttl(scope: Scope, used: float, ttl_of: Callable[[str], float | None], now: float) -> bool:
    """Whether `scope`, last used at `used`, has been idle longer than its caller's time to live (None: no limit)."""
    ttl = ttl_of(scope.caller)
    return ttl is not None and now - used > ttl
