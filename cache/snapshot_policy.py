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
    prompt_end: bool = True
    """The end of the prompt: a retry, or a reply re-sent with changes, resumes there."""
    reply_end: bool = True
    """The end of the generated reply: the end of everything stored, where the next turn continues."""
    interval: int = 256
    """Every `interval` tokens, for prompts without message structure; 0 turns it off."""
    always_interval: bool = False
    """Take interval snapshots for structured prompts too."""
    anywhere: bool = True
    """Models whose layers all keep spans resume at any covered position, not only at snapshots."""
    min_gap: int = 16
    """A position closer than this to the next one is dropped: a divergence between the two then costs at
    most this many tokens, while every cut costs a forward pass of its own (on a 64 M hybrid on one CPU
    thread a 207-token prefill took 299 ms in one pass and 396 ms cut as 10 + 18 + 174 + 5)."""

    @classmethod
    def named(cls, name: str, interval: int = 256) -> SnapshotPolicy:
        """`ours` (the default), `interval` (a fixed interval only) or `exact` (plain extension: only where a
        stored prompt-and-reply ends)."""
        if interval < 0:
            raise PolicyError("the snapshot interval must be 0 (off) or a positive number of tokens")
        if name == "ours":
            return cls(interval=interval)
        if name == "interval":
            return cls(boundaries=False, branch_points=False, prompt_end=False, reply_end=False,
                       interval=interval or 512, always_interval=True)
        if name == "exact":
            return cls(boundaries=False, branch_points=False, prompt_end=False, reply_end=True, interval=0,
                       anywhere=False)
        raise PolicyError(f"unknown reuse policy {name!r}; choose ours, interval or exact")

    def prompt_positions(self, start: int, end: int, boundaries: Iterable[int], branch: int) -> list[int]:
        """Snapshot positions in `(start, end]` for a prompt of `end` tokens computed from `start`."""
        boundaries = tuple(boundaries)
        positions: set[int] = set()
        if self.boundaries:
            positions.update(boundaries)
        if self.branch_points and branch:
            positions.add(branch)
        if self.prompt_end:
            positions.add(end)
        if self.interval and (self.always_interval or not boundaries):
            positions.update(range(self.interval, end + 1, self.interval))
        kept: list[int] = []
        for position in sorted((p for p in positions if start < p <= end), reverse=True):
            if not kept or kept[-1] - position >= self.min_gap:
                kept.append(position)
        return kept[::-1]
