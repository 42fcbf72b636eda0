"""Prefix summaries: what a node tells one router about the prefixes it holds warm, readable only by that router.

Construction. For a caller `c` reached through router `r` in epoch `e`:

    K(r, c, e) = HKDF-SHA256(ikm = r's API key at the node, salt = e as 8 big-endian bytes,
                             info = "tenzro-summary-v1" || 0x00 || c)
    entry      = HMAC-SHA256(K, SHA-256(prefix form))

A prefix form is the canonical JSON of a chat's first k messages (`chat_prefix_forms`), or of a text
completion's whole prompt (`completion_prefix_form`): what the node's chat template turns into the token ids
up to a message boundary, so a router tests a request's prefixes without the model's tokenizer. The node adds
an entry for every chat message boundary and reply end (the chat with the reply appended: the next turn's
history) and every text completion's prompt where it still holds a resume point for the caller; entries go
into a Bloom filter of `bits` bits and `hashes` hash functions (`BloomFilter`), which the node signs with its
key. An epoch is `EPOCH_S` seconds of Unix time; the node keeps each router's filter between reads
(`SummaryFilters`) and adds what is new, sized to a power of two of entries at FALSE_POSITIVE_RATE.

Threat model. Only the router and the node know the API key, so only they can compute K: anyone else who
obtains a summary (a network observer, another router, another caller) cannot test a candidate prompt against
it and learns its size (bits set, entry count) and nothing more. The router itself learns, for the callers it
routes, which of their own prefixes a node holds, which it sees in their requests anyway. K differs per caller
and per epoch, so two callers' identical prompts, or one prompt in two epochs, give unrelated entries. No token
id, no text and no unkeyed digest leaves the node: the SHA-256 of a prefix form stays in its memory.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

SUMMARY_INFO = b"tenzro-summary-v1"
ENTRY_BYTES = 32
MAX_HASHES = ENTRY_BYTES // 4
"""Each hash function reads its own 4 bytes of the entry."""
EPOCH_S = 600
"""Seconds per epoch. Entry keys change with the epoch, so the same prefix gives unrelated entries in two epochs:
summaries cannot be linked entry by entry across epochs, and a router re-reads at least once per epoch."""


def epoch_of(unix_s: float) -> int:
    return int(unix_s // EPOCH_S)


class SummaryError(ValueError):
    """A summary document or filter is malformed; the message names the field."""


def summary_key(router_key: str, caller: str, epoch: int) -> bytes:
    """K(r, c, e): the HMAC key of one caller's entries in one epoch."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=epoch.to_bytes(8, "big"),
                info=SUMMARY_INFO + b"\0" + caller.encode()).derive(router_key.encode())


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _text(content: Any) -> Any:
    """A message's content as the node reads it: a string, a list of text parts joined, or "" for none (an
    assistant's); anything else is kept as it is, a form no node request has."""
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str) for part in content):
        return "".join(part["text"] for part in content)
    return content


class ChatForms:
    """The forms of a chat's prefixes in one pass: SHA-256 over the canonical messages so far, closed at each
    message. `reply_form` forms the chat continued by a reply without hashing the chat again, so the node forms
    the prefix ending with a reply (the next turn's history) after the reply, in time linear in the reply."""

    __slots__ = ("_digest", "_count")

    def __init__(self) -> None:
        self._digest = hashlib.sha256(b"[")
        self._count = 0

    def add(self, message: Mapping[str, Any]) -> bytes:
        """Append `message` (its role and content; other fields do not reach the prompt's tokens) and return the
        form of the chat so far."""
        self._digest.update((b"," if self._count else b"")
                            + _canonical({"content": _text(message["content"]), "role": message["role"]}))
        self._count += 1
        closed = self._digest.copy()
        closed.update(b"]")
        return closed.digest()

    def reply_form(self, reply: str) -> bytes:
        """The form of the chat so far followed by the assistant's `reply`; this object is left as it is."""
        continued = ChatForms()
        continued._digest, continued._count = self._digest.copy(), self._count
        return continued.add({"role": "assistant", "content": reply})


def chat_prefix_forms(messages: Sequence[Mapping[str, Any]]) -> list[bytes]:
    """SHA-256 of the canonical form of each prefix of a chat: `[:1]`, `[:2]`, ... `[:n]` (role and content of
    each message, content as the node reads it: a list of text parts is their joined text)."""
    forms = ChatForms()
    return [forms.add(message) for message in messages]


def completion_prefix_form(prompt: str | Sequence[int]) -> bytes:
    """SHA-256 of a text completion's prompt (a string, or token ids) in canonical form."""
    return hashlib.sha256(_canonical({"prompt": prompt if isinstance(prompt, str) else list(prompt)})).digest()


def prefix_entry(key: bytes, form: bytes) -> bytes:
    return hmac.new(key, form, hashlib.sha256).digest()


