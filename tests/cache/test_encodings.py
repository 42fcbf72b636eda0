"""The encoding cache: an attachment's encoding serves its own scope and encoder only, bit for bit, sealed or not;
bounded least recently used first; shredded with its scope; and nothing of the content is held in the clear."""

from __future__ import annotations

import gc
import hashlib
import json
import types
from typing import Any

import numpy as np
import pytest
import torch

from cache import encodings
from cache.device_copy import HostCopies
from cache.encodings import EncodingCache, EncodingCounts
from cache.scope import Scope
from cache.sealing import Sealer

ALICE, BOB = Scope("alice", "m"), Scope("bob", "m")
ROUTED = Scope("r/1", "m")
TOWER = "vision-tower@sha256:0123"
STAGED = HostCopies(stage_host=True)


def digest(content: bytes) -> bytes:
    return hashlib.sha256(content).digest()


def encoding(seed: int, shape: tuple[int, ...] = (1, 6, 8), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def cache(sealed: bool, **bounds: Any) -> EncodingCache:
    return EncodingCache(Sealer(threads=2) if sealed else None, **bounds)


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_a_hit_in_its_scope_returns_a_fresh_bitwise_equal_tensor(monkeypatch: pytest.MonkeyPatch, sealed: bool,
                                                                  dtype: torch.dtype, layout: str) -> None:
    monkeypatch.setattr(encodings, "MESSAGE_BYTES", 40)  # several messages, the last one short
    want = encoding(1, (1, 6, 8), dtype)
    put = want.transpose(1, 2) if layout == "transposed" else want
    store = cache(sealed)
    assert store.put(ALICE, digest(b"cat.png"), TOWER, put)
    got = store.get(ALICE, digest(b"cat.png"), TOWER)
    assert got is not None and got.shape == put.shape and got.dtype == dtype and got.device == put.device
    assert raw(got) == raw(put)
    got.zero_()  # the caller's own copy: the cache's is untouched
    again = store.get(ALICE, digest(b"cat.png"), TOWER)
    assert again is not None and raw(again) == raw(put)
    if sealed:
        entry = next(iter(store._shelves[ALICE].entries.values()))  # noqa: SLF001
        assert entry.plain is None and entry.sealed is not None
        assert len(entry.nonces) == -(-put.numel() * put.element_size() // 40)


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "plain"])
def test_another_scope_or_encoder_or_content_misses(sealed: bool) -> None:
    store = cache(sealed)
    store.put(ALICE, digest(b"cat.png"), TOWER, encoding(1))
    assert store.get(BOB, digest(b"cat.png"), TOWER) is None
    assert store.get(Scope("alice", "other-model"), digest(b"cat.png"), TOWER) is None
    assert store.get(ALICE, digest(b"cat.png"), TOWER + "-v2") is None
    assert store.get(ALICE, digest(b"dog.png"), TOWER) is None
    assert store.get(ALICE, digest(b"cat.png"), TOWER) is not None
    assert BOB not in store._shelves  # noqa: SLF001 - a miss makes no key for a scope that stored nothing


def test_the_same_content_has_unrelated_tags_in_two_scopes() -> None:
    store = cache(True)
    for scope in (ALICE, BOB):
        store.put(scope, digest(b"cat.png"), TOWER, encoding(1))
    tags = [next(iter(store._shelves[scope].entries)) for scope in (ALICE, BOB)]  # noqa: SLF001
    assert tags[0] != tags[1] and digest(b"cat.png") not in tags


def test_keys_that_are_not_a_sha256_and_an_encoder_are_refused() -> None:
    store = cache(False)
    with pytest.raises(ValueError, match="32 bytes of a SHA-256, not 64 bytes"):
        store.put(ALICE, digest(b"x").hex().encode(), TOWER, encoding(1))
    with pytest.raises(ValueError, match="must not be empty"):
        store.get(ALICE, digest(b"x"), "")


