"""Chat messages rendered to token ids here, with the served model's own tokenizer and chat template.

A benchmark that counts a chat's tokens before it sends it (to prime a node at an exact position, or to
know what a node could at best reuse) renders it as the server does: the template's text, tokenized
without special-token parsing of anything else. The bench's messages hold no special-token text, which a
node would tokenize as plain text; a request with `return_token_ids` checks the rendering against the
server's own.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from bench.client import BenchError, Messages

MIN_WORDS = 1000
"""Single-token words the chat form needs from the tokenizer, so that messages have exact token counts."""


def load_tokenizer(model: Path) -> Any | None:
    """The tokenizer of the model directory `model`, or None when it has none."""
    if not (model / "tokenizer.json").is_file() and not (model / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def chat_ids(tokenizer: Any, messages: Messages, generation_prompt: bool = True) -> list[int]:
    """The token ids of `messages` as rendered by the chat template, with the generation prompt (what a node
    computes for a chat completion) or without it (the conversation so far)."""
    if not messages:
        return []
    if not getattr(tokenizer, "chat_template", None):
        raise BenchError("the model has no chat template, which the chat form needs")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


class ChatMessages:
    """Chat messages of exact token counts, and their token ids, from the served model's tokenizer.

    A message's content is a run of words that are each one token with their leading space, so a message
    of `n` tokens is its role's fixed overhead plus `n - overhead` words.
    """

    def __init__(self, tokenizer: Any, rng: random.Random) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        decoded = tokenizer.batch_decode([[token] for token in range(len(tokenizer))])
        candidates = [text for text in decoded if text[:1] == " " and text[1:].isascii() and text[1:].isalpha()]
        encoded = tokenizer(candidates, add_special_tokens=False)["input_ids"] if candidates else []
        self.words = [text for text, ids in zip(candidates, encoded, strict=True) if len(ids) == 1]
        if len(self.words) < MIN_WORDS:
            raise BenchError(f"the chat form needs a tokenizer with at least {MIN_WORDS} words that are one "
                             f"token each with their leading space; this one has {len(self.words)}")
        empty = [{"role": "user", "content": ""}]
        self.generation_prompt = len(self.ids(empty)) - len(self.history_ids(empty))

    def ids(self, messages: Messages) -> list[int]:
        """What the node computes: the rendered messages and the generation prompt."""
        return chat_ids(self.tokenizer, messages)

    def history_ids(self, messages: Messages) -> list[int]:
        """The rendered messages alone, without the generation prompt."""
        return chat_ids(self.tokenizer, messages, generation_prompt=False)

    def message(self, role: str, tokens: int) -> dict[str, str]:
        overhead = len(self.history_ids([{"role": role, "content": ""}]))
        if tokens <= overhead:
            raise BenchError(f"a {role} message of {tokens} tokens leaves no room for content")
        return {"role": role, "content": "".join(self.rng.choice(self.words) for _ in range(tokens - overhead))}

    def edited(self, message: dict[str, str], at: float = 0.5) -> dict[str, str]:
        """The same message with the word `at` of the way through it (the middle one by default) replaced by
        another."""
        words = message["content"].split(" ")[1:]
        middle = min(len(words) - 1, int(len(words) * at))
        other = words[middle]
        while other == words[middle]:
            other = self.rng.choice(self.words)[1:]
        words[middle] = other
        return {**message, "content": "".join(" " + word for word in words)}
