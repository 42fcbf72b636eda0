"""Runners over a sealed prefix cache whose keep-or-drop choice does not hang on this machine's speed.

A runner measures at construction whether opening a sealed entry beats computing its tokens again
(`seal_cost.py`); on a fast CPU shared with other test processes the small test models can compute faster than
they open, and the runner then keeps nothing (a CI run saw 0 cached writes where 64 were due). Tests of reuse
pin the choice; the tests of the choice itself measure.
"""

from __future__ import annotations

from typing import Any

from cache.arena import SealCost, new_prefix_cache
from cache.budget import CacheBudget
from node.engine.loader import LoadedModel
from node.engine.runner import Runner

KEEP_ALL = SealCost(0.0, 1.0, 1, 1)
"""Every entry worth sealing, whatever this machine measures."""


def sealed_runner(loaded: LoadedModel, budget_bytes: int = 1 << 30, **kwargs: Any) -> Runner:
    """A runner storing every caller's state sealed, within `budget_bytes` per caller and for the node."""
    kwargs.setdefault("seal_cost", KEEP_ALL)
    return Runner(loaded, new_prefix_cache(CacheBudget(budget_bytes, budget_bytes)), **kwargs)
