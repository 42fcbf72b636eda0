"""Keyed token digests: they match token by token within a scope, name no id, and go with their scope."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from cache.budget import CacheBudget
from cache.prefix_cache import PrefixCache
from cache.radix_tree import TreeNode, common_prefix_length
from cache.scope import Scope
from cache.token_digest import DigestRun, TokenDigester


def test_a_digest_is_the_first_half_of_the_aes_block_of_position_and_id() -> None:
    digester = TokenDigester()
    key = bytes(digester._key)
    run = digester.run([5, 70000, 5])
    ecb = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    expected = [int.from_bytes(ecb.update(position.to_bytes(8, "little") + token.to_bytes(8, "little"))[:8], "little")
                for position, token in enumerate([5, 70000, 5])]
    assert list(run) == expected
    assert run[0] != run[2]  # one token at two positions: two digests


def test_runs_of_one_scope_share_exactly_the_prefix_their_tokens_share() -> None:
    digester = TokenDigester()
    a, b = digester.run([1, 2, 3, 4, 5, 6]), digester.run([1, 2, 3, 9, 5, 6])
    assert common_prefix_length(a, b) == 3 == common_prefix_length(b, a)
    assert common_prefix_length(a, digester.run([1, 2])) == 2
    assert a[:3] == b[:3] and a[:4] != b[:4]
    assert isinstance(a[1:4], DigestRun) and len(a[1:4]) == 3 and a[1:4][0] == a[1]


def test_another_scope_digests_the_same_tokens_otherwise() -> None:
    tokens = list(range(100, 164))
    a, b = TokenDigester().run(tokens), TokenDigester().run(tokens)
    assert a != b and not set(a) & set(b)


def test_a_run_holds_no_token_id_in_any_width() -> None:
    tokens = [11, 257, 31999, 70000, 11, 11]
    words = np.array(list(TokenDigester().run(tokens)), dtype="<u8").tobytes()
    for dtype in ("<i2", "<i4", "<i8"):
        assert np.array(tokens[:2], dtype).tobytes() not in words


def test_destroying_a_digester_zeroes_its_key_and_refuses_to_digest() -> None:
    digester = TokenDigester()
    digester.destroy()
    assert bytes(digester._key) == bytes(32)
    with pytest.raises(RuntimeError):
        digester.run([1])


class Handles:
    """A store whose handles are (start, end): the index alone."""

    bytes_total = 0

    def put(self, scope: Scope, start: int, end: int, span: Any) -> tuple[int, int]:
        return (start, end)

    def split(self, handle: tuple[int, int], offset: int) -> tuple[tuple[int, int], tuple[int, int]]:
        return (handle[0], handle[0] + offset), (handle[0] + offset, handle[1])

    def has_snapshot(self, handle: Any) -> bool:
        return False

    def bytes_of_caller(self, caller: str) -> int:
        return 0

    def free(self, handle: Any) -> int:
        return 0

    def forget(self, scope: Scope) -> None:
        pass


def test_the_index_refuses_a_run_made_for_another_scope() -> None:
    cache = PrefixCache(CacheBudget(1 << 30, 1 << 30), Handles())  # type: ignore[arg-type]
    alice, bob = Scope("alice", "m"), Scope("bob", "m")
    cache.store(alice, [1, 2, 3], lambda start, end: None)
    with pytest.raises(ValueError, match="another scope"):
        cache.acquire(bob, cache.digest(alice, [1, 2, 3]), 2, anywhere=True)
    assert cache.acquire(alice, cache.digest(alice, [1, 2, 3, 4]), 3, anywhere=True).length == 3


def test_dropping_a_scope_zeroes_its_digests_and_frees_its_tree_without_the_collector() -> None:
    cache = PrefixCache(CacheBudget(1 << 30, 1 << 30), Handles())  # type: ignore[arg-type]
    scope = Scope("alice", "m")
    runs = [cache.digest(scope, tokens) for tokens in ([1, 2, 3, 4], [1, 2, 7, 8], [1, 9])]
    for run in runs:
        cache.store(scope, run, lambda start, end: None)
    cache.record_forms(scope, runs[0], [(2, b"f" * 32)])
    digester = runs[0].owner
    gc.collect()
    gc.disable()
    try:
        held = sum(type(obj) is TreeNode for obj in gc.get_objects())  # other tests' trees may be alive too
        cache.drop_scope(scope)
        # Freed by reference counts alone: no cycle of parent and child links waits for a collection.
        assert held - sum(type(obj) is TreeNode for obj in gc.get_objects()) == 6  # five spans and the root
    finally:
        gc.enable()
    # Every digest the tree held (the forms' run too) is zeroed, and with the key gone the callers' own are noise.
    assert not any(runs[0]) and not any(runs[1][2:]) and not any(runs[2][1:]) and digester.destroyed
    assert all(runs[1][:2]) and all(runs[2][:1])
    assert cache.acquire(scope, [1, 2, 3, 4], 3, anywhere=True).length == 0
