"""Sealing stored state: AES-256-GCM under a key per scope, with associated data naming where a message belongs.

Keys. A 256-bit master key is drawn from the OS at start and held in one locked, never-copied buffer; it is
never written, logged or exported, so a restart forgets every sealed entry by design. A scope's key is
HKDF-SHA256 of the master key with a random 256-bit salt drawn when that scope's key is made, and info naming
this boot and the scope. The salt lives only beside the key: `forget` destroys both, so what was sealed
under them cannot be opened again even by code holding the master key (crypto-shredding), and a scope that
comes back later gets a new salt, hence a new key.

Nonces. Each scope key counts its messages: the nonce is the 96-bit big-endian count, taken once per
message. A key is never re-derived (its salt is random and forgotten with it), so no (key, nonce) pair
repeats; the count cannot wrap (2^96 messages).

Associated data binds the boot, the scope, the entry handle, the token range, the state kind and the
message's index inside the entry: a message opened under another scope, moved to another handle or place,
or altered, fails authentication. `SealError` says so and never carries plaintext.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from cache.scope import Scope

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
AD_VERSION = b"tenzro-seal-v1"

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


class SealError(Exception):
    """A sealed message failed to open: altered, moved, or opened under another scope or key."""


def wipe(buffer: bytes | bytearray) -> None:
    """Overwrite a key's bytes in place (immutable `bytes` included: the copy is ours alone)."""
    if isinstance(buffer, bytearray):
        address = ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))
    else:
        address = ctypes.cast(ctypes.c_char_p(buffer), ctypes.c_void_p).value or 0
    ctypes.memset(address, 0, len(buffer))


def _lock(buffer: bytearray) -> bool:
    address = ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))
    return _libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(len(buffer))) == 0


@dataclass(frozen=True, slots=True)
class Place:
    """Where a sealed message belongs; all of it goes into the associated data."""

    handle: int
    start: int
    end: int
    kind: str
    """"span" (full-attention K/V of tokens [start, end)) or "snapshot" (the state at `end`)."""


class _ScopeKey:
    __slots__ = ("aead", "count")

    def __init__(self, aead: AESGCM) -> None:
        self.aead = aead
        self.count = 0

    def nonce(self) -> bytes:
        self.count += 1
        return self.count.to_bytes(NONCE_BYTES, "big")


