"""Seeded random prompts as token ids: cold ones share nothing, reused ones share exactly their prefix."""

from __future__ import annotations

import random
from collections.abc import Collection

TOKEN_LOW, TOKEN_HIGH = 100, 30000  # clear of special tokens and inside the embedded models' 32000 vocab
SEED = 0
"""The seed of benchmarks whose prompts do not vary between rounds."""


class PromptSource:
    """Seeded random token ids. Every prefix starts with a token no earlier prompt started with, so a
    server can reuse nothing of a prompt meant to be cold, and two suffixes of one prefix differ at once."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._first_tokens: set[int] = set()

    def _token(self) -> int:
        return self._rng.randrange(TOKEN_LOW, TOKEN_HIGH)

    def _ids(self, count: int, first_not_in: Collection[int]) -> list[int]:
        first = self._token()
        while first in first_not_in:
            first = self._token()
        return [first] + [self._token() for _ in range(count - 1)]

    def prefix(self, count: int) -> list[int]:
        assert len(self._first_tokens) < TOKEN_HIGH - TOKEN_LOW
        ids = self._ids(count, self._first_tokens)
        self._first_tokens.add(ids[0])
        return ids

    def suffix(self, count: int, unlike: Collection[int] = ()) -> list[int]:
        return self._ids(count, unlike)
