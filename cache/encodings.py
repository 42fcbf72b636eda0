"""Attachment encodings per scope (an image's vision-tower output, a prompt's text-encoder conditioning), so that a
caller's attachment is encoded once and reused, keyed by the SHA-256 of the content's bytes and the encoder's
identity.

Keys. The cache never holds the content digest itself. Per scope it draws a random 256-bit key when the scope
first stores an encoding, and looks entries up by HMAC-SHA256 of (digest, encoder identity) under it. A raw
SHA-256 of an attachment is an unkeyed hash of a caller's content: whoever holds a candidate image (or a memory
image of the node) could confirm that a caller sent it, and the same image would carry the same name in every
scope. The per-scope tag names nothing outside its scope, and once the scope's key is zeroed (`drop_scope`) names
nothing at all. The whole 256 bits are kept: a false match would serve another attachment's encoding.

Sealing. With a `Sealer`, an encoding's bytes are sealed with AES-256-GCM under the scope's key (`cache/sealing.py`:
HKDF from the boot master key, a counter nonce per message), in messages of at most `MESSAGE_BYTES` that seal and
open on the sealer's threads; the associated data binds the boot, the scope and the entry's number (kind
"encoding"), so ciphertext moved to another entry or scope does not open. A tensor on a device is copied to host
staging before it is sealed (`cache/device_copy.py`), and opened through staging back to that device; the staging
is zeroed after use. Without a sealer (`--no-seal`) a copy is kept in the clear where the tensor was. Either way
`get` returns a fresh tensor, which the caller owns.

The sealer must be this cache's own: `drop_scope` destroys the scope's sealing key, which would also shred the
arena's state of that scope were the key shared.

Bounds. At most `scope_bytes` per scope and `max_bytes` in all (tensor bytes, as the arena counts them), least
recently used first. Dropping a scope (its caller's key removed, its time to live over) zeroes its ciphertext or
plaintext and its lookup key and forgets its sealing key: nothing of it opens or matches again. Storing and
looking up run on different threads (the engine stores after an encoder ran, a preparation thread may look up),
so every method takes the cache's lock.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cache.device_copy import PAGEABLE, HostCopies, byte_view, to_device, to_host
from cache.prefix_cache import belongs_to
from cache.scope import Scope, past_ttl
from cache.sealing import KEY_BYTES, TAG_BYTES, Place, Sealer, SealError, wipe

DIGEST_BYTES = hashlib.sha256().digest_size
MAX_BYTES = 256 << 20
"""Encodings held in all: about fifty Llava-sized images (576 positions of 4096 bfloat16 values each)."""
SCOPE_BYTES = 64 << 20
"""Encodings one scope may hold: a long conversation's images, without one caller taking the whole cache."""
MESSAGE_BYTES = 1 << 20
"""Bytes of one sealed message: an encoding of many MiB seals and opens on all the sealer's threads."""


@dataclass(frozen=True, slots=True)
class EncodingCounts:
    """What a scope (or the whole cache) holds and has done; nothing about content."""

    entries: int
    bytes: int
    encoded: int
    """Encodings stored (`put`): each is an encoder call."""
    reused: int
    """Lookups served (`get` hits): each is an encoder call saved."""


@dataclass(slots=True)
class _Encoding:
    number: int
    """Bound in the associated data of the entry's messages; unique for the cache's life."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    """Where the tensor was put from, and where `get` returns it."""
    nbytes: int
    used: int
    plain: torch.Tensor | None = None
    sealed: bytearray | None = None
    nonces: tuple[bytes, ...] = ()

    @property
    def place(self) -> Place:
        return Place(self.number, 0, self.nbytes, "encoding")


class _Shelf:
    """One scope's lookup key, encodings (least recently used first) and counts."""

    __slots__ = ("_mac_key", "entries", "bytes", "encoded", "reused", "used")

    def __init__(self) -> None:
        self._mac_key = bytearray(os.urandom(KEY_BYTES))
        self.entries: OrderedDict[bytes, _Encoding] = OrderedDict()
        """tag -> encoding, least recently used first."""
        self.bytes = 0
        self.encoded = 0
        self.reused = 0
        self.used = time.monotonic()

    def tag(self, digest: bytes, encoder: str) -> bytes:
        """HMAC of the digest (fixed length, so the pair is unambiguous) and the encoder's identity."""
        return hmac.new(self._mac_key, digest + encoder.encode(), hashlib.sha256).digest()

    def destroy(self) -> None:
        wipe(self._mac_key)
        self.entries.clear()