def test_a_device_tensor_is_sealed_and_opened_through_host_staging_zeroed_after(stagings: list[torch.Tensor]) -> None:
    """Run on a CPU by staging host tensors too (`HostCopies.stage_host`), as tests/cache/test_sealed_device.py."""
    want = encoding(2)
    store = EncodingCache(Sealer(threads=2), host_copies=STAGED)
    store.put(ALICE, digest(b"cat.png"), TOWER, want)
    got = store.get(ALICE, digest(b"cat.png"), TOWER)
    assert got is not None and raw(got) == raw(want) and got.device == want.device
    assert len(stagings) == 2 and all(got is not staged for staged in stagings)
    assert all(not staged.any() for staged in stagings)  # the plaintext staged reads back as zeros


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "plain"])
def test_a_byte_bound_evicts_least_recently_used_first(sealed: bool) -> None:
    size = 6 * 8 * 4  # one encoding's bytes
    store = cache(sealed, max_bytes=3 * size, scope_bytes=3 * size)
    for name in (b"a", b"b", b"c"):
        assert store.put(ALICE, digest(name), TOWER, encoding(1))
    assert store.get(ALICE, digest(b"a"), TOWER) is not None  # a is now the most recent
    store.put(ALICE, digest(b"d"), TOWER, encoding(1))
    assert [store.get(ALICE, digest(name), TOWER) is not None for name in (b"a", b"b", b"c", b"d")] == [
        True, False, True, True]
    assert store.bytes == 3 * size and store.evicted == 1


def test_the_bound_in_all_evicts_the_least_recently_used_of_any_scope_and_a_scope_its_own() -> None:
    size = 6 * 8 * 4
    store = cache(True, max_bytes=3 * size, scope_bytes=2 * size)
    store.put(ALICE, digest(b"a1"), TOWER, encoding(1))
    store.put(BOB, digest(b"b1"), TOWER, encoding(2))
    store.put(ALICE, digest(b"a2"), TOWER, encoding(3))
    store.put(BOB, digest(b"b2"), TOWER, encoding(4))  # over the bound in all: alice's a1 is the coldest
    assert store.get(ALICE, digest(b"a1"), TOWER) is None
    assert store.get(BOB, digest(b"b1"), TOWER) is not None  # b1 now more recent than a2
    store.put(ALICE, digest(b"a3"), TOWER, encoding(5))
    assert store.get(ALICE, digest(b"a2"), TOWER) is None
    held = {(scope.caller, name) for scope in (ALICE, BOB) for name in (b"a1", b"a2", b"a3", b"b1", b"b2")
            if store.get(scope, digest(name), TOWER) is not None}
    assert held == {("alice", b"a3"), ("bob", b"b1"), ("bob", b"b2")}
    store.put(BOB, digest(b"b3"), TOWER, encoding(6))  # over bob's own bound: his least recent, b1, goes
    assert [store.get(BOB, digest(name), TOWER) is not None for name in (b"b1", b"b2", b"b3")] == [False, True, True]
    assert store.get(ALICE, digest(b"a3"), TOWER) is not None
    assert not store.put(ALICE, digest(b"big"), TOWER, encoding(7, (1, 6, 17)))  # over a scope's bound: not kept
    assert store.evicted == 3 and store.bytes == 3 * size


def test_drop_scope_zeroes_the_sealed_bytes_and_the_keys() -> None:
    sealer = Sealer(threads=2)
    store = EncodingCache(sealer)
    for scope in (ALICE, BOB):
        store.put(scope, digest(b"cat.png"), TOWER, encoding(1))
        store.put(scope, digest(b"dog.png"), TOWER, encoding(2))
    shelf = store._shelves[ALICE]  # noqa: SLF001 - the buffers are the point
    mac_key = shelf._mac_key  # noqa: SLF001
    sealed = [entry.sealed for entry in shelf.entries.values()]
    assert sealer.has_key(ALICE) and all(buffer is not None and any(buffer) for buffer in sealed)
    store.drop_scope(ALICE)
    assert mac_key == bytearray(32) and all(buffer == bytearray(len(buffer)) for buffer in sealed if buffer)
    assert not sealer.has_key(ALICE) and sealer.has_key(BOB)
    assert store.get(ALICE, digest(b"cat.png"), TOWER) is None
    assert store.get(BOB, digest(b"cat.png"), TOWER) is not None


def test_drop_caller_takes_the_callers_it_routes_for_and_plain_copies_are_zeroed() -> None:
    store = cache(False)
    for scope in (ALICE, BOB, Scope("r", "m"), ROUTED):
        store.put(scope, digest(b"cat.png"), TOWER, encoding(1))
    plain = [entry.plain for entry in store._shelves[ROUTED].entries.values()]  # noqa: SLF001
    assert store.drop_caller("r") == [Scope("r", "m"), ROUTED]
    assert all(tensor is not None and not tensor.any() for tensor in plain)
    assert store.expire(lambda caller: 0.0 if caller == "bob" else None, now=float("inf")) == [BOB]
    assert store.get(ALICE, digest(b"cat.png"), TOWER) is not None


