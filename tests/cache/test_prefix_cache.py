"""The prefix cache over real tensors: exact byte accounting, budgets, LRU order and scope isolation."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from transformers import LlamaConfig

from cache.adapters import KVPiece, ModelStateAdapter, SpanState
from cache.arena import Scope, StateArena
from cache.budget import CacheBudget
from cache.prefix_cache import PrefixCache, ReuseLease
from cache.state_spec import model_state_specs

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 4
BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4  # K and V, float32
ALICE, BOB = Scope("alice", "m"), Scope("bob", "m")


def make_cache(node_tokens: int = 10_000, caller_tokens: int = 10_000) -> PrefixCache:
    config = LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         num_hidden_layers=LAYERS, intermediate_size=8, vocab_size=100)
    adapter = ModelStateAdapter(model_state_specs(config), config)
    arena = StateArena()
    arena.register_model("m", adapter)
    cache = PrefixCache(CacheBudget(node_tokens * BYTES_PER_TOKEN, caller_tokens * BYTES_PER_TOKEN, "lru"), arena)
    cache.register_model("m", adapter.needs_snapshots)
    return cache


def restored_keys(cache: PrefixCache, lease: ReuseLease) -> list[float]:
    """Layer 0's first key element of every restored token, through the arena into a working cache."""
    arena = cache.arena
    assert isinstance(arena, StateArena)
    adapter = arena._adapters["m"]
    work = adapter.working_cache(64)
    arena.restore(adapter, work, lease.spans, 0, lease.snapshot, lease.length)
    adapter.materialize(work)
    return work.layers[0].keys[0, 0, :, 0].tolist()


def state_of(tokens: list[int]) -> Callable[[int, int], SpanState]:
    """K/V whose every element is the token id, so restored state shows which tokens it came from."""

    def extract(start: int, end: int) -> SpanState:
        values = torch.tensor(tokens[start:end], dtype=torch.float32).view(1, 1, -1, 1)
        kv = values.expand(1, KV_HEADS, end - start, HEAD_DIM).clone()
        return tuple(KVPiece(kv.clone(), kv.clone()) for _ in range(LAYERS))

    return extract


def store(cache: PrefixCache, scope: Scope, tokens: list[int]) -> int:
    return cache.store(scope, tokens, state_of(tokens)).stored


def test_bytes_are_exact_tensor_bytes_and_splits_keep_them() -> None:
    cache = make_cache()
    assert store(cache, ALICE, list(range(10))) == 10
    assert cache.arena.bytes_total == 10 * BYTES_PER_TOKEN
    assert store(cache, ALICE, list(range(5)) + [50, 51, 52]) == 3
    assert cache.arena.bytes_total == 13 * BYTES_PER_TOKEN
    assert len(cache.arena) == 3  # [0,5), [5,10), [5,8) after the split
    assert store(cache, ALICE, list(range(10))) == 0


def test_lease_restores_the_right_tokens_across_spans() -> None:
    cache = make_cache()
    store(cache, ALICE, list(range(10)))
    store(cache, ALICE, list(range(5)) + [50, 51, 52])
    lease = cache.acquire(ALICE, list(range(5)) + [50, 51, 99], limit=100, anywhere=True)
    assert lease.length == 7
    assert restored_keys(cache, lease) == [0, 1, 2, 3, 4, 50, 51]
    cache.release(lease)
    assert cache.acquire(ALICE, list(range(10)), limit=9, anywhere=True).length == 9


def test_scopes_never_share_state() -> None:
    cache = make_cache()
    store(cache, ALICE, list(range(20)))
    assert cache.acquire(BOB, list(range(20)), limit=19, anywhere=True).length == 0
    assert cache.acquire(Scope("alice", "other-model"), list(range(20)), limit=19, anywhere=True).length == 0
    assert store(cache, BOB, list(range(20))) == 20
    assert cache.arena.bytes_of_caller("alice") == cache.arena.bytes_of_caller("bob") == 20 * BYTES_PER_TOKEN


