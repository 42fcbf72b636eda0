"""What one caller's running requests share, and never another caller's (see BATCHING.md, "One caller's
sequences"): a request copies the prompt state another running request of its scope holds (`best_donor`,
`copy_rows`, and `held_state` where the model resumes only where it holds a snapshot), and decoding sequences
of one scope that hold the same first rows attend them once per batched step (`Kinship`). Every comparison
here is between requests of one scope.
"""

from __future__ import annotations

from collections import abc
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transformers import DynamicCache

from cache.adapters import ModelStateAdapter, Snapshot, copy_snapshot
from cache.arena import Scope
from cache.radix_tree import common_prefix_length
from cache.state_spec import LayerStateSpec
from cache.working_cache import GrowableKVLayer
from node.engine.batch_forward import Shared, equal_rows

if TYPE_CHECKING:
    from node.engine.sequence import GenerationRequest, Sequence

FOLLOW_MIN = 64
"""Fewest prompt tokens a request copies from a running request of its caller rather than computes."""
SHARED_ROWS_MIN = 256
"""Fewest shared first rows for which sequences attend them together (`Kin`): below, a step saves less than the
extra attention call and merge cost."""


def best_donor(request: GenerationRequest, live: Iterable[Sequence]) -> tuple[Sequence, int] | None:
    """The running request of `request`'s scope whose prompt agrees with `request`'s the longest (at least
    FOLLOW_MIN tokens, at most all but the last), with how far; only requests that keep their state give."""
    prompt, best = tuple(request.keys), None
    reach = FOLLOW_MIN
    for other in live:
        if other.request.scope != request.scope or not other.request.retain:
            continue
        common = min(common_prefix_length(tuple(other.request.keys), prompt), len(prompt) - 1)
        if common >= reach:
            best, reach = other, common + 1
    return None if best is None else (best, reach - 1)


def copy_rows(donor: Sequence, cache: DynamicCache, start: int, end: int, specs: abc.Sequence[LayerStateSpec]) -> None:
    """Append rows `[start, end)` of `donor`'s working cache (same scope, same tokens there) to `cache`, which
    holds `start` rows, in every layer that keeps its tokens' keys and values (`specs`); other layers' state at a
    position is a snapshot's (`held_state`)."""
    mine: Any
    theirs: Any
    for spec, mine, theirs in zip(specs, cache.layers, donor.cache.layers, strict=True):
        if not spec.keeps_spans:
            continue
        if isinstance(theirs, GrowableKVLayer):
            theirs.materialize()
        assert mine.get_seq_length() == start and theirs.keys is not None and theirs.values is not None
        mine.update(theirs.keys[:, :, start:end], theirs.values[:, :, start:end])


def held_state(donor: Sequence, after: int, common: int, adapter: ModelStateAdapter) -> tuple[int, Snapshot | None]:
    """For a model that resumes only where it holds a snapshot: the deepest position in `(after, common]` where
    `donor` holds the state of every layer that is not rows, and a copy of that state (None: no such position,
    `after` is returned). The donor's live state while it prefills up to `common`, else the snapshot it took
    there; copies, since the donor's own go to its store, sealed and zeroed."""
    if donor.prefilling and after < donor.position <= common:
        return donor.position, adapter.snapshot(donor.cache)
    deepest = max((position for position in donor.snapshots if after < position <= min(common, donor.position)),
                  default=None)
    if deepest is None:
        return after, None
    return deepest, copy_snapshot(donor.snapshots[deepest])


def copied_snapshots(donor: Sequence, seq: Sequence, start: int, end: int, adapter: ModelStateAdapter
                     ) -> dict[int, Snapshot]:
    """`seq`'s own snapshots at the positions in `(start, end]` it wants them, once it holds `donor`'s state up to
    `end`: copies of the donor's, and its own state at `end`; so that what it stores resumes there too."""
    own = {position: copy_snapshot(donor.snapshots[position]) for position in seq.wanted
           if start < position < end and position in donor.snapshots}
    if end in seq.wanted:
        own[end] = adapter.snapshot(seq.cache)
    return own


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

    def groups(self, seqs: list[Sequence], live: Mapping[int, Sequence]) -> list[Shared]:
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

    def _join(self, seq: Sequence, live: Mapping[int, Sequence]) -> None:
        """Put a sequence that starts decoding into the group of its scope whose first rows it holds too (at
        least SHARED_ROWS_MIN, compared value for value with the group's holder), else into a new group. Only
        sequences of one scope are ever compared."""
        scope, prompt = seq.request.scope, tuple(seq.request.keys)
        for kin in dict.fromkeys(kin for kin in self._of.values() if kin.scope == scope):
            holder = live[kin.holder()]
            assert holder.request.scope == scope
            limit = min(common_prefix_length(tuple(holder.request.keys), prompt), kin.rows[holder.lane],
                        seq.position)
            if limit < SHARED_ROWS_MIN:
                continue
            rows = equal_rows(holder.cache, seq.cache, limit)
            if rows >= SHARED_ROWS_MIN:
                kin.rows[seq.lane] = rows
                self._of[seq.lane] = kin
                return
        self._of[seq.lane] = Kin(scope, {seq.lane: seq.position})