def test_an_altered_or_moved_entry_is_forgotten_not_served() -> None:
    store = cache(True)
    for name in (b"a", b"b", b"c"):
        store.put(ALICE, digest(name), TOWER, encoding(1))  # equal tensors: only the binding tells them apart
    a, b, c = store._shelves[ALICE].entries.values()  # noqa: SLF001
    assert a.sealed is not None
    a.sealed[0] ^= 1
    b.sealed, b.nonces = c.sealed, c.nonces  # c's ciphertext moved to b: bound to c's entry number
    assert store.get(ALICE, digest(b"a"), TOWER) is None and store.get(ALICE, digest(b"b"), TOWER) is None
    assert store.open_failures == 2 and store.counts(ALICE).entries == 1


def retained_bytes(root: object) -> bytes:
    """Every byte buffer reachable from `root` (bytes, bytearrays, arrays, tensors' memory, dict keys included),
    not through modules, types, functions or frames: what a memory image of the cache's objects would show."""
    seen, stack, found = set(), [root], []
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
            types.CodeType, types.FrameType)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, bytes | bytearray):
            found.append(bytes(obj))
        elif isinstance(obj, memoryview):
            found.append(obj.tobytes())
        elif isinstance(obj, np.ndarray):
            found.append(obj.tobytes())
        elif isinstance(obj, torch.Tensor):
            if obj.device.type != "meta":
                found.append(bytes(obj.untyped_storage()))
            continue
        stack.extend(gc.get_referents(obj))
    return b"\0".join(found)


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "plain"])
def test_a_memory_scan_of_the_cache_finds_no_tensor_bytes_nor_digest_when_sealed(sealed: bool) -> None:
    """Canary (tests/node/test_canary.py's, over the cache's objects): sealed, neither the encoding (whole or any
    row) nor the content's digest is held; in the clear the scan finds the encoding, so it could find it."""
    content = b"an attachment no memory may show 9c41"
    want = encoding(3, (1, 16, 32))
    store = cache(sealed)
    store.put(ALICE, digest(content), TOWER, want)
    assert store.get(ALICE, digest(content), TOWER) is not None
    held = retained_bytes(store)
    tag = next(iter(store._shelves[ALICE].entries))  # noqa: SLF001
    assert tag in held  # the scan reaches the shelves' dict keys, where a raw digest would lie
    rows = [raw(row) for row in want[0]]
    assert digest(content) not in held and digest(content).hex().encode() not in held
    if sealed:
        assert raw(want) not in held and not any(row in held for row in rows)
    else:
        assert raw(want) in held and all(row in held for row in rows)


def test_counts_per_scope_and_in_all_are_exact_and_describe_names_no_content() -> None:
    size = 6 * 8 * 4
    store = cache(True)
    store.put(ALICE, digest(b"cat.png"), TOWER, encoding(1))
    store.put(ALICE, digest(b"dog.png"), TOWER, encoding(2))
    store.put(BOB, digest(b"cat.png"), TOWER, encoding(1))
    for _ in range(3):
        store.get(ALICE, digest(b"cat.png"), TOWER)
    store.get(ALICE, digest(b"eel.png"), TOWER)  # a miss counts nothing
    store.get(BOB, digest(b"cat.png"), TOWER)
    assert store.counts(ALICE) == EncodingCounts(entries=2, bytes=2 * size, encoded=2, reused=3)
    assert store.counts(BOB) == EncodingCounts(entries=1, bytes=size, encoded=1, reused=1)
    described = store.describe()
    assert described == {"entries": 3, "bytes": 3 * size, "scopes": 2, "encoded": 3, "reused": 4, "evicted": 0,
                         "open_failures": 0, "sealed": True, "max_bytes": encodings.MAX_BYTES,
                         "scope_bytes": encodings.SCOPE_BYTES}
    text = json.dumps(described)
    for name in (b"cat.png", b"dog.png"):
        assert digest(name).hex() not in text
    assert "alice" not in text and TOWER not in text
    store.drop_scope(ALICE)
    assert store.counts(ALICE) == EncodingCounts(0, 0, 0, 0)
    assert {key: store.describe()[key] for key in ("entries", "bytes", "scopes", "encoded", "reused")} == {
        "entries": 1, "bytes": size, "scopes": 1, "encoded": 3, "reused": 4}
