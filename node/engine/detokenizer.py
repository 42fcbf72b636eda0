"""Turning generated ids into text deltas, holding back anything that may turn into a stop string."""

from __future__ import annotations

from typing import Any


class Detokenizer:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._ids: list[int] = []
        self._emitted = 0
        self.text = ""
        self.stopped = False
        self.matched: str | None = None
        """The stop string that ended the text (the earliest in it), once `stopped`."""

    def push(self, token_id: int) -> str:
        """Add one generated id; returns the text that is now safe to send (may be empty)."""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        for stop in self._stop:
            index = text.find(stop, max(0, self._emitted - len(stop) + 1))
            if index != -1:
                text = text[:index]
                self.stopped, self.matched = True, stop
        self.text = text
        safe = len(text) if self.stopped else len(text) - self._held_back(text)
        delta = text[self._emitted:safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        return delta

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def flush(self) -> str:
        """The rest of the text at the end of generation."""
        delta = self.text[self._emitted:]
        self._emitted = len(self.text)
        return delta
