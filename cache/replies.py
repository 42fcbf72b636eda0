"""The replies this node generated, per scope, so that a reply sent back in a conversation is its own ids again.

A chat client sends the conversation back as text. A reply's text re-tokenizes to other ids than the ones the
model generated (a byte-level BPE merges the decoded text differently), and the stored state, computed for the
generated ids, stops matching at the first id that differs: the README's three-turn example reused 31 of 44
earlier tokens, and billed the rest again as cached writes. When an assistant message's content is, exactly, a
reply this node generated for the same scope, the renderer takes that reply's ids in its place
(`chat_template.render_chat`): the model reads what it wrote, and the stored reply matches whole.

The book holds no text and no id in the clear. Per scope it draws two random keys when the scope first records a
reply: the lookup tag of a reply is HMAC-SHA256 of its text under the first, and the reply's ids are sealed with
AES-256-GCM under the second (a counter nonce, the tag as associated data). Both live in memory only and are zeroed
when the scope is dropped (its caller's key removed, its time to live over); the most recent `MAX_REPLIES` replies
of a scope are kept. Recording and recalling run on different threads (the worker records as a request ends, a
preparation thread recalls while rendering the next), so every method takes the book's lock.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from cache.scope import Scope, past_ttl

MAX_REPLIES = 256
"""Replies remembered per scope, the most recent: a conversation re-sends its last few; an agent's loop, its own."""
MAX_BYTES = 64 << 20
"""Sealed ids the whole book holds (4 bytes an id): past it the least recently used scope's oldest replies go
first. A router's callers can be many scopes; the book must not grow with them unbounded."""
KEY_BYTES = 32
TAG_BYTES = 16
"""Of the HMAC: a false match needs two texts of one scope to agree in 128 bits, and is then still only ids that
the same model wrote for this caller, never another caller's."""


class _Shelf:
    """One scope's keys and sealed replies."""

    __slots__ = ("_mac_key", "_seal_key", "_aead", "_nonce", "entries", "used")

    def __init__(self) -> None:
        self._mac_key = bytearray(os.urandom(KEY_BYTES))
        self._seal_key = bytearray(os.urandom(KEY_BYTES))
        self._aead = AESGCM(self._seal_key)
        self._nonce = 0
        self.entries: OrderedDict[bytes, tuple[bytes, bytes]] = OrderedDict()
        """tag -> (nonce, sealed ids), oldest first."""
        self.used = time.monotonic()

    def tag(self, text: str) -> bytes:
        return hmac.new(self._mac_key, text.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()[:TAG_BYTES]

    def seal(self, tag: bytes, ids: Sequence[int]) -> tuple[bytes, bytes]:
        self._nonce += 1
        nonce = self._nonce.to_bytes(12, "little")
        plain = np.fromiter(ids, dtype="<u4", count=len(ids))
        try:
            return nonce, self._aead.encrypt(nonce, plain.tobytes(), tag)
        finally:
            plain.fill(0)

    def open(self, tag: bytes, nonce: bytes, sealed: bytes) -> list[int]:
        return np.frombuffer(self._aead.decrypt(nonce, sealed, tag), dtype="<u4").tolist()

    def destroy(self) -> None:
        self._mac_key[:] = bytes(KEY_BYTES)
        self._seal_key[:] = bytes(KEY_BYTES)
        self._aead = None  # type: ignore[assignment]
        self.entries.clear()


class ReplyBook:
    def __init__(self, per_scope: int = MAX_REPLIES, max_bytes: int = MAX_BYTES) -> None:
        self.per_scope = per_scope
        self.max_bytes = max_bytes
        self.bytes = 0
        """Sealed bytes held, all scopes."""
        self._shelves: dict[Scope, _Shelf] = {}
        self._lock = threading.Lock()

    def record(self, scope: Scope, text: str, ids: Sequence[int]) -> None:
        """Remember that `ids` (whose decoding is exactly `text`) is a reply generated for `scope`."""
        if not text or not ids:
            return
        with self._lock:
            shelf = self._shelves.get(scope)
            if shelf is None:
                shelf = self._shelves[scope] = _Shelf()
            shelf.used = time.monotonic()
            tag = shelf.tag(text)
            self._forget(shelf, tag)
            shelf.entries[tag] = shelf.seal(tag, ids)
            self.bytes += len(shelf.entries[tag][1])
            while len(shelf.entries) > self.per_scope:
                self._forget(shelf, next(iter(shelf.entries)))
            while self.bytes > self.max_bytes:
                coldest = min(self._shelves.values(), key=lambda held: held.used if held.entries else float("inf"))
                self._forget(coldest, next(iter(coldest.entries)))

    def _forget(self, shelf: _Shelf, tag: bytes) -> None:
        entry = shelf.entries.pop(tag, None)
        if entry is not None:
            self.bytes -= len(entry[1])

    def recall(self, scope: Scope, text: str) -> list[int] | None:
        """The ids of the reply generated for `scope` whose text is `text`, or None."""
        with self._lock:
            shelf = self._shelves.get(scope)
            if shelf is None or not text:
                return None
            tag = shelf.tag(text)
            entry = shelf.entries.get(tag)
            if entry is None:
                return None
            shelf.used = time.monotonic()
            shelf.entries.move_to_end(tag)
            try:
                return shelf.open(tag, *entry)
            except InvalidTag:  # altered in memory: forgotten, and the text is tokenized as text
                self._forget(shelf, tag)
                return None

    def replies(self, scope: Scope) -> int:
        with self._lock:
            shelf = self._shelves.get(scope)
            return 0 if shelf is None else len(shelf.entries)

    def drop(self, select: Callable[[Scope], bool]) -> list[Scope]:
        """Forget the selected scopes' replies and zero their keys; returns them."""
        with self._lock:
            dropped = [scope for scope in self._shelves if select(scope)]
            for scope in dropped:
                shelf = self._shelves.pop(scope)
                self.bytes -= sum(len(sealed) for _, sealed in shelf.entries.values())
                shelf.destroy()
        return dropped

    def expire(self, ttl_of: Callable[[str], float | None], now: float | None = None) -> list[Scope]:
        """Forget the scopes unused for longer than their caller's time to live (None: no limit)."""
        now = time.monotonic() if now is None else now
        return self.drop(lambda scope: past_ttl(scope, self._shelves[scope].used, ttl_of, now))
