"""Memory for sealed state: slabs written at start, ranges handed out first fit and taken back zeroed."""

from __future__ import annotations

import pytest

from cache import blob_memory
from cache.arena import StateArena, new_prefix_cache
from cache.blob_memory import BlobMemory
from cache.budget import CacheBudget
from tests.cache.test_prefix_cache import restored_keys, state_of
from tests.cache.test_sealing import ALICE, arena_of, sealed_cache

SLAB = 64 * 1024


@pytest.fixture(autouse=True)
def small_slabs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blob_memory, "SLAB_BYTES", SLAB)


def test_a_reserve_is_whole_slabs_of_zeros_written_once() -> None:
    memory = BlobMemory()
    assert memory.reserve(0) == 0 and memory.reserved_bytes == 0
    assert memory.reserve(SLAB + 1) == 2 * SLAB == memory.free_bytes
    assert memory.reserve(SLAB) == 2 * SLAB  # already held
    assert not any(byte for slab in memory._slabs for byte in slab.tolist())


def test_ranges_are_taken_first_fit_and_given_back_whole() -> None:
    memory = BlobMemory()
    memory.reserve(SLAB)
    first, second, third = (memory.take(size) for size in (1000, 5000, 100))
    assert first is not None and second is not None and third is not None
    assert [place for _, place in (first, second, third)] == [(0, 0, 1024), (0, 1024, 6080), (0, 6080, 6208)]
    assert len(first[0]) == 1000 and first[0].nbytes == 1000  # exactly the size asked for
    memory.give(second[1])
    again = memory.take(2000)  # fits in the hole the second left
    assert again is not None and again[1] == (0, 1024, 1024 + 2048)
    for place in (first[1], again[1], third[1]):
        memory.give(place)
    assert memory._free == [[(0, SLAB)]] and memory.free_bytes == SLAB  # coalesced into the whole slab
    assert memory.take(SLAB + 1) is None  # larger than a slab: allocated on its own


def test_a_blob_without_room_is_a_bytearray_of_its_own_and_a_reserved_one_comes_back_zeroed() -> None:
    memory = BlobMemory()
    blob = memory.blob(100)  # nothing reserved
    assert isinstance(blob.data, bytearray) and blob.release is None
    memory.reserve(SLAB)
    blob = memory.blob(100)
    assert isinstance(blob.data, memoryview) and memory.free_bytes == SLAB - 128
    blob.data[:] = b"\xff" * 100
    blob.wipe()
    blob.wipe()  # given back once
    assert memory.free_bytes == SLAB and not any(memory._slabs[0].tolist())


def test_sealed_spans_lie_in_the_reserve_open_from_it_and_give_it_back_zeroed_when_shredded() -> None:
    cache = sealed_cache()
    arena = arena_of(cache)
    cache.store(ALICE, list(range(10)), state_of(list(range(10))))
    cache.seal_cold()
    arena.memory.reserve(SLAB)
    cache.store(ALICE, list(range(20, 30)), state_of(list(range(20, 30))))
    cache.seal_cold()
    blobs = [entry.span.sealed.blob for entry in arena._entries.values() if entry.span.sealed is not None]
    assert [blob.release is None for blob in blobs] == [True, False]  # the second lies in the reserve
    described = arena.describe()
    assert described["reserve_bytes"] == SLAB and described["reserve_free_bytes"] < SLAB
    assert any(arena.memory._slabs[0].tolist())  # ciphertext
    lease = cache.acquire(ALICE, list(range(20, 30)), limit=9, anywhere=True)
    assert restored_keys(cache, lease) == list(range(20, 29))  # the reserve's ciphertext opens like any other
    cache.release(lease)
    cache.drop_scope(ALICE)
    assert arena.memory.free_bytes == SLAB and not any(arena.memory._slabs[0].tolist())


def test_only_a_sealing_cache_reserves_memory() -> None:
    budget = CacheBudget(node_bytes=1 << 20, caller_bytes=1 << 20)
    sealing, plain = new_prefix_cache(budget, reserve_bytes=1), new_prefix_cache(budget, False, reserve_bytes=1)
    assert isinstance(sealing.arena, StateArena) and isinstance(plain.arena, StateArena)
    assert sealing.arena.memory.reserved_bytes == SLAB and plain.arena.memory.reserved_bytes == 0