@dataclass(slots=True)
class BloomFilter:
    """`bits` bits, `hashes` positions per entry, each from 4 bytes of the (already uniform) HMAC entry."""

    bits: int
    hashes: int
    data: bytearray

    @classmethod
    def sized(cls, capacity: int, false_positive_rate: float = 0.01) -> BloomFilter:
        """The smallest filter holding `capacity` entries at the given false-positive rate."""
        capacity = max(capacity, 1)
        bits = max(64, math.ceil(-capacity * math.log(false_positive_rate) / math.log(2) ** 2))
        bits = -(-bits // 8) * 8
        hashes = min(MAX_HASHES, max(1, round(bits / capacity * math.log(2))))
        return cls(bits, hashes, bytearray(bits // 8))

    def _positions(self, entry: bytes) -> Iterable[int]:
        if len(entry) != ENTRY_BYTES:
            raise SummaryError(f"an entry is {ENTRY_BYTES} bytes, got {len(entry)}")
        return (int.from_bytes(entry[4 * i:4 * i + 4], "big") % self.bits for i in range(self.hashes))

    def add(self, entry: bytes) -> None:
        for position in self._positions(entry):
            self.data[position >> 3] |= 1 << (position & 7)

    def __contains__(self, entry: bytes) -> bool:
        return all(self.data[position >> 3] >> (position & 7) & 1 for position in self._positions(entry))

    def to_json(self) -> dict[str, Any]:
        return {"bits": self.bits, "hashes": self.hashes, "data": base64.b64encode(bytes(self.data)).decode()}

    @classmethod
    def from_json(cls, obj: Any) -> BloomFilter:
        if not isinstance(obj, dict) or set(obj) != {"bits", "hashes", "data"}:
            raise SummaryError("a Bloom filter is an object with exactly 'bits', 'hashes' and 'data'")
        bits, count = obj["bits"], obj["hashes"]
        if type(bits) is not int or bits <= 0 or bits % 8 or type(count) is not int or not 1 <= count <= MAX_HASHES:
            raise SummaryError(f"'bits' must be a positive multiple of 8 and 'hashes' 1 to {MAX_HASHES}")
        try:
            data = bytearray(base64.b64decode(obj["data"], validate=True))
        except (ValueError, TypeError) as exc:
            raise SummaryError("'data' must be base64") from exc
        if len(data) * 8 != bits:
            raise SummaryError(f"'data' holds {len(data) * 8} bits, not {bits}")
        return cls(bits, count, data)


def summary_entries(router_key: str, epoch: int, warm: Iterable[tuple[str, bytes]]) -> set[bytes]:
    """The entries of `warm` (caller, form) pairs in `epoch`, keyed for the router holding `router_key`."""
    keys: dict[str, bytes] = {}
    entries = set()
    for caller, form in warm:
        key = keys.get(caller)
        if key is None:
            key = keys[caller] = summary_key(router_key, caller, epoch)
        entries.add(prefix_entry(key, form))
    return entries


MIN_CAPACITY = 64


def _capacity(entries: int) -> int:
    """The power of two at least `entries` (and MIN_CAPACITY): the filter grows by doubling, so most reads add to
    it instead of rebuilding it, and stays within FALSE_POSITIVE_RATE for every count up to its capacity."""
    return 1 << (max(entries, MIN_CAPACITY) - 1).bit_length()


FALSE_POSITIVE_RATE = 0.01


@dataclass(slots=True)
class LiveFilter:
    """A summary's filter kept between reads: `added` is exactly what it holds (keyed entries only)."""

    bloom: BloomFilter
    added: set[bytes]
    capacity: int

    @classmethod
    def of(cls, entries: set[bytes]) -> LiveFilter:
        capacity = _capacity(len(entries))
        bloom = BloomFilter.sized(capacity, FALSE_POSITIVE_RATE)
        for entry in entries:
            bloom.add(entry)
        return cls(bloom, set(entries), capacity)

    def refreshed(self, entries: set[bytes]) -> LiveFilter:
        """This filter holding exactly `entries`: the new ones added, or a new filter when one it holds is no
        longer live (a Bloom filter cannot remove an entry) or when they outgrow its capacity."""
        if len(entries) > self.capacity or not self.added <= entries:
            return LiveFilter.of(entries)
        for entry in entries - self.added:
            self.bloom.add(entry)
        self.added |= entries
        return self


class SummaryFilters:
    """The live filters of one node, one per (router, model); a new epoch's entries all differ from the last
    one's, so its first read rebuilds the filter. Safe to use from several threads."""

    def __init__(self) -> None:
        self._filters: dict[tuple[str, str], LiveFilter] = {}
        self._lock = threading.Lock()

    def refresh(self, router: str, model: str, entries: set[bytes]) -> dict[str, Any]:
        """The filter holding exactly `entries`, as `BloomFilter.to_json` writes it."""
        with self._lock:
            current = self._filters.get((router, model))
            current = LiveFilter.of(entries) if current is None else current.refreshed(entries)
            self._filters[(router, model)] = current
            return current.bloom.to_json()

    def forget(self, router: str) -> None:
        """The router's key was removed: its filters go with its callers' state."""
        with self._lock:
            for key in [key for key in self._filters if key[0] == router]:
                del self._filters[key]
