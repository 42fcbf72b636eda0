"""Sealing: AES-256-GCM per scope, associated data that pins each message to its place, shredding."""

from __future__ import annotations

import pytest

from cache import sealed_payload
from cache.arena import SealCost, SealedEntryError, StateArena
from cache.prefix_cache import PrefixCache
from cache.scope import Scope
from cache.sealing import TAG_BYTES, Place, Sealer, SealError
from tests.cache.test_prefix_cache import BYTES_PER_TOKEN, make_cache, restored_keys, state_of

ALICE, BOB = Scope("alice", "m"), Scope("bob", "m")
PLACE = Place(handle=7, start=0, end=10, kind="span")


def sealed_message(sealer: Sealer, scope: Scope = ALICE, place: Place = PLACE) -> tuple[bytearray, bytes, bytes]:
    plain = bytes(range(200))
    out = bytearray(len(plain) + TAG_BYTES)
    [nonce] = sealer.seal(scope, place, [plain], out)
    return out, nonce, plain


def open_message(sealer: Sealer, out: bytearray, nonce: bytes, scope: Scope = ALICE, place: Place = PLACE) -> bytes:
    target = bytearray(len(out) - TAG_BYTES)
    sealer.run_open(sealer.open_jobs(scope, place, [nonce], out, [target]))
    return bytes(target)


def test_a_message_opens_in_its_place_and_nowhere_else() -> None:
    sealer = Sealer(threads=2)
    out, nonce, plain = sealed_message(sealer)
    assert plain not in bytes(out)
    assert open_message(sealer, out, nonce) == plain
    sealed_message(sealer, BOB)  # bob gets a key of his own
    for scope, place in [(BOB, PLACE), (ALICE, Place(8, 0, 10, "span")), (ALICE, Place(7, 0, 11, "span")),
                         (ALICE, Place(7, 0, 10, "snapshot"))]:
        with pytest.raises(SealError):
            open_message(sealer, out, nonce, scope, place)
    flipped = bytearray(out)
    flipped[5] ^= 1
    with pytest.raises(SealError):
        open_message(sealer, flipped, nonce)


@pytest.mark.parametrize(("compute_threads", "shares"), [(0, 2), (1, 1), (2, 2)])
def test_rows_open_beside_the_forward_on_the_cores_it_leaves_idle(compute_threads: int, shares: int) -> None:
    sealer = Sealer(threads=2, compute_threads=compute_threads)
    plain = [bytes([i]) * 300 for i in range(8)]
    sealed = bytearray(sum(len(p) + TAG_BYTES for p in plain))
    nonces = sealer.seal(ALICE, PLACE, plain, sealed)
    targets = [bytearray(300) for _ in plain]
    futures = sealer.open_later(sealer.open_jobs(ALICE, PLACE, nonces, sealed, targets))
    assert sealer.beside == shares and len(futures) == shares
    for future in futures:
        future.result()
    assert [bytes(t) for t in targets] == plain


def test_nonces_never_repeat_and_keys_differ_per_scope_and_boot() -> None:
    sealer = Sealer(threads=1)
    nonces = [sealed_message(sealer)[1] for _ in range(50)] + [sealed_message(sealer, BOB)[1] for _ in range(5)]
    assert len(set(nonces[:50])) == 50
    other_boot = Sealer(threads=1)
    out, nonce, _ = sealed_message(sealer)
    other_boot.seal(ALICE, PLACE, [b"x"], bytearray(1 + TAG_BYTES))  # alice has a key there too: not this one
    with pytest.raises(SealError):
        open_message(other_boot, out, nonce)


def test_a_forgotten_scope_never_opens_again_even_when_it_comes_back() -> None:
    sealer = Sealer(threads=1)
    out, nonce, _ = sealed_message(sealer)
    sealer.forget(ALICE)
    with pytest.raises(SealError, match="shredded"):
        open_message(sealer, out, nonce)
    sealed_message(sealer)  # alice is back: a new salt, a new key
    with pytest.raises(SealError):
        open_message(sealer, out, nonce)


def sealed_cache(plaintext_bytes: int = 0) -> PrefixCache:
    cache = make_cache()
    assert isinstance(cache.arena, StateArena)
    cache.arena.sealer, cache.arena.plaintext_bytes = Sealer(threads=2), plaintext_bytes
    return cache


def arena_of(cache: PrefixCache) -> StateArena:
    assert isinstance(cache.arena, StateArena)
    return cache.arena


