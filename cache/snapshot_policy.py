"""Where to take snapshots: the positions at which a later request is likely to diverge.

Prefill runs in chunks that end exactly on these positions, so a snapshot costs a clone, not a recompute.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


class PolicyError(ValueError):
    """An unknown reuse policy name or a negative interval."""


@dataclass(frozen=True, slots=True)
class SnapshotPolicy:
    boundaries: bool = True
    """Every message boundary of the rendered chat template."""
    branch_points: bool = True
    """Where a prompt left the stored tokens: the next request may leave them there too."""
    ends: bool = True
    """The end of the prompt and the end of the generated reply."""
    interval: int = 256
    """Every `interval` tokens, for prompts without message structure; 0 turns it off."""
    always_interval: bool = False
    """Take interval snapshots for structured prompts too."""
    anywhere: bool = True
    """Models whose layers all keep spans resume at any covered position, not only at snapshots."""

    @classmethod
    def named(cls, name: str, interval: int = 256) -> SnapshotPolicy:
        """`ours` (the default), `interval` (a fixed interval only) or `exact` (ends of stored sequences only)."""
        if interval < 0:
            raise PolicyError("the snapshot interval must be 0 (off) or a positive number of tokens")
        if name == "ours":
            return cls(interval=interval)
        if name == "interval":
            return cls(boundaries=False, branch_points=False, ends=False, interval=interval or 512,
                       always_interval=True)
        if name == "exact":
            return cls(boundaries=False, branch_points=False, ends=True, interval=0, anywhere=False)
        raise PolicyError(f"unknown reuse policy {name!r}; choose ours, interval or exact")

    def prompt_positions(self, start: int, end: int, boundaries: Iterable[int], branch: int) -> list[int]:
        """Snapshot positions in `(start, end]` for a prompt of `end` tokens computed from `start`."""
        boundaries = tuple(boundaries)
        positions: set[int] = set()
        if self.boundaries:
            positions.update(boundaries)
        if self.branch_points and branch:
            positions.add(branch)
        if self.ends:
            positions.add(end)
        if self.interval and (self.always_interval or not boundaries):
            positions.update(range(self.interval, end + 1, self.interval))
        return sorted(p for p in positions if start < p <= end)
