"""The reply book: a reply generated for a scope is recognised by its exact text in that scope only, and nothing
of it is held in the clear."""

from __future__ import annotations

import numpy as np

from cache.replies import MAX_REPLIES, ReplyBook
from cache.scope import Scope

ALICE, BOB = Scope("alice", "m"), Scope("bob", "m")
ROUTED = Scope("r/1", "m")


def test_a_reply_is_recalled_by_its_exact_text_in_its_own_scope_only() -> None:
    book = ReplyBook()
    book.record(ALICE, " the tide turns", [901, 44, 7])
    assert book.recall(ALICE, " the tide turns") == [901, 44, 7]
    assert book.recall(ALICE, "the tide turns") is None  # one character off: tokenized as text
    assert book.recall(BOB, " the tide turns") is None
    assert book.recall(Scope("alice", "other-model"), " the tide turns") is None
    book.record(ALICE, "", [1])  # nothing to recognise
    book.record(ALICE, "x", [])
    assert book.replies(ALICE) == 1


def test_the_most_recent_replies_are_kept_and_a_recalled_one_counts_as_recent() -> None:
    book = ReplyBook(per_scope=3)
    for n in range(3):
        book.record(ALICE, f"reply {n}", [n])
    assert book.recall(ALICE, "reply 0") == [0]
    book.record(ALICE, "reply 3", [3])
    assert [book.recall(ALICE, f"reply {n}") for n in range(4)] == [[0], None, [2], [3]]
    assert ReplyBook().per_scope == MAX_REPLIES


def test_dropping_and_expiry_forget_the_scope_and_zero_its_keys() -> None:
    book = ReplyBook()
    for scope in (ALICE, BOB, ROUTED):
        book.record(scope, "same words", [5, 6])
    shelf = book._shelves[ALICE]  # noqa: SLF001 - the keys are the point
    keys = (shelf._mac_key, shelf._seal_key)  # noqa: SLF001
    assert book.drop(lambda scope: scope.caller == "alice") == [ALICE]
    assert all(key == bytearray(32) for key in keys)
    assert book.recall(ALICE, "same words") is None and book.recall(BOB, "same words") == [5, 6]
    assert book.expire(lambda caller: 0.0 if caller == "bob" else None, now=float("inf")) == [BOB]
    assert book.recall(ROUTED, "same words") == [5, 6]


def test_nothing_of_a_reply_is_held_in_the_clear() -> None:
    book = ReplyBook()
    text, ids = "a reply no memory may show 7f3a", [40001, 40002, 40003, 40004]
    book.record(ALICE, text, ids)
    shelf = book._shelves[ALICE]  # noqa: SLF001
    held = b"".join(tag + nonce + sealed for tag, (nonce, sealed) in shelf.entries.items())
    for needle in (text.encode(), np.array(ids, "<u4").tobytes(), np.array(ids, "<i8").tobytes()):
        assert needle not in held


def test_an_altered_entry_is_forgotten_not_trusted() -> None:
    book = ReplyBook()
    book.record(ALICE, "words", [1, 2, 3])
    shelf = book._shelves[ALICE]  # noqa: SLF001
    tag, (nonce, sealed) = next(iter(shelf.entries.items()))
    shelf.entries[tag] = (nonce, bytes([sealed[0] ^ 1]) + sealed[1:])
    assert book.recall(ALICE, "words") is None
    assert book.replies(ALICE) == 0


def test_the_book_holds_at_most_its_bytes_dropping_the_coldest_scopes_oldest_replies_first() -> None:
    sealed = 4 * 10 + 16  # ten ids and the GCM tag
    book = ReplyBook(max_bytes=3 * sealed)
    book.record(ALICE, "a0", list(range(10)))
    book.record(BOB, "b0", list(range(10)))
    book.record(ALICE, "a1", list(range(10)))
    assert book.bytes == 3 * sealed
    book.record(BOB, "b1", list(range(10)))  # alice's shelf was used less recently: her oldest goes
    assert [book.recall(ALICE, "a0"), book.recall(ALICE, "a1") is not None] == [None, True]
    assert book.bytes == 3 * sealed
    book.record(BOB, "b1", list(range(10)))  # the same reply again replaces its entry
    assert book.bytes == 3 * sealed
    book.drop(lambda scope: True)
    assert book.bytes == 0