def _messages(flat: Any) -> list[Any]:
    """`flat` cut into the messages it is sealed as: at least one, each at most `MESSAGE_BYTES`."""
    return [flat[start:start + MESSAGE_BYTES] for start in range(0, max(len(flat), 1), MESSAGE_BYTES)]


class EncodingCache:
    def __init__(self, sealer: Sealer | None = None, max_bytes: int = MAX_BYTES, scope_bytes: int = SCOPE_BYTES,
                 host_copies: HostCopies = PAGEABLE) -> None:
        self.sealer = sealer
        """None: kept in the clear (`--no-seal`). Else this cache's own (see the module's docstring)."""
        self.max_bytes = max_bytes
        self.scope_bytes = scope_bytes
        self.host_copies = host_copies
        """How a tensor on a device reaches the cipher (host staging, pinned or not): the node sets it at start."""
        self.bytes = 0
        self.encoded = 0
        """Since start, all scopes (dropped ones included), as `reused`."""
        self.reused = 0
        self.evicted = 0
        self.open_failures = 0
        self._shelves: dict[Scope, _Shelf] = {}
        self._numbers = itertools.count(1)
        self._clock = itertools.count(1).__next__
        self._lock = threading.Lock()

    @property
    def sealing(self) -> bool:
        return self.sealer is not None

    def put(self, scope: Scope, digest: bytes, encoder: str, tensor: torch.Tensor) -> bool:
        """Keep `tensor`, the output of `encoder` for the content whose SHA-256 is `digest`, for `scope`; the caller
        keeps `tensor` (it is copied or sealed, never held). False when it is larger than a bound (not kept)."""
        _check_key(digest, encoder)
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            shelf = self._shelves.get(scope)
            if shelf is None:
                shelf = self._shelves[scope] = _Shelf()
            shelf.used = time.monotonic()
            shelf.encoded += 1
            self.encoded += 1
            if nbytes > min(self.scope_bytes, self.max_bytes):
                return False
            tag = shelf.tag(digest, encoder)
            self._forget(shelf, tag)
            entry = _Encoding(next(self._numbers), tuple(tensor.shape), tensor.dtype, tensor.device, nbytes,
                              self._clock())
            if self.sealer is None:
                entry.plain = tensor.detach().clone()
            else:
                entry.sealed, entry.nonces = self._seal(self.sealer, scope, entry, tensor)
            shelf.entries[tag] = entry
            shelf.bytes += nbytes
            self.bytes += nbytes
            while shelf.bytes > self.scope_bytes:
                self._evict(shelf)
            while self.bytes > self.max_bytes:
                self._evict(min((held for held in self._shelves.values() if held.entries),
                                key=lambda held: next(iter(held.entries.values())).used))
            return True

    def get(self, scope: Scope, digest: bytes, encoder: str) -> torch.Tensor | None:
        """A fresh copy of the encoding `put` for `scope` under (`digest`, `encoder`), on the device it was put from;
        None when there is none (or it failed to open: it is then forgotten, and the content encoded again). A normal
        tensor outside inference mode, so the caller may zero it."""
        _check_key(digest, encoder)
        with self._lock:
            shelf = self._shelves.get(scope)
            if shelf is None:
                return None
            tag = shelf.tag(digest, encoder)
            entry = shelf.entries.get(tag)
            if entry is None:
                return None
            if entry.plain is not None:
                found = entry.plain.clone()
            else:
                assert self.sealer is not None
                try:
                    found = self._open(self.sealer, scope, entry)
                except SealError:
                    self.open_failures += 1
                    self._forget(shelf, tag)
                    return None
            shelf.used, entry.used = time.monotonic(), self._clock()
            shelf.entries.move_to_end(tag)
            shelf.reused += 1
            self.reused += 1
            return found

    def _seal(self, sealer: Sealer, scope: Scope, entry: _Encoding, tensor: torch.Tensor
              ) -> tuple[bytearray, tuple[bytes, ...]]:
        """`tensor`'s bytes sealed where they lie in host memory, else from a host copy zeroed once sealed."""
        copy = None
        if self.host_copies.staged(tensor.device):
            copy = to_host(tensor, self.host_copies.staging(entry.shape, entry.dtype))
        elif not tensor.is_contiguous():
            copy = tensor.contiguous()
        try:
            parts = _messages(byte_view(tensor if copy is None else copy))
            sealed = bytearray(entry.nbytes + TAG_BYTES * len(parts))
            return sealed, tuple(sealer.seal(scope, entry.place, parts, sealed))
        finally:
            if copy is not None:
                with torch.inference_mode():  # an engine's copy is an inference tensor
                    copy.zero_()

    def _open(self, sealer: Sealer, scope: Scope, entry: _Encoding) -> torch.Tensor:
        """The entry opened into a fresh tensor on its device (through host staging, zeroed, for a device)."""
        assert entry.sealed is not None
        staged = self.host_copies.staged(entry.device)
        host = (self.host_copies.staging(entry.shape, entry.dtype) if staged
                else torch.empty(entry.shape, dtype=entry.dtype))
        try:
            outs = _messages(byte_view(host))
            sealer.run_open(sealer.open_jobs(scope, entry.place, entry.nonces, entry.sealed, outs))
        except SealError:
            host.zero_()
            raise
        if not staged:
            return host
        target = torch.empty(entry.shape, dtype=entry.dtype, device=entry.device)
        to_device(host, target)
        host.zero_()
        return target

    def _evict(self, shelf: _Shelf) -> None:
        self._forget(shelf, next(iter(shelf.entries)))
        self.evicted += 1

    @torch.inference_mode()
    def _forget(self, shelf: _Shelf, tag: bytes) -> None:
        """Zero an entry's bytes, sealed or plain, and let it go."""
        entry = shelf.entries.pop(tag, None)
        if entry is None:
            return
        if entry.sealed is not None:
            wipe(entry.sealed)
        if entry.plain is not None:
            entry.plain.zero_()
        entry.plain, entry.sealed = None, None
        shelf.bytes -= entry.nbytes
        self.bytes -= entry.nbytes

    def drop(self, select: Callable[[Scope], bool]) -> list[Scope]:
        """Zero the selected scopes' encodings and lookup keys and destroy their sealing keys; returns them."""
        with self._lock:
            dropped = [scope for scope in self._shelves if select(scope)]
            for scope in dropped:
                shelf = self._shelves.pop(scope)
                for tag in list(shelf.entries):
                    self._forget(shelf, tag)
                shelf.destroy()
                if self.sealer is not None:
                    self.sealer.forget(scope)
        return dropped

    def drop_scope(self, scope: Scope) -> None:
        self.drop(lambda held: held == scope)

    def drop_caller(self, caller: str) -> list[Scope]:
        """Drop every scope of `caller` and of the callers it acts for as a router (its key was removed)."""
        return self.drop(lambda scope: belongs_to(scope, caller))

    def expire(self, ttl_of: Callable[[str], float | None], now: float | None = None) -> list[Scope]:
        """Drop the scopes unused for longer than their caller's time to live (None: no limit)."""
        now = time.monotonic() if now is None else now
        return self.drop(lambda scope: past_ttl(scope, self._shelves[scope].used, ttl_of, now))

    def counts(self, scope: Scope) -> EncodingCounts:
        """The scope's counts since it first stored an encoding (zeros once it is dropped)."""
        with self._lock:
            shelf = self._shelves.get(scope)
            if shelf is None:
                return EncodingCounts(0, 0, 0, 0)
            return EncodingCounts(len(shelf.entries), shelf.bytes, shelf.encoded, shelf.reused)

    def describe(self) -> dict[str, Any]:
        """Counts and bytes for `GET /v1/node`: nothing about content, nor whose it is."""
        with self._lock:
            return {"entries": sum(len(shelf.entries) for shelf in self._shelves.values()), "bytes": self.bytes,
                    "scopes": len(self._shelves), "encoded": self.encoded, "reused": self.reused,
                    "evicted": self.evicted, "open_failures": self.open_failures, "sealed": self.sealing,
                    "max_bytes": self.max_bytes, "scope_bytes": self.scope_bytes}


def _check_key(digest: bytes, encoder: str) -> None:
    if len(digest) != DIGEST_BYTES:
        raise ValueError(f"a content digest is the {DIGEST_BYTES} bytes of a SHA-256, not {len(digest)} bytes")
    if not encoder:
        raise ValueError("an encoder identity names the encoder's weights and settings; it must not be empty")