def test_caller_budget_evicts_that_callers_least_recently_used_leaves_first() -> None:
    cache = make_cache(caller_tokens=25)
    store(cache, ALICE, [1] + list(range(100, 110)))  # 11 tokens
    store(cache, ALICE, [2] + list(range(200, 210)))  # 11 tokens
    store(cache, BOB, [1] + list(range(100, 110)))
    cache.acquire(ALICE, [1, 100], limit=2, anywhere=True)  # touch the first: now the second is least recent
    store(cache, ALICE, [3] + list(range(300, 305)))  # 6 more: 28 > 25, evict one
    assert cache.cached_tokens(ALICE) == 17
    assert cache.acquire(ALICE, [2, 200], limit=2, anywhere=True).length == 0
    assert cache.acquire(ALICE, [1, 100], limit=2, anywhere=True).length == 2
    assert cache.cached_tokens(BOB) == 11
    assert cache.evicted_spans == 1


def test_node_budget_evicts_across_callers_by_recency_and_never_a_leased_span() -> None:
    cache = make_cache(node_tokens=30)
    store(cache, ALICE, [1] * 12)
    store(cache, BOB, [2] * 12)
    lease = cache.acquire(ALICE, [1] * 12, limit=11, anywhere=True)  # Alice's span is older but held
    store(cache, BOB, [3] * 12)  # 36 > 30
    assert cache.cached_tokens(ALICE) == 12
    assert cache.cached_tokens(BOB) == 12
    assert cache.acquire(BOB, [2] * 12, limit=11, anywhere=True).length == 0
    cache.release(lease)
    assert cache.arena.bytes_total == 24 * BYTES_PER_TOKEN


def test_an_interior_node_becomes_evictable_once_its_children_are_gone() -> None:
    cache = make_cache(caller_tokens=8)
    store(cache, ALICE, [1, 2, 3, 4, 5])
    store(cache, ALICE, [1, 2, 3, 9, 9])  # split: [1,2,3] + [4,5] + [9,9] = 7 tokens
    store(cache, ALICE, [7, 7, 7, 7, 7, 7, 7])  # 14 > 8: evicts [4,5], [9,9], then [1,2,3]
    assert cache.cached_tokens(ALICE) == 7
    assert cache.evicted_spans == 3


def test_dropping_a_scope_frees_all_its_bytes() -> None:
    cache = make_cache()
    store(cache, ALICE, list(range(30)))
    store(cache, ALICE, list(range(10)) + [7])
    cache.drop_scope(ALICE)
    assert cache.arena.bytes_total == 0 and len(cache.arena) == 0


def marker(tokens: list[int], positions: list[int]) -> dict[int, tuple]:
    """Snapshots at `positions`: K/V-shaped pieces standing in for a sliding window's tail."""
    extract = state_of(tokens)
    return {p: tuple((piece,) for piece in extract(max(0, p - 2), p)) for p in positions}


def test_a_store_that_takes_snapshots_reports_every_token_it_wrote() -> None:
    cache = make_cache()
    tokens = list(range(40))
    result = cache.store(ALICE, tokens, state_of(tokens), marker(tokens, [10, 25, 40]))
    assert (result.start, result.stored) == (0, 40)
    longer = tokens + [77] * 8
    result = cache.store(ALICE, longer, state_of(longer), marker(longer, [30, 48]))
    assert (result.start, result.stored) == (40, 8)


def test_value_eviction_of_interior_snapshots_and_their_subtrees_never_touches_a_freed_handle() -> None:
    cache = make_cache()
    cache.budget = CacheBudget(cache.budget.node_bytes, cache.budget.caller_bytes, "value")
    for branch in range(6):
        tokens = list(range(30)) + [100 + branch] * 10
        cache.store(ALICE, tokens, state_of(tokens), marker(tokens, [10, 20, 30, 40]))
    assert cache.snapshot_positions(ALICE) == [10, 20, 30] + [40] * 6
    bob = [7] * 12
    cache.store(BOB, bob, state_of(bob), marker(bob, [12]))
    for _ in range(60):  # Bob's state is fresh, Alice's old: hers goes first, whole and snapshot by snapshot
        cache.release(cache.acquire(BOB, bob, limit=11, anywhere=False))
    bob_bytes = cache.arena.bytes_of_caller("bob")
    cache.budget = CacheBudget(bob_bytes - 1, 10_000 * BYTES_PER_TOKEN, "value")
    cache.enforce_budget("bob")
    assert cache.cached_tokens(ALICE) == 0
    assert cache.arena.bytes_total <= bob_bytes - 1


