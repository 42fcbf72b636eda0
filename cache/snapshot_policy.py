"""Where to take snapshots: the positions at which a later request is likely to diverge.

Prefill runs in chunks that end exactly on these positions, so a snapshot costs a clone, not a recompute.

Three kinds of position, in the order they are kept when two lie closer than `min_gap`:
- the retry point, one token before the prompt's end: an identical prompt sent again (a regenerate, a client's
  retry after a timeout) must compute its last token, whose logits choose the first output token, so it resumes
  there and computes that one token;
- message boundaries and the branch point: where conversations and agents' requests diverge;
- the resume grid, inside long messages and prompts without structure: an edit late in a long system prompt or
  document resumes at the grid point before it. The grid's spacing is `interval` up to `widen` intervals in, then
  widens with the position: at most `1 / widen` of the position, in whole intervals. An edit at position p so
  recomputes fewer than max(interval, p / widen) tokens before it; with the defaults (128, 4) a prompt of 2k, 8k
  and 32k tokens holds 11, 18 and 24 grid snapshots, where a fixed 128 would take 16, 64 and 256. A snapshot of
  a recurrent layer is a fixed-size copy of its state whatever the position, so the grid's memory grows with
  the logarithm of the prompt, not with its length.
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
    """One token before the end of the prompt: an identical prompt sent again resumes there."""
    reply_end: bool = True
    """The end of the generated reply: the end of everything stored, where the next turn continues."""
    interval: int = 128
    """The resume grid's spacing near the start; 0 turns the grid off."""
    widen: int = 4
    """Past `widen` intervals the grid's spacing is at most 1/widen of the position; 0: a fixed interval."""
    anywhere: bool = True
    """Models whose layers all keep spans resume at any covered position, not only at snapshots."""
    min_gap: int = 16
    """A position closer than this to a kept one is dropped: a divergence between the two then costs at most this
    many tokens, while every cut costs a forward pass of its own (a 207-token prefill of a 64 M hybrid cut as
    10 + 18 + 174 + 5 took a third longer than in one pass)."""

    @classmethod
    def named(cls, name: str, interval: int = 128) -> SnapshotPolicy:
        """`ours` (the default), `interval` (a fixed interval only) or `exact` (plain extension: only where a
        stored prompt-and-reply ends)."""
        if interval < 0:
            raise PolicyError("the snapshot interval must be 0 (off) or a positive number of tokens")
        if name == "ours":
            return cls(interval=interval)
        if name == "interval":
            return cls(boundaries=False, branch_points=False, prompt_end=False, reply_end=False,
                       interval=interval or 512, widen=0)
        if name == "exact":
            return cls(boundaries=False, branch_points=False, prompt_end=False, reply_end=True, interval=0,
                       anywhere=False)
        raise PolicyError(f"unknown reuse policy {name!r}; choose ours, interval or exact")

    def grid(self, end: int) -> list[int]:
        """The resume grid's positions in `(0, end]`; the same for every prompt, so that requests sharing a
        prefix snapshot it at the same places."""
        positions: list[int] = []
        if not self.interval:
            return positions
        position = self.interval
        while position <= end:
            positions.append(position)
            step = position // self.widen // self.interval * self.interval if self.widen else 0
            position += max(self.interval, step)
        return positions

    def prompt_positions(self, start: int, end: int, boundaries: Iterable[int], branch: int) -> list[int]:
        """Snapshot positions in `(start, end]` for a prompt of `end` tokens computed from `start`."""
        retry = {end - 1} if self.prompt_end and end > 1 else set()
        structure = set(boundaries) if self.boundaries else set()
        if self.branch_points and branch:
            structure.add(branch)
        kept: list[int] = []
        for tier in (retry, structure, set(self.grid(end))):
            # Within a tier the later position wins: it leaves less to recompute for whoever diverges after both.
            for position in sorted((p for p in tier if start < p <= end), reverse=True):
                if all(abs(position - other) >= self.min_gap for other in kept):
                    kept.append(position)
        return sorted(kept)
