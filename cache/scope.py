"""Whose state an entry is, and the plain handle by which the prefix index names it; no tensors here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

SpanHandle = NewType("SpanHandle", int)


@dataclass(frozen=True, slots=True)
class Scope:
    """Whose state this is: lookups never cross scopes."""

    caller: str
    model: str