class Sealer:
    """Per-scope AES-256-GCM keys from one boot master key, and a thread pool to open and seal on all cores.

    pyca's `encrypt_into`/`decrypt_into` release the interpreter lock, so messages of one entry run in
    parallel threads.

    Rows that open while the forward reading them computes (`open_later`) open on the cores the forward leaves
    idle, `threads - compute_threads` of them: on all cores, the opening threads would share the forward's core
    with it, and a sealed hit's time to first token over a hot hit's is lower when they do not (`bench seal`;
    RESULTS.md, 2026-12-04). A forward on every core leaves none idle: then all threads open.
    """

    def __init__(self, threads: int | None = None, compute_threads: int = 0) -> None:
        self.boot_id = os.urandom(16)
        self._master = bytearray(KEY_BYTES)
        fresh = os.urandom(KEY_BYTES)
        self._master[:] = fresh
        wipe(fresh)
        self.master_locked = _lock(self._master)
        self._keys: dict[Scope, _ScopeKey] = {}
        self.threads = threads or len(os.sched_getaffinity(0))
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="seal")
        self.beside = self.threads - compute_threads if 0 < compute_threads < self.threads else self.threads
        """How many threads open rows beside a computing forward (`open_later`)."""
        self._beside_pool = (self._pool if self.beside == self.threads
                             else ThreadPoolExecutor(self.beside, thread_name_prefix="open"))

    def _key(self, scope: Scope) -> _ScopeKey:
        key = self._keys.get(scope)
        if key is None:
            info = b"\0".join((AD_VERSION, self.boot_id, scope.caller.encode(), scope.model.encode()))
            master = bytes(self._master)
            derived = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=os.urandom(32), info=info).derive(master)
            wipe(master)
            key = self._keys[scope] = _ScopeKey(AESGCM(derived))
            wipe(derived)  # the cipher context holds its own schedule; this copy is gone
        return key

    def has_key(self, scope: Scope) -> bool:
        return scope in self._keys

    def forget(self, scope: Scope) -> None:
        """Destroy the scope's key: nothing sealed under it opens again."""
        self._keys.pop(scope, None)

    def _ad_prefix(self, scope: Scope, place: Place) -> bytes:
        """Everything of an entry's associated data but the message index (built once per entry, not per message)."""
        caller, model = scope.caller.encode(), scope.model.encode()
        return b"".join((AD_VERSION, self.boot_id, struct.pack(">H", len(caller)), caller,
                         struct.pack(">H", len(model)), model,
                         struct.pack(">QQQ", place.handle, place.start, place.end), place.kind.encode()))

    def open_jobs_at(self, scope: Scope, place: Place, messages: Sequence[tuple[int, bytes, Any, Any]]
                     ) -> list[tuple[Any, ...]]:
        """The decryptions of (index, nonce, sealed bytes, out) messages of one entry, for `run_open`."""
        key = self._keys.get(scope)
        if key is None:
            raise SealError("this scope's key is gone: its state was shredded")
        prefix, aead, pack = self._ad_prefix(scope, place), key.aead, struct.Struct(">I").pack
        return [(aead, nonce, data, prefix + pack(index), out) for index, nonce, data, out in messages]

    def seal(self, scope: Scope, place: Place, parts: Sequence[Any], out: Any, first: int = 0) -> list[bytes]:
        """Seal each of `parts` (contiguous byte buffers) into `out`, one after another, each followed by its
        tag, as messages `first`, `first + 1`, ... of the entry; returns the nonces. `out` must hold sum(len) +
        TAG_BYTES per part."""
        key = self._key(scope)
        nonces = [key.nonce() for _ in parts]
        view, prefix = memoryview(out), self._ad_prefix(scope, place)
        jobs, offset = [], 0
        for index, (part, nonce) in enumerate(zip(parts, nonces, strict=True)):
            size = memoryview(part).nbytes
            out_view = view[offset:offset + size + TAG_BYTES]
            jobs.append((nonce, part, prefix + struct.pack(">I", first + index), out_view))
            offset += size + TAG_BYTES
        self._run(key.aead.encrypt_into, jobs)
        return nonces

    def open_jobs(self, scope: Scope, place: Place, nonces: Sequence[bytes], sealed: bytearray | memoryview,
                  outs: Sequence[Any]) -> list[tuple[Any, ...]]:
        """The decryptions that open every message of an entry into `outs`."""
        view, messages, offset = memoryview(sealed), [], 0
        for index, (nonce, out) in enumerate(zip(nonces, outs, strict=True)):
            size = memoryview(out).nbytes
            messages.append((index, nonce, view[offset:offset + size + TAG_BYTES], out))
            offset += size + TAG_BYTES
        if offset != len(sealed):
            raise SealError("a sealed entry does not have the size its layout says")
        return self.open_jobs_at(scope, place, messages)

    def run_open(self, jobs: Sequence[tuple[Any, ...]]) -> None:
        self._spread(_open_share, jobs)

    def open_later(self, jobs: Sequence[tuple[Any, ...]]) -> list[Future[None]]:
        """`run_open` in the `beside` threads, returning at once: one future per thread's share of `jobs`, whose
        `result()` raises SealError where a message of the share failed."""
        return [self._beside_pool.submit(_open_share, share) for share in self._shares(jobs, self.beside)]

    def _run(self, method: Any, jobs: list[tuple[Any, ...]]) -> None:
        def some(share: Sequence[tuple[Any, ...]]) -> None:
            for job in share:
                method(*job)

        self._spread(some, jobs)

    def _shares(self, jobs: Sequence[tuple[Any, ...]], threads: int = 0) -> list[Sequence[tuple[Any, ...]]]:
        """One contiguous share of `jobs` per thread (`threads`, else all): one task each, not one per message."""
        size = -(-len(jobs) // max(1, min(threads or self.threads, len(jobs))))
        return [jobs[i:i + size] for i in range(0, len(jobs), max(1, size))]

    def _spread(self, work: Any, jobs: Sequence[tuple[Any, ...]]) -> None:
        """`work` over `_shares(jobs)`."""
        parts = self._shares(jobs)
        if len(parts) <= 1:
            work(jobs)
            return
        # The calling thread takes a share itself: one thread fewer to wake, one core less idle.
        others = [self._pool.submit(work, part) for part in parts[1:]]
        try:
            work(parts[0])
        finally:
            for other in others:
                other.result()


def _open_share(share: Sequence[tuple[Any, ...]]) -> None:
    """Open (aead, nonce, sealed bytes, associated data, out) messages one after another."""
    try:
        for aead, nonce, data, ad, out in share:
            aead.decrypt_into(nonce, data, ad, out)
    except InvalidTag:
        raise SealError("a sealed entry failed authentication") from None
