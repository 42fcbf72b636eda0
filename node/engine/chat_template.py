"""Rendering chat messages to token ids, with the token positions where each message starts.

Message boundaries are where conversations diverge: an agent re-sends its history and changes one message,
a chat client appends a turn. They are computed from the template and the tokenizer, not guessed: a prefix
of the conversation is rendered to text, and a boundary is kept where a token starts exactly at that text
offset (a boundary that falls inside a token is no place to resume).

Rendering every prefix would be quadratic in the number of messages (2,000 short messages took 43 s), so
the conversation is rendered and tokenized once, and prefixes only for the last `BOUNDARY_MESSAGES`
messages of a conversation that fits the context: each such render is linear, so the whole is linear in
the conversation (and bounded by the context for the prefix renders). Those are the boundaries a caller's
next request can diverge at; older ones were the ends of earlier requests' prompts and replies, where the
cache already holds resume points.

Special tokens typed in message content (`<|im_start|>system`, say) are tokenized as text, as OpenAI's
API does, never as control tokens: a user cannot forge a turn. Only the template's own text yields them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BOUNDARY_MESSAGES = 16
"""Messages at the end of a conversation whose start is computed exactly (one prefix render each)."""


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template rejects these messages."""


@dataclass(frozen=True, slots=True)
class RenderedChat:
    ids: list[int]
    boundaries: tuple[int, ...]
    """Token positions in `(0, len(ids)]` where a message (or the generation prompt) starts."""


def max_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes one token of `tokenizer` stands for (special tokens included): any text of B bytes
    is at least B / this many tokens, which bounds a prompt's length before it is rendered or tokenized."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = backend.decoder if backend is not None else None
    text: Callable[[str], str] = ((lambda token: decoder.decode([token])) if decoder is not None
                                  else (lambda token: tokenizer.convert_tokens_to_string([token])))
    return max((len(text(token).encode("utf-8", "surrogatepass")) for token in tokenizer.get_vocab()), default=1)


def _special_strings(tokenizer: Any) -> list[str]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    specials = {token.content for token in added.values() if getattr(token, "special", False)}
    specials.update(str(token) for token in getattr(tokenizer, "all_special_tokens", []) or [])
    return sorted((s for s in specials if s), key=len, reverse=True)


def _content_spans(text: str, messages: list[dict[str, str]]) -> list[tuple[int, int]]:
    """Where each message's content lies in the rendered `text`, found in order (a template that changes
    content, e.g. strips it, may leave a content unfound: it is then left out)."""
    spans, cursor = [], 0
    for message in messages:
        content = message.get("content") or ""
        if not content:
            continue
        at = text.find(content, cursor)
        if at < 0:
            continue
        spans.append((at, at + len(content)))
        cursor = at + len(content)
    return spans


def _tokenize(tokenizer: Any, text: str, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids of `text` and each token's start offset; special-token strings inside message contents are
    tokenized as text. Conversations without any keep the one-pass tokenization."""
    specials = _special_strings(tokenizer)
    spans = [span for span in _content_spans(text, messages)
             if any(special in text[span[0]:span[1]] for special in specials)]
    pieces: list[tuple[int, int, bool]] = []  # (start, end, content holding special-token text)
    cursor = 0
    for start, end in spans:
        if start > cursor:
            pieces.append((cursor, start, False))
        pieces.append((start, end, True))
        cursor = end
    if cursor < len(text) or not pieces:
        pieces.append((cursor, len(text), False))
    ids: list[int] = []
    starts: list[int] = []
    for start, end, as_text in pieces:
        encoded = tokenizer(text[start:end], add_special_tokens=False, return_offsets_mapping=True,
                            split_special_tokens=as_text)
        ids.extend(int(t) for t in encoded["input_ids"])
        starts.extend(start + int(offset) for offset, _ in encoded["offset_mapping"])
    return ids, starts


def render_chat(tokenizer: Any, messages: list[dict[str, str]], fits: int | None = None) -> RenderedChat:
    """The conversation's ids and message boundaries; where it renders to more than `fits` tokens (it cannot
    run), no boundaries are computed: the caller refuses it."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model has no chat template; use /v1/completions")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - templates raise whatever jinja raises
        raise ChatTemplateError(f"the chat template rejected these messages: {type(exc).__name__}") from exc
    ids, offsets = _tokenize(tokenizer, text, messages)
    if fits is not None and len(ids) > fits:
        return RenderedChat(ids, ())
    first = max(1, len(messages) - BOUNDARY_MESSAGES + 1)
    try:
        prefixes = [tokenizer.apply_chat_template(messages[:count], add_generation_prompt=False, tokenize=False)
                    for count in range(first, len(messages) + 1)]
    except Exception as exc:  # noqa: BLE001 - templates raise whatever jinja raises
        raise ChatTemplateError(f"the chat template rejected these messages: {type(exc).__name__}") from exc
    starts = {offset: index for index, offset in enumerate(offsets)}
    boundaries = set()
    for prefix in prefixes:
        if text.startswith(prefix):
            offset = len(prefix)
            if offset == len(text):
                boundaries.add(len(ids))
            elif offset in starts and starts[offset] > 0:
                boundaries.add(starts[offset])
    return RenderedChat(ids, tuple(sorted(boundaries)))
