"""Times to live of stored entries under an injected clock: expiry, refresh on read, classes never shortened,
zeroed buffers, and the write plan's holds and per-class counts."""

from __future__ import annotations

import pytest

from cache import sealed_payload
from cache.arena import Scope, StateArena
from cache.prefix_cache import PrefixCache
from cache.ttl import AUTOMATIC, Breakpoint, WritePlan
from tests.cache.test_prefix_cache import make_cache, state_of

ALICE = Scope("alice", "m")
MINUTE = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def timed_cache() -> tuple[PrefixCache, Clock]:
    clock = Clock()
    cache = make_cache()
    cache.now = clock  # the clock every time to live reads
    return cache, clock


def store(cache: PrefixCache, tokens: list[int], plan: WritePlan) -> None:
    cache.store(ALICE, tokens, state_of(tokens), holds=plan.holds(len(tokens)))


def held(cache: PrefixCache, tokens: list[int]) -> int:
    lease = cache.acquire(ALICE, tokens, limit=len(tokens), anywhere=True)
    cache.release(lease)
    return lease.length


def no_default(caller: str) -> float | None:
    return None


FIVE_MINUTES = WritePlan("5m")


def test_a_five_minute_entry_is_gone_after_five_idle_minutes_and_kept_when_read_at_four() -> None:
    cache, clock = timed_cache()
    tokens = list(range(10))
    store(cache, tokens, FIVE_MINUTES)
    clock.now += 4 * MINUTE
    assert cache.expire(no_default) == []
    assert held(cache, tokens) == 10  # read at 4 minutes: its five minutes start again
    clock.now += 4 * MINUTE
    assert cache.expire(no_default) == []
    assert cache.cached_tokens(ALICE) == 10
    clock.now += 1 * MINUTE + 1
    assert cache.expire(no_default) == [ALICE]
    assert cache.cached_tokens(ALICE) == 0 and cache.expired_entries == 1 and cache.expired_scopes == 1
    assert ALICE not in cache._digesters  # its last entry went: the scope's key with it


def test_a_24h_entry_outlives_a_day_less_a_second_and_not_a_day() -> None:
    cache, clock = timed_cache()
    store(cache, list(range(10)), WritePlan("24h"))
    clock.now += 86400
    assert cache.expire(no_default) == []
    clock.now += 1
    assert cache.expire(no_default) == [ALICE]


def test_a_shorter_class_over_the_same_prefix_never_shortens_a_longer_one() -> None:
    cache, clock = timed_cache()
    store(cache, list(range(10)), WritePlan("1h"))
    store(cache, list(range(10)) + [20, 21], FIVE_MINUTES)  # the same prefix, then two tokens of its own
    clock.now += 5 * MINUTE + 1
    assert cache.expire(no_default) == [ALICE]  # lost its 5-minute tail, kept the hour's prefix
    assert cache.cached_tokens(ALICE) == 10 and cache.expired_entries == 1
    clock.now += 55 * MINUTE
    assert cache.expire(no_default) == [ALICE] and cache.cached_tokens(ALICE) == 0


def test_breakpoints_hold_each_prefix_for_the_longest_class_at_or_after_it() -> None:
    cache, clock = timed_cache()
    plan = WritePlan("default", (Breakpoint(4, "1h"), Breakpoint(10, "5m")))
    assert plan.limit == 10
    assert plan.written(0, 10) == {"1h": 4, "5m": 6}
    assert plan.written(2, 7) == {"1h": 2, "5m": 3}
    store(cache, list(range(10)), plan)
    clock.now += 6 * MINUTE
    cache.expire(no_default)
    assert cache.cached_tokens(ALICE) == 4
    assert held(cache, list(range(10))) == 4


def test_the_default_class_follows_the_callers_time_to_live_known_at_expiry() -> None:
    cache, clock = timed_cache()
    store(cache, list(range(10)), AUTOMATIC)
    assert AUTOMATIC.written(0, 12) == {"default": 12}
    clock.now += 100
    assert cache.expire(lambda caller: 100.0) == []
    assert cache.expire(lambda caller: None) == []  # no limit
    assert cache.expire(lambda caller: 99.0) == [ALICE]


def test_an_expired_entrys_buffers_read_back_as_zeros_and_a_live_scope_keeps_its_key() -> None:
    cache, clock = timed_cache()
    arena = cache.arena
    assert isinstance(arena, StateArena)
    store(cache, list(range(10)), WritePlan("1h"))
    store(cache, list(range(10)) + [20, 21], FIVE_MINUTES)
    buffers = [t for e in arena._entries.values() if e.span.plain is not None
               for t in sealed_payload.payload_tensors(e.span.plain)]
    assert buffers and all(t.any() for t in buffers)
    tail = [t for handle, e in arena._entries.items() if e.end == 12 and e.span.plain is not None
            for t in sealed_payload.payload_tensors(e.span.plain)]
    clock.now += 5 * MINUTE + 1
    cache.expire(no_default)
    assert tail and all(not t.any() for t in tail)
    assert ALICE in cache._digesters and len(arena) == 1


@pytest.mark.parametrize("bad", [(Breakpoint(5, "1h"), Breakpoint(3, "5m")), (Breakpoint(0, "5m"),)])
def test_breakpoints_out_of_prompt_order_are_our_bug(bad: tuple[Breakpoint, ...]) -> None:
    with pytest.raises(AssertionError):
        WritePlan("default", bad)


def test_the_longest_class_a_caller_holds_is_known_for_its_replies() -> None:
    cache, _ = timed_cache()
    assert cache.longest_ttl("alice") == 0.0
    store(cache, list(range(10)), AUTOMATIC)
    assert cache.longest_ttl("alice") == 0.0  # the caller's default only
    store(cache, list(range(5)) + [30], WritePlan("24h"))
    assert cache.longest_ttl("alice") == 86400.0 and cache.longest_ttl("bob") == 0.0
