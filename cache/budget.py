"""Byte budgets of the prefix cache and how it chooses what to evict; pure data, no tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

EvictionPolicy = Literal["lru", "value"]


class BudgetError(ValueError):
    """A cache budget that cannot work (negative)."""


@dataclass(frozen=True, slots=True)
class CacheBudget:
    node_bytes: int
    caller_bytes: int
    eviction: EvictionPolicy = "value"

    def __post_init__(self) -> None:
        if self.node_bytes < 0 or self.caller_bytes < 0:
            raise BudgetError("cache budgets must be zero or positive byte counts")
        if self.eviction not in ("lru", "value"):
            raise BudgetError("cache eviction must be 'lru' or 'value'")