def test_resume_depth_is_the_acquired_length_without_a_lease_or_a_touch() -> None:
    cache = make_cache()
    tokens = list(range(40))
    cache.store(ALICE, tokens, state_of(tokens), marker(tokens, [10, 25]))
    probe = tokens[:30] + [99]
    access = {node.end: node.last_access for node in cache._trees[ALICE].nodes()}
    assert cache.resume_depth(ALICE, probe, anywhere=True) == 30
    assert cache.resume_depth(ALICE, probe, anywhere=False) == 25
    assert cache.resume_depth(ALICE, tokens[:24], anywhere=False) == 10
    assert cache.resume_depth(BOB, probe, anywhere=True) == 0
    assert {node.end: node.last_access for node in cache._trees[ALICE].nodes()} == access
    assert all(node.refs == 0 for node in cache._trees[ALICE].nodes())
    lease = cache.acquire(ALICE, probe, limit=100, anywhere=False)
    assert lease.length == 25
    cache.release(lease)


FORM_A, FORM_B, FORM_C = b"a" * 32, b"b" * 32, b"c" * 32
ROUTED_ALICE, ROUTED_BOB = Scope("r1/alice", "m"), Scope("r1/bob", "m")


def test_warm_forms_are_those_still_resumable_at_or_beyond_their_position() -> None:
    cache = make_cache(caller_tokens=30)
    first = tuple(range(20))
    store(cache, ROUTED_ALICE, list(first))
    cache.record_forms(ROUTED_ALICE, first, [(8, FORM_A), (20, FORM_B)])
    second = tuple(range(100, 112))
    store(cache, ROUTED_BOB, list(second))
    cache.record_forms(ROUTED_BOB, second, [(12, FORM_C)])
    everyone = sorted(cache.warm_forms(lambda scope: True, anywhere=True), key=lambda pair: pair[1])
    assert everyone == [(ROUTED_ALICE, FORM_A), (ROUTED_ALICE, FORM_B), (ROUTED_BOB, FORM_C)]
    assert cache.warm_forms(lambda scope: scope.caller == "r1/bob", anywhere=True) == [(ROUTED_BOB, FORM_C)]
    # Alice's [8, 20) goes (her budget is 30 tokens): the form at 8 stays warm, the one at 20 does not.
    store(cache, ROUTED_ALICE, list(range(8)) + [50] * 20)
    assert cache.cached_tokens(ROUTED_ALICE) == 28
    assert cache.warm_forms(lambda scope: scope.caller == "r1/alice", anywhere=True) == [(ROUTED_ALICE, FORM_A)]
    # Only snapshots resume a model that needs them: none was taken here.
    assert cache.warm_forms(lambda scope: True, anywhere=False) == []


