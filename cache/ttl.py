"""How long a request's stored state is held: the time-to-live classes callers choose, and a request's write plan.

A caller chooses per request: Anthropic's `cache_control.ttl` (`5m`, `1h`) on breakpoints, OpenAI's
`prompt_cache_retention` (`in_memory`: the caller's default, `24h`). The class is billed (each has its write
price, `metering/pricing.py`) and signed in the usage record, so it is named here once for every layer. The prefix
index takes the plan as `Hold`s (`cache/prefix_cache.py`): positions and seconds, never a class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cache.prefix_cache import Hold

TtlClass = Literal["default", "5m", "1h", "24h"]
"""`default`: the caller's time to live (`callers.NAME.ttl_s`, else the node's `cache.default_ttl_s`)."""
TTL_SECONDS: dict[TtlClass, float | None] = {"default": None, "5m": 300.0, "1h": 3600.0, "24h": 86400.0}
"""Seconds each class holds state after its last use; None: the caller's default, known when it expires."""
PRICED_CLASSES: tuple[TtlClass, ...] = ("1h", "24h")
"""Classes whose writes have a price of their own; `default` and `5m` writes are at the plain write price."""


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """Anthropic's `cache_control`: the prompt's first `end` tokens are stored, held for `ttl`."""

    end: int
    ttl: TtlClass


@dataclass(frozen=True, slots=True)
class WritePlan:
    """What a request stores and for how long.

    Without breakpoints (OpenAI's dialect, or Anthropic's without `cache_control`) everything it computed is
    stored, prompt and reply, held for `ttl`. With breakpoints only the prompt up to the last one is: each
    token for the longest class of the breakpoints at or after it (a longer class is never shortened by a
    shorter one over the same prefix).
    """

    ttl: TtlClass = "default"
    breakpoints: tuple[Breakpoint, ...] = ()
    """Ascending by `end`; each `end` at least 1."""

    def __post_init__(self) -> None:
        ends = [point.end for point in self.breakpoints]
        assert ends == sorted(ends) and all(end > 0 for end in ends), "breakpoints come in prompt order"

    @property
    def limit(self) -> int | None:
        """Tokens stored at most; None: all the request computed."""
        return self.breakpoints[-1].end if self.breakpoints else None

    def holds(self, stored: int) -> list[Hold]:
        """The prefix index's holds for `stored` tokens stored under this plan."""
        if not self.breakpoints:
            return [(stored, TTL_SECONDS[self.ttl])]
        return [(point.end, TTL_SECONDS[point.ttl]) for point in self.breakpoints]

    def class_at(self, position: int) -> TtlClass:
        """The class token `position` is written under."""
        covering = [point.ttl for point in self.breakpoints if point.end > position]
        if not covering:
            return self.ttl
        return max(covering, key=_rank)

    def written(self, start: int, end: int) -> dict[TtlClass, int]:
        """Tokens `[start, end)`, newly written, counted by class (classes with none left out)."""
        counts: dict[TtlClass, int] = {}
        if end <= start:
            return counts
        edges = sorted({start, end, *(point.end for point in self.breakpoints if start < point.end < end)})
        for low, high in zip(edges, edges[1:], strict=False):
            ttl = self.class_at(low)
            counts[ttl] = counts.get(ttl, 0) + high - low
        return counts


AUTOMATIC = WritePlan()
"""Everything stored for the caller's default time to live: the node's behaviour when a request chooses nothing."""


def _rank(ttl: TtlClass) -> float:
    seconds = TTL_SECONDS[ttl]
    return 0.0 if seconds is None else seconds
