"""Keyed token digests: how the prefix index holds a scope's token runs without holding its token ids.

With the public tokenizer, token ids are the prompt's text. The index must still match a new prompt token by
token against what a scope stored, so it keeps, for the token `t` at position `p`, the digest
`AES-256_K(p || t)` (the first 8 bytes of one block), under a key `K` drawn at random for the scope and never
written anywhere. Equal digests at one position mean equal tokens there (different blocks under one key never
encrypt to the same 16 bytes; 8 of them collide with probability 2^-64 per pair), so a common prefix of digests
is a common prefix of tokens. Without `K` a memory image shows 64 random-looking bits per token: no id, and,
since the position is in every block, not even which positions hold the same token. Dropping the scope zeroes
`K` and every digest it made.

AES in ECB mode over distinct blocks is a keyed pseudorandom permutation used as a PRF, one library call for a
whole prompt (cryptography's OpenSSL, with AES-NI where the CPU has it); the ids pass through a scratch array
that is zeroed before it is freed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import overload

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

KEY_BYTES = 32
BLOCK_WORDS = 2
"""A block is two little-endian 64-bit words: the token's position, then its id."""


class DigestRun(Sequence[int]):
    """A run of one scope's token digests: `digests[i]` is the digest of the token at position `start + i` of
    the sequence it was cut from. Slices are views of the same words (no copy); `==` compares element-wise."""

    __slots__ = ("_words", "owner")

    def __init__(self, words: np.ndarray, owner: TokenDigester) -> None:
        self._words = words
        self.owner = owner
        """The digester whose key made these digests: a run is only ever compared within its own scope."""

    def __len__(self) -> int:
        return len(self._words)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> DigestRun: ...

    def __getitem__(self, index: int | slice) -> int | DigestRun:
        if isinstance(index, slice):
            return DigestRun(self._words[index], self.owner)
        return int(self._words[index])

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, DigestRun) and other.owner is self.owner
                and bool(np.array_equal(self._words, other._words)))

    __hash__ = None  # type: ignore[assignment]  # mutable (wipe): never a dict key

    def common_prefix_length(self, other: DigestRun) -> int:
        """How many leading digests the two runs share."""
        n = min(len(self), len(other))
        differ = np.flatnonzero(self._words[:n] != other._words[:n])
        return int(differ[0]) if len(differ) else n

    def wipe(self) -> None:
        """Zero the digests (and so every view sharing them)."""
        self._words.fill(0)

    def __repr__(self) -> str:  # the digests themselves are never printed
        return f"DigestRun({len(self)} tokens)"


class TokenDigester:
    """One scope's key and the digests it makes. Not thread-safe: the engine's worker thread owns the index."""

    def __init__(self) -> None:
        self._key = bytearray(os.urandom(KEY_BYTES))
        self._ecb = Cipher(algorithms.AES(self._key), modes.ECB()).encryptor()
        self.destroyed = False

    def run(self, tokens: Sequence[int]) -> DigestRun:
        """The digests of `tokens`, which start at position 0 of a prompt: `[len(tokens)]` words."""
        if self.destroyed:
            raise RuntimeError("the digester was destroyed with its scope")  # a bug of ours, not bad input
        n = len(tokens)
        ids = np.fromiter(tokens, dtype="<u8", count=n)
        blocks = np.empty((n, BLOCK_WORDS), dtype="<u8")
        try:
            blocks[:, 0] = np.arange(n, dtype="<u8")
            blocks[:, 1] = ids
            sealed = self._ecb.update(blocks.view(np.uint8).reshape(-1).data)
        finally:
            ids.fill(0)
            blocks.fill(0)
        words = np.frombuffer(sealed, dtype="<u8").reshape(n, BLOCK_WORDS)[:, 0].copy()
        return DigestRun(words, self)

    def destroy(self) -> None:
        """Zero the key; OpenSSL cleanses its key schedule when the context is freed."""
        self._key[:] = bytes(KEY_BYTES)
        self._ecb = None  # type: ignore[assignment]
        self.destroyed = True