@pytest.mark.parametrize("block", [1024, 3])
def test_sealed_spans_restore_the_same_state_and_their_plaintext_is_zeroed(monkeypatch: pytest.MonkeyPatch,
                                                                            block: int) -> None:
    monkeypatch.setattr(sealed_payload, "BLOCK_TOKENS", block)  # 3: blocks cut by every take and skip
    cache = sealed_cache()
    arena = arena_of(cache)
    cache.store(ALICE, list(range(10)), state_of(list(range(10))))
    cache.store(ALICE, list(range(5)) + [50, 51, 52], state_of(list(range(5)) + [50, 51, 52]))
    held = [t for entry in arena._entries.values() for t in sealed_payload.payload_tensors(entry.span.plain)]
    assert arena.hot_bytes == 13 * BYTES_PER_TOKEN
    assert cache.seal_cold().sealed_bytes == 13 * BYTES_PER_TOKEN
    assert arena.hot_bytes == 0 and arena.sealed_bytes == arena.bytes_total == 13 * BYTES_PER_TOKEN
    assert all(not t.any() for t in held)  # the plaintext the seal replaced reads back as zeros
    lease = cache.acquire(ALICE, list(range(5)) + [50, 51, 99], limit=100, anywhere=True)
    assert restored_keys(cache, lease) == [0, 1, 2, 3, 4, 50, 51]
    cache.release(lease)
    lease = cache.acquire(ALICE, list(range(10)), limit=8, anywhere=True)
    assert restored_keys(cache, lease) == list(range(8))
    cache.release(lease)


@pytest.mark.parametrize("block", [1024, 3])
def test_a_sealed_span_splits_into_windows_on_its_ciphertext(monkeypatch: pytest.MonkeyPatch, block: int) -> None:
    monkeypatch.setattr(sealed_payload, "BLOCK_TOKENS", block)
    cache = sealed_cache()
    arena = arena_of(cache)
    cache.store(ALICE, list(range(10)), state_of(list(range(10))))
    cache.seal_cold()
    [sealed] = [e.span.sealed for e in arena._entries.values()]
    assert sealed is not None
    cache.store(ALICE, list(range(6)) + [60, 61], state_of(list(range(6)) + [60, 61]))  # splits it at 6
    windows = sorted(e.span.window for e in arena._entries.values() if e.span.sealed is not None)
    assert windows == [(0, 6), (6, 10)] and sealed.blob.users == 2
    assert arena.bytes_total == 12 * BYTES_PER_TOKEN
    for prompt, want in [(list(range(10)), list(range(9))), (list(range(6)) + [60, 61, 0], [0, 1, 2, 3, 4, 5, 60, 61]),
                         (list(range(8)) + [0], list(range(8)))]:
        lease = cache.acquire(ALICE, prompt, limit=len(prompt) - 1, anywhere=True)
        assert restored_keys(cache, lease) == want
        cache.release(lease)
    cache.drop_scope(ALICE)
    assert sealed.blob.users == 0 and not any(sealed.blob.data)


def test_the_hot_tier_keeps_the_most_recently_used_in_plaintext() -> None:
    cache = sealed_cache(plaintext_bytes=10 * BYTES_PER_TOKEN)
    arena = arena_of(cache)
    cache.store(ALICE, list(range(100, 110)), state_of(list(range(100, 110))))
    cache.store(BOB, list(range(10)), state_of(list(range(10))))
    cache.seal_cold()
    assert arena.hot_bytes == 10 * BYTES_PER_TOKEN  # bob's, the latest
    assert [arena.is_sealed(h) for h in sorted(arena._entries)] == [True, False]
    assert cache.seal_cold(stop=lambda: True).sealed_bytes == 0  # a waiting request goes first


def test_tampered_moved_and_misplaced_entries_are_named_and_dropped() -> None:
    cache = sealed_cache()
    arena = arena_of(cache)
    cache.store(ALICE, list(range(10)), state_of(list(range(10))))
    cache.store(ALICE, list(range(20, 30)), state_of(list(range(20, 30))))
    cache.seal_cold()
    first, second = sorted(arena._entries)
    sealed_first = arena._entries[first].span.sealed
    assert sealed_first is not None
    sealed_first.blob.data[3] ^= 0x40
    lease = cache.acquire(ALICE, list(range(10)), limit=9, anywhere=True)
    with pytest.raises(SealedEntryError) as failed:
        restored_keys(cache, lease)
    assert failed.value.handles == [first] and arena.open_failures == 1
    cache.release(lease)
    assert cache.discard(ALICE, failed.value.handles) == 1
    assert cache.acquire(ALICE, list(range(10)), limit=9, anywhere=True).length == 0

    cache.store(ALICE, list(range(10)), state_of(list(range(10))))
    cache.seal_cold()
    third = max(arena._entries)
    a, b = arena._entries[second].span, arena._entries[third].span
    a.sealed, b.sealed = b.sealed, a.sealed  # the same size, each in the other's place
    lease = cache.acquire(ALICE, list(range(10)), limit=9, anywhere=True)
    with pytest.raises(SealedEntryError):
        restored_keys(cache, lease)
    cache.release(lease)

    cache.store(BOB, list(range(40, 50)), state_of(list(range(40, 50))))
    cache.seal_cold()
    bobs = max(arena._entries)
    arena._entries[bobs].scope = ALICE  # a bug hands bob's entry to alice's lookup
    with pytest.raises(SealedEntryError):
        arena._plain(bobs, arena._entries[bobs], "span", arena._entries[bobs].span)
    assert arena.open_failures == 3