def test_a_scope_remembers_its_latest_forms_and_forgets_them_with_its_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("cache.prefix_cache.MAX_FORMS", 3)
    cache = make_cache()
    tokens = tuple(range(10))
    store(cache, ROUTED_ALICE, list(tokens))
    cache.record_forms(ROUTED_ALICE, tokens, [(1, bytes([i]) * 32) for i in range(5)])
    cache.record_forms(ROUTED_ALICE, tokens, [(2, bytes([2]) * 32)])  # again: now the newest
    assert sorted(form[0] for _, form in cache.warm_forms(lambda scope: True, anywhere=True)) == [2, 3, 4]
    cache.record_forms(ROUTED_ALICE, tokens, [(3, bytes([5]) * 32)])
    assert sorted(form[0] for _, form in cache.warm_forms(lambda scope: True, anywhere=True)) == [2, 4, 5]
    store(cache, ROUTED_BOB, [1, 2])
    cache.record_forms(ROUTED_BOB, (1, 2), [(2, FORM_C)])
    store(cache, ALICE, [1, 2])
    cache.record_forms(ALICE, (1, 2), [(2, FORM_A)])
    assert cache.drop_caller("r") == []  # "r1/..." are r1's callers, not r's
    assert [scope.caller for scope in cache.drop_caller("r1")] == ["r1/alice", "r1/bob"]
    assert cache.warm_forms(lambda scope: True, anywhere=True) == [(ALICE, FORM_A)]
    assert cache.cached_tokens(ROUTED_ALICE) == cache.cached_tokens(ROUTED_BOB) == 0
    cache.expire(lambda caller: 0.0, now=time.monotonic() + 1)
    assert cache.warm_forms(lambda scope: True, anywhere=True) == []


def test_holdings_and_lookups_are_one_scopes_own_and_lookups_outlive_its_shredding() -> None:
    from cache.prefix_cache import Holdings

    cache = make_cache()
    store(cache, ALICE, list(range(10)))
    store(cache, ALICE, list(range(5)) + [50, 51, 52])
    store(cache, BOB, list(range(4)))
    cache.release(cache.acquire(ALICE, list(range(10)), limit=9, anywhere=True))  # a hit
    cache.release(cache.acquire(ALICE, [99, 98], limit=1, anywhere=True))  # a miss: nothing agrees
    cache.release(cache.acquire(Scope("carol", "m"), [1, 2], limit=1, anywhere=True))  # a miss: nothing held
    # Unsealed (no sealer): every byte is hot. [0,5), [5,10), [5,8): 13 tokens in 3 entries.
    assert cache.holdings(ALICE) == Holdings(3, 13, 13 * BYTES_PER_TOKEN, 0)
    assert cache.holdings(BOB) == Holdings(1, 4, 4 * BYTES_PER_TOKEN, 0)
    assert (cache.lookups[ALICE].hits, cache.lookups[ALICE].misses) == (1, 1)
    assert (cache.lookups[Scope("carol", "m")].hits, cache.lookups[Scope("carol", "m")].misses) == (0, 1)
    assert cache.drop(lambda scope: scope == ALICE) == [ALICE]
    assert cache.holdings(ALICE) == Holdings(0, 0, 0, 0)
    assert cache.holdings(BOB) == Holdings(1, 4, 4 * BYTES_PER_TOKEN, 0)
    assert cache.arena.bytes_total == 4 * BYTES_PER_TOKEN
    assert (cache.lookups[ALICE].hits, cache.lookups[ALICE].misses) == (1, 1)  # counts since start
    cache.drop_caller("alice")  # a removed key: its counts go too
    assert ALICE not in cache.lookups and Scope("carol", "m") in cache.lookups


def test_held_bytes_split_a_sealed_entry_from_a_hot_one() -> None:
    from cache.arena import new_prefix_cache

    cache = new_prefix_cache(CacheBudget(10_000 * BYTES_PER_TOKEN, 10_000 * BYTES_PER_TOKEN, "lru"))
    config = LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         num_hidden_layers=LAYERS, intermediate_size=8, vocab_size=100)
    adapter = ModelStateAdapter(model_state_specs(config), config)
    assert isinstance(cache.arena, StateArena)
    cache.arena.register_model("m", adapter)
    cache.register_model("m", adapter.needs_snapshots)
    store(cache, ALICE, list(range(6)))
    assert cache.holdings(ALICE).hot_bytes == 6 * BYTES_PER_TOKEN and cache.holdings(ALICE).sealed_bytes == 0
    cache.seal_cold()
    held = cache.holdings(ALICE)
    assert (held.entries, held.tokens, held.hot_bytes, held.sealed_bytes) == (1, 6, 0, 6 * BYTES_PER_TOKEN)
