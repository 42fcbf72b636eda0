"""The shred clock: a stamp taken before a scope's (or its caller's) shred is past it, one taken after is not, and
no other scope's shred counts."""

from __future__ import annotations

from cache.scope import Scope, group_scope
from cache.shred_clock import ShredClock

ALICE, BOB = Scope("alice", "m"), Scope("bob", "m")
ROUTED = Scope("r1/alice", "m")
"""A caller a router `r1` acts for."""


def test_a_stamp_before_a_scopes_shred_is_past_it_and_one_after_is_not() -> None:
    clock = ShredClock()
    early = clock.now
    assert early == 0 and not clock.shredded_since(ALICE, early)
    clock.shred(ALICE)
    late = clock.now
    assert late == 1
    assert (clock.shredded_since(ALICE, early), clock.shredded_since(ALICE, late)) == (True, False)
    assert not clock.shredded_since(BOB, early)  # another scope's shred is not its
    assert not clock.shredded_since(Scope("alice", "other-model"), early)
    clock.shred(BOB)
    assert (clock.shredded_since(ALICE, late), clock.shredded_since(BOB, late)) == (False, True)
    clock.shred(ALICE)  # again: only the last shred counts
    assert (clock.shredded_since(ALICE, late), clock.shredded_since(ALICE, clock.now)) == (True, False)


def test_a_removed_caller_takes_its_scopes_and_a_routers_its_callers() -> None:
    clock = ShredClock()
    stamp = clock.now
    clock.shred_caller("r1")
    assert [clock.shredded_since(scope, stamp) for scope in (Scope("r1", "m"), ROUTED, ALICE,
                                                             Scope("r10/alice", "m"))] == [True, True, False, False]
    assert not clock.shredded_since(ROUTED, clock.now)  # re-added later: its new requests store
    group = group_scope("team", "m")
    before_group = clock.now
    clock.shred_caller(group.caller)
    assert clock.shredded_since(group, before_group) and not clock.shredded_since(ALICE, before_group)