def test_dropping_a_scope_zeroes_its_buffers_and_destroys_its_key() -> None:
    cache = sealed_cache(plaintext_bytes=5 * BYTES_PER_TOKEN)
    arena = arena_of(cache)
    cache.store(ALICE, list(range(10)), state_of(list(range(10))))
    cache.store(ALICE, list(range(1, 5)), state_of(list(range(1, 5))))
    cache.seal_cold()
    blobs = [e.span.sealed.blob.data for e in arena._entries.values() if e.span.sealed is not None]
    plain = [t for e in arena._entries.values() if e.span.plain is not None
             for t in sealed_payload.payload_tensors(e.span.plain)]
    assert blobs and plain and all(any(b) for b in blobs) and all(t.any() for t in plain)
    assert arena.sealer is not None and arena.sealer.has_key(ALICE)
    cache.drop_caller("alice")
    assert all(not any(b) for b in blobs) and all(not t.any() for t in plain)
    assert not arena.sealer.has_key(ALICE) and len(arena) == 0 and arena.bytes_total == 0


def test_time_to_live_expires_unused_scopes() -> None:
    cache = sealed_cache()
    cache.store(ALICE, list(range(10)), state_of(list(range(10))))
    cache.store(BOB, list(range(10)), state_of(list(range(10))))
    ttl = {"alice": 5.0, "bob": None}
    assert cache.expire(ttl.get, now=1e18) == [ALICE]
    assert cache.cached_tokens(ALICE) == 0 and cache.cached_tokens(BOB) == 10


def test_a_waiting_request_interrupts_a_seal_which_leaves_the_plaintext_intact(monkeypatch: pytest.MonkeyPatch
                                                                               ) -> None:
    monkeypatch.setattr(sealed_payload, "SEAL_BATCH_BYTES", 1)
    cache = sealed_cache()
    arena = arena_of(cache)
    cache.store(ALICE, list(range(10)), state_of(list(range(10))))
    asked = iter([False, False, True])  # the entry's K/V: 2 layers x 2 tensors x 2 heads = 8 messages
    assert cache.seal_cold(stop=lambda: next(asked)).sealed_bytes == 0
    assert arena.hot_bytes == 10 * BYTES_PER_TOKEN and arena.sealed_bytes == 0
    lease = cache.acquire(ALICE, list(range(10)), limit=9, anywhere=True)
    assert restored_keys(cache, lease) == list(range(9))
    cache.release(lease)
    assert cache.seal_cold().sealed_bytes == 10 * BYTES_PER_TOKEN


@pytest.mark.parametrize("recompute_s_per_token", [1e-9, 1.0])
def test_state_that_opens_slower_than_it_computes_is_dropped_not_sealed(recompute_s_per_token: float) -> None:
    cache = sealed_cache()
    arena = arena_of(cache)
    arena.register_model("m", arena._adapters["m"], SealCost(1e-9, recompute_s_per_token, 1, 1))
    cache.store(ALICE, list(range(10)), state_of(list(range(10))))
    cache.store(ALICE, list(range(5)) + [50, 51, 52], state_of(list(range(5)) + [50, 51, 52]))
    held = [t for entry in arena._entries.values() for t in sealed_payload.payload_tensors(entry.span.plain)]
    cold = cache.seal_cold()
    if recompute_s_per_token == 1.0:  # opening 1 GiB/s-ish against a second a token: kept, sealed
        assert (cold.sealed_bytes, cold.unkept, arena.sealed_bytes) == (13 * BYTES_PER_TOKEN, (), 13 * BYTES_PER_TOKEN)
        return
    assert cold.sealed_bytes == 0 and len(cold.unkept) == 3 and arena.unsealed_drops == 3
    assert len(arena) == 0 and arena.bytes_total == arena.hot_bytes == 0 and cache.cached_tokens(ALICE) == 0
    assert all(not t.any() for t in held)  # dropped plaintext is zeroed like everything freed
    lease = cache.acquire(ALICE, list(range(10)), limit=9, anywhere=True)
    assert lease.length == 0
    cache.release(lease)


def test_an_entry_of_many_small_messages_seals_in_calls_of_about_seal_batch_bytes(monkeypatch: pytest.MonkeyPatch
                                                                                   ) -> None:
    cache = sealed_cache()
    arena = arena_of(cache)
    assert arena.sealer is not None
    calls: list[int] = []
    seal = arena.sealer.seal
    monkeypatch.setattr(arena.sealer, "seal", lambda *args, **kw: calls.append(len(args[2])) or seal(*args, **kw))
    cache.store(ALICE, list(range(10)), state_of(list(range(10))))  # 8 messages of 2.5 tokens' bytes each
    assert cache.seal_cold().sealed_bytes == 10 * BYTES_PER_TOKEN
    assert calls == [8]
    message = 10 * BYTES_PER_TOKEN // 8
    monkeypatch.setattr(sealed_payload, "SEAL_BATCH_BYTES", 3 * message)
    cache.store(BOB, list(range(10)), state_of(list(range(10))))
    calls.clear()
    assert cache.seal_cold().sealed_bytes == 10 * BYTES_PER_TOKEN
    assert calls == [3, 3, 2]
    lease = cache.acquire(BOB, list(range(10)), limit=9, anywhere=True)
    assert restored_keys(cache, lease) == list(range(9))
    cache.release(lease)
