"""Prefix summaries: the construction against a hand-written HKDF/HMAC, the forms, the Bloom filter's measured
false-positive rate, its JSON checks, and the filters a node keeps between a router's reads."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import random

import pytest

from cache.summary import (
    FALSE_POSITIVE_RATE,
    BloomFilter,
    ChatForms,
    LiveFilter,
    SummaryError,
    SummaryFilters,
    chat_prefix_forms,
    completion_prefix_form,
    epoch_of,
    prefix_entry,
    summary_entries,
    summary_key,
)

ROUTER_KEY = "tz-router-key-for-tests"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Grüße, \"world\"\n"},
        {"role": "assistant", "content": "Hello."}]


def hkdf_sha256(ikm: bytes, salt: bytes, info: bytes) -> bytes:
    """RFC 5869 with one output block, written out: the construction the module docstring states."""
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


def test_the_entry_is_hmac_under_hkdf_of_the_router_key_caller_and_epoch() -> None:
    key = summary_key(ROUTER_KEY, "alice", 2_890_000)
    assert key == hkdf_sha256(ROUTER_KEY.encode(), (2_890_000).to_bytes(8, "big"), b"tenzro-summary-v1\0alice")
    form = chat_prefix_forms(CHAT)[0]
    assert prefix_entry(key, form) == hmac.new(key, form, hashlib.sha256).digest()


def test_the_same_prefix_gives_unrelated_entries_for_two_callers_and_two_epochs() -> None:
    form = chat_prefix_forms(CHAT)[1]
    entries = {(caller, epoch): prefix_entry(summary_key(ROUTER_KEY, caller, epoch), form)
               for caller in ("alice", "bob") for epoch in (100, 101)}
    assert len(set(entries.values())) == 4
    bloom = BloomFilter.sized(1)
    bloom.add(entries["alice", 100])
    assert [entry in bloom for entry in entries.values()] == [True, False, False, False]
    # Unrelated: about half the bits differ between any two of them, as for independent random strings.
    values = list(entries.values())
    for i, a in enumerate(values):
        for b in values[i + 1:]:
            differing = bin(int.from_bytes(a, "big") ^ int.from_bytes(b, "big")).count("1")
            assert 80 <= differing <= 176  # 256 bits, mean 128, more than 5 standard deviations


def test_forms_are_sha256_of_the_canonical_json_of_each_prefix() -> None:
    forms = chat_prefix_forms(CHAT)
    for count, form in enumerate(forms, start=1):
        canonical = json.dumps(CHAT[:count], sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        assert form == hashlib.sha256(canonical).digest()
    assert completion_prefix_form("Hi") == hashlib.sha256(b'{"prompt":"Hi"}').digest()
    assert completion_prefix_form((5, 6)) == completion_prefix_form([5, 6]) == hashlib.sha256(
        b'{"prompt":[5,6]}').digest()


def test_forms_read_content_as_the_node_does_and_a_reply_continues_the_chat() -> None:
    parts = [{**CHAT[0], "content": [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}],
              "name": "ignored"}, CHAT[1], {"role": "assistant", "content": None}]
    assert chat_prefix_forms(parts)[:2] == chat_prefix_forms(CHAT)[:2]
    assert chat_prefix_forms(parts)[2] == chat_prefix_forms([*CHAT[:2], {"role": "assistant", "content": ""}])[2]
    forms = ChatForms()
    for message in CHAT[:2]:
        forms.add(message)
    assert forms.reply_form("Hello.") == chat_prefix_forms(CHAT)[2]
    assert forms.reply_form("Hello.") == chat_prefix_forms(CHAT)[2]  # the running digest is left as it was
    assert forms.add(CHAT[2]) == chat_prefix_forms(CHAT)[2]


def random_entries(seed: int, count: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(count)]


def test_the_measured_false_positive_rate_is_near_its_target() -> None:
    bloom = BloomFilter.sized(2000, FALSE_POSITIVE_RATE)
    assert (bloom.bits, bloom.hashes) == (19176, 7)  # ceil(2000 * ln(100) / ln(2)^2), rounded up to bytes
    members = random_entries(1, 2000)
    for entry in members:
        bloom.add(entry)
    assert all(entry in bloom for entry in members)
    others = random_entries(2, 100_000)
    rate = sum(entry in bloom for entry in others) / len(others)
    assert 0.007 <= rate <= 0.013  # 1%, and 100,000 trials put 3 standard deviations at 0.03 points


@pytest.mark.parametrize(("document", "message"), [
    ([], "exactly 'bits', 'hashes' and 'data'"),
    ({"bits": 64, "hashes": 1}, "exactly 'bits', 'hashes' and 'data'"),
    ({"bits": 64, "hashes": 1, "data": "A" * 12, "extra": 0}, "exactly 'bits', 'hashes' and 'data'"),
    ({"bits": 60, "hashes": 1, "data": ""}, "positive multiple of 8"),
    ({"bits": 0, "hashes": 1, "data": ""}, "positive multiple of 8"),
    ({"bits": True, "hashes": 1, "data": ""}, "positive multiple of 8"),
    ({"bits": 64, "hashes": 0, "data": ""}, "'hashes' 1 to 8"),
    ({"bits": 64, "hashes": 9, "data": ""}, "'hashes' 1 to 8"),
    ({"bits": 64, "hashes": 1.0, "data": ""}, "'hashes' 1 to 8"),
    ({"bits": 64, "hashes": 1, "data": "not base64!"}, "base64"),
    ({"bits": 64, "hashes": 1, "data": base64.b64encode(bytes(7)).decode()}, "holds 56 bits, not 64"),
])
def test_a_malformed_filter_is_refused_naming_the_field(document: object, message: str) -> None:
    with pytest.raises(SummaryError, match=message):
        BloomFilter.from_json(document)


def test_a_filter_survives_its_json_and_refuses_entries_of_the_wrong_size() -> None:
    bloom = BloomFilter.sized(10)
    bloom.add(bytes(range(32)))
    again = BloomFilter.from_json(json.loads(json.dumps(bloom.to_json())))
    assert again == bloom and bytes(range(32)) in again
    with pytest.raises(SummaryError, match="an entry is 32 bytes, got 31"):
        bloom.add(bytes(31))


def test_entries_are_keyed_per_caller_and_deduplicated() -> None:
    forms = chat_prefix_forms(CHAT)
    entries = summary_entries(ROUTER_KEY, 7, [("alice", forms[0]), ("alice", forms[0]), ("bob", forms[0])])
    assert entries == {prefix_entry(summary_key(ROUTER_KEY, caller, 7), forms[0]) for caller in ("alice", "bob")}
    assert epoch_of(6000.0) == 10 and epoch_of(5999.9) == 9


def test_a_live_filter_grows_by_adding_and_is_rebuilt_when_an_entry_goes_or_it_is_full() -> None:
    entries = random_entries(3, 200)
    live = LiveFilter.of(set(entries[:50]))
    assert (live.capacity, live.bloom.bits) == (64, 616)  # the smallest capacity
    grown = live.refreshed(set(entries[:60]))
    assert grown is live and grown.added == set(entries[:60]) and all(e in grown.bloom for e in entries[:60])
    doubled = grown.refreshed(set(entries[:65]))
    assert doubled is not grown and doubled.capacity == 128 and doubled.bloom.bits == 1232
    shrunk = doubled.refreshed(set(entries[1:65]))  # the first one's resume point is gone
    assert shrunk is not doubled and shrunk.added == set(entries[1:65]) and shrunk.capacity == 64
    assert all(e in shrunk.bloom for e in entries[1:65])


def test_the_node_keeps_one_filter_per_router_and_model_until_the_router_goes() -> None:
    filters = SummaryFilters()
    entries = random_entries(4, 3)
    first = filters.refresh("r1", "m", {entries[0]})
    assert filters.refresh("r1", "m", {entries[0]}) == first
    assert filters.refresh("r2", "m", set()) == BloomFilter.sized(64).to_json()
    grown = BloomFilter.from_json(filters.refresh("r1", "m", set(entries[:2])))
    assert entries[0] in grown and entries[1] in grown
    filters.forget("r1")
    assert entries[0] not in BloomFilter.from_json(filters.refresh("r1", "m", {entries[2]}))
    assert filters.refresh("r2", "m", set()) == BloomFilter.sized(64).to_json()
