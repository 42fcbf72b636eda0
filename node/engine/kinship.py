"""What one caller's running requests share, and never another caller's (see BATCHING.md, "One caller's
sequences"): a request copies the prompt rows another running request of its scope holds (`best_donor`,
`copy_rows`), and decoding sequences of one scope that hold the same first rows attend them once per batched
step (`Kinship`). Every comparison here is between requests of one scope.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import DynamicCache

from cache.arena import Scope
from cache.radix_tree import common_prefix_length
from cache.working_cache import GrowableKVLayer
from node.engine.batch_forward import Shared, equal_rows

if TYPE_CHECKING:
    from node.engine.runner import GenerationRequest, Running

FOLLOW_MIN = 64
"""Fewest prompt tokens a request copies from a running request of its caller rather than computes."""
SHARED_ROWS_MIN = 256
"""Fewest shared first rows for which sequences attend them together (`Kin`): below, a step saves less than the
extra attention call and merge cost."""


def full_attention(cache: DynamicCache) -> bool:
    return all(type(layer) is GrowableKVLayer for layer in cache.layers)


def best_donor(request: GenerationRequest, live: Iterable[Running]) -> tuple[Running, int] | None:
    """The running request of `request`'s scope whose prompt agrees with `request`'s the longest (at least
    FOLLOW_MIN tokens, at most all but the last), with how far; only requests that keep their state and whose
    layers are all full attention give rows."""
    prompt, best = tuple(request.prompt), None
    reach = FOLLOW_MIN
    for other in live:
        if other.request.scope != request.scope or not other.request.retain or not full_attention(other.cache):
            continue
        common = min(common_prefix_length(tuple(other.request.prompt), prompt), len(prompt) - 1)
        if common >= reach:
            best, reach = other, common + 1
    return None if best is None else (best, reach - 1)


def copy_rows(donor: Running, cache: DynamicCache, start: int, end: int) -> None:
    """Append rows `[start, end)` of `donor`'s working cache (same scope, same tokens there) to `cache`, which
    holds `start` rows."""
    for mine, theirs in zip(cache.layers, donor.cache.layers, strict=True):
        assert isinstance(mine, GrowableKVLayer) and isinstance(theirs, GrowableKVLayer)
        theirs.materialize()
        assert mine.get_seq_length() == start and theirs.keys is not None and theirs.values is not None
        mine.update(theirs.keys[:, :, start:end], theirs.values[:, :, start:end])


@dataclass(eq=False)
class Kin:
    """Decoding sequences of one scope whose full-attention layers hold the same first rows. `rows[lane]`: how
    many, for the member in that lane; every member agrees with every other on the fewer of their two counts.
    A batched decode step attends those rows once for all members in it (`batch_forward.Shared`)."""

    scope: Scope
    rows: dict[int, int]

    def holder(self) -> int:
        """The lane of the member holding the most shared rows."""
        return max(self.rows, key=lambda lane: self.rows[lane])


class Kinship:
    """The groups (`Kin`) of the running sequences, by lane."""

    def __init__(self) -> None:
        self._of: dict[int, Kin] = {}

    def groups(self, seqs: Sequence[Running], live: Mapping[int, Running]) -> list[Shared]:
        """The groups of `seqs` (rows of a batched step, `live` by lane) that hold the same first rows, each with
        the rows all its members in the step share."""
        row_of = {seq.lane: row for row, seq in enumerate(seqs)}
        for seq in seqs:
            if seq.lane not in self._of:
                self._join(seq, live)
        shared = []
        for kin in dict.fromkeys(self._of[seq.lane] for seq in seqs):
            present = [lane for lane in kin.rows if lane in row_of]
            if len(present) > 1:
                shared.append(Shared(tuple(row_of[lane] for lane in present), min(kin.rows[lane] for lane in present)))
        return shared

    def leave(self, lane: int) -> None:
        kin = self._of.pop(lane, None)
        if kin is not None:
            del kin.rows[lane]

    def _join(self, seq: Running, live: Mapping[int, Running]) -> None:
        """Put a sequence that starts decoding into the group of its scope whose first rows it holds too (at
        least SHARED_ROWS_MIN, compared value for value with the group's holder), else into a new group. Only
        sequences of one scope are ever compared."""
        scope, prompt = seq.request.scope, tuple(seq.request.prompt)
        for kin in dict.fromkeys(kin for kin in self._of.values() if kin.scope == scope):
            holder = live[kin.holder()]
            assert holder.request.scope == scope
            limit = min(common_prefix_length(tuple(holder.request.prompt), prompt), kin.rows[holder.lane],
                        seq.position)
            if limit < SHARED_ROWS_MIN:
                continue
            rows = equal_rows(holder.cache, seq.cache, limit)
            if rows >= SHARED_ROWS_MIN:
                kin.rows[seq.lane] = rows
                self._of[seq.lane] = kin
                return
        self._of[seq.lane] = Kin(scope, {seq.lane: seq.position})
