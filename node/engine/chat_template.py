"""Rendering chat messages to token ids, with the token positions where each message starts.

Message boundaries are where conversations diverge: an agent re-sends its history and changes one message,
a chat client appends a turn. They are computed from the template and the tokenizer, not guessed: each
prefix of the conversation is rendered to text, and a boundary is kept where a token starts exactly at
that text offset (a boundary that falls inside a token is no place to resume).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template rejects these messages."""


@dataclass(frozen=True, slots=True)
class RenderedChat:
    ids: list[int]
    boundaries: tuple[int, ...]
    """Token positions in `(0, len(ids)]` where a message (or the generation prompt) starts."""


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> RenderedChat:
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model has no chat template; use /v1/completions")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prefixes = [tokenizer.apply_chat_template(messages[:count], add_generation_prompt=False, tokenize=False)
                    for count in range(1, len(messages) + 1)]
    except Exception as exc:  # noqa: BLE001 - templates raise whatever jinja raises
        raise ChatTemplateError(f"the chat template rejected these messages: {type(exc).__name__}") from exc
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = [int(t) for t in encoded["input_ids"]]
    starts = {int(start): index for index, (start, _) in enumerate(encoded["offset_mapping"])}
    boundaries = set()
    for prefix in prefixes:
        if text.startswith(prefix):
            offset = len(prefix)
            if offset == len(text):
                boundaries.add(len(ids))
            elif offset in starts and starts[offset] > 0:
                boundaries.add(starts[offset])
    return RenderedChat(ids, tuple(sorted(boundaries)))
