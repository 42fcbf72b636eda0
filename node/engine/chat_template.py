"""Rendering chat messages to token ids, with the token positions where each message starts.

Message boundaries are where conversations diverge: an agent re-sends its history and changes one message,
a chat client appends a turn. They are computed from the template and the tokenizer, not guessed: a prefix
of the conversation is rendered to text, and a boundary is kept where a token starts exactly at that text
offset (a boundary that falls inside a token is no place to resume).

Rendering every prefix would be quadratic in the number of messages (RESULTS.md, 2026-11-30), so
the conversation is rendered and tokenized once, and prefixes only for the last `BOUNDARY_MESSAGES`
messages of a conversation that fits the context: each such render is linear, so the whole is linear in
the conversation (and bounded by the context for the prefix renders). Those are the boundaries a caller's
next request can diverge at; older ones were the ends of earlier requests' prompts and replies, where the
cache already holds resume points.

Special tokens typed in message content (`<|im_start|>system`, say) are tokenized as text, as OpenAI's
API does, never as control tokens: a user cannot forge a turn. Only the template's own text yields them. Where
such content lies in the rendered text is found by rendering it once more with a fresh random marker in place
of each such content: the text between markers is the template's own, wherever a content repeats it (searching
the rendered text for the content found the template's earlier copy of it, and turned the content's forged
token into a control token and the template's into text).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from node.openai_schema import ROLES

BOUNDARY_MESSAGES = 16
"""Messages at the end of a conversation whose start is computed exactly (one prefix render each)."""


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template rejects these messages."""


@dataclass(frozen=True, slots=True)
class RenderedChat:
    ids: list[int]
    boundaries: tuple[int, ...]
    """Token positions in `(0, len(ids)]` where a message (or the generation prompt) starts."""
    placed: tuple[int, ...] = ()
    """Where each attachment's ids start (`render_chat`'s `media`, in its order)."""
    split: int | None = None
    """Where the first `render_chat`'s `split_at` messages end (a token position); None when not asked, or when
    that end falls inside a token (no place to resume) or the template is not stable under that prefix."""
    ends: tuple[int | None, ...] = ()
    """Where the first `n` messages end for each `n` of `render_chat`'s `ends_of`, in its order; None as `split`."""


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


def message_tokens(tokenizer: Any) -> int:
    """The fewest tokens the chat template writes for one more message, whatever its content: a lower bound on
    what each message after the first adds to a rendered conversation, so that its length is bounded before it
    is rendered (`openai_schema.ChatBounds`). Only special tokens are counted: they are tokens of their own
    whatever surrounds them, and content never yields fewer tokens than it holds (its special-token text is
    tokenized as text). Measured as what a message of each role adds after a message of each role, the fewest
    over the pairs the template renders (0 where it renders none); exact for a template that writes a
    message's markup from its role and its predecessor's, as chat templates do."""
    special = {int(i) for i in tokenizer.convert_tokens_to_ids(_special_strings(tokenizer))}

    def count(messages: list[dict[str, str]]) -> int:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
        return sum(int(i) in special for i in tokenizer(text, add_special_tokens=False)["input_ids"])

    added = []
    for before in ROLES:
        for role in ROLES:
            first = [{"role": before, "content": "x"}]
            try:
                added.append(count([*first, {"role": role, "content": "x"}]) - count(first))
            except Exception:  # noqa: BLE001, S112 - a pair the template refuses (jinja raises anything) never runs
                continue
    return max(0, min(added, default=0))


def _marker(messages: list[dict[str, str]], text: str) -> str:
    """A random marker in no content and not in the rendered text: the template cannot have written it."""
    while True:
        marker = "tz" + secrets.token_hex(8)
        if marker not in text and not any(marker in (m.get("content") or "") for m in messages):
            return marker


def _content_spans(tokenizer: Any, text: str, messages: list[dict[str, str]],
                   marked: list[int]) -> list[tuple[int, int, int]]:
    """Where the contents of `messages[i]` for i in `marked` lie in the rendered `text`: (i, start, end), in the
    text's order. The
    conversation is rendered again with a unique marker in place of each such content; the text around the
    markers is the template's own. A template that writes each content as given gives back `text` with the
    contents in the markers' places: the spans are exact. One that changes a content (strips it, say) is
    matched piece by piece, each content taken as the longest piece of it the template's text can follow."""
    marker = _marker(messages, text)
    names = {index: f"{marker}m{index}e" for index in marked}
    markers = {name: index for index, name in names.items()}
    probe = [{**m, "content": names[i]} if i in names else m for i, m in enumerate(messages)]
    try:
        rendered = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - templates raise whatever jinja raises
        raise ChatTemplateError(f"the chat template rejected these messages: {type(exc).__name__}") from exc
    parts = re.split(f"({marker}m[0-9]+e)", rendered)
    pieces, order = parts[0::2], [markers[found] for found in parts[1::2]]
    contents = [messages[index].get("content") or "" for index in order]
    spans: list[tuple[int, int, int]] = []
    cursor = 0
    if "".join(piece + content for piece, content in zip(pieces, [*contents, ""], strict=True)) == text:
        for index, piece, content in zip(order, pieces, contents, strict=False):
            cursor += len(piece)
            spans.append((index, cursor, cursor + len(content)))
            cursor += len(content)
        return spans
    for at, content in enumerate(contents):
        if not text.startswith(pieces[at], cursor):
            break
        cursor += len(pieces[at])
        end = _longest_piece(text, cursor, content, pieces[at + 1], last=at + 1 == len(contents))
        if end is None:
            break
        spans.append((order[at], cursor, end))
        cursor = end
    else:
        if text.startswith(pieces[-1], cursor) and cursor + len(pieces[-1]) == len(text):
            return spans
    raise ChatTemplateError("the chat template changes message content in a way this node cannot locate, so it "
                            "cannot keep special-token text in content from acting as control tokens; remove "
                            "special-token text from the messages")


def _longest_piece(text: str, start: int, content: str, after: str, last: bool) -> int | None:
    """The end of the longest text from `start` that is a piece of `content` and that `after` follows (at the
    very end of `text` when `after` is the template's last piece); None where there is none."""
    if last:
        end = len(text) - len(after)
        return end if end >= start and text.startswith(after, end) and text[start:end] in content else None
    end = text.rfind(after, start, start + len(content) + len(after))
    while end >= start:
        if text[start:end] in content:
            return end
        end = text.rfind(after, start, end + len(after) - 1)
    return None


def _split_at(pieces: list[tuple[int, int, bool, list[int] | None]], text: str, media: Mapping[str, list[int]]
              ) -> list[tuple[int, int, bool, list[int] | None]]:
    """`pieces` with each attachment's marker (a key of `media`, once in `text`) a piece of its own standing for
    its ids."""
    found = sorted((text.find(marker), marker) for marker in media)
    if any(at < 0 or text.count(marker) != 1 for at, marker in found):
        raise ChatTemplateError("the chat template does not write each image of the messages exactly once")
    out: list[tuple[int, int, bool, list[int] | None]] = []
    for start, end, as_text, generated in pieces:
        cursor = start
        for at, marker in found:
            if start <= at < end:
                if generated is not None or at + len(marker) > end:
                    raise ChatTemplateError("the chat template writes an image inside another piece of text")
                if at > cursor:
                    out.append((cursor, at, as_text, None))
                out.append((at, at + len(marker), False, media[marker]))
                cursor = at + len(marker)
        if cursor < end or (cursor == start == end):
            out.append((cursor, end, as_text, generated))
    return out


def _tokenize(tokenizer: Any, text: str, messages: list[dict[str, str]],
              replies: Callable[[str], list[int] | None] | None, media: Mapping[str, list[int]] | None = None
              ) -> tuple[list[int], list[int]]:
    """Token ids of `text` and each token's start offset (-1 inside a recalled reply but at its first); special-token
    strings inside message contents are tokenized as text, and an assistant message whose content `replies`
    recognises as a reply this node generated is its generated ids. Conversations with neither keep the one-pass
    tokenization."""
    specials = _special_strings(tokenizer)
    marked = [index for index, message in enumerate(messages)
              if any(special in (message.get("content") or "") for special in specials)]
    recalled: dict[int, list[int]] = {}
    for index, message in enumerate(messages):
        content = message.get("content") or ""
        if replies is not None and message.get("role") == "assistant" and content:
            generated = replies(content)
            if generated is not None:
                recalled[index] = generated
    spans: list[tuple[int, int, int]] = []
    if marked or recalled:
        try:
            spans = _content_spans(tokenizer, text, messages, sorted({*marked, *recalled}))
        except ChatTemplateError:
            if marked:
                raise
            spans = []  # replies alone, where the template hides their place: tokenized as text
    pieces: list[tuple[int, int, bool, list[int] | None]] = []
    """(start, end, content holding special-token text, the generated ids standing for it)."""
    cursor = 0
    for index, start, end in spans:
        if start > cursor:
            pieces.append((cursor, start, False, None))
        content = messages[index].get("content") or ""
        # Only a content the template wrote as given stands for the reply's ids: one it changed (stripped, say)
        # is what the model reads, and is tokenized.
        pieces.append((start, end, index in marked, recalled.get(index) if text[start:end] == content else None))
        cursor = end
    if cursor < len(text) or not pieces:
        pieces.append((cursor, len(text), False, None))
    if media:
        pieces = _split_at(pieces, text, media)
    ids: list[int] = []
    starts: list[int] = []
    for start, end, as_text, generated in pieces:
        if generated is not None:
            ids.extend(generated)
            starts.extend([start] + [-1] * (len(generated) - 1))
            continue
        encoded = tokenizer(text[start:end], add_special_tokens=False, return_offsets_mapping=True,
                            split_special_tokens=as_text)
        ids.extend(int(t) for t in encoded["input_ids"])
        starts.extend(start + int(offset) for offset, _ in encoded["offset_mapping"])
    return ids, starts


def render_chat(tokenizer: Any, messages: list[dict[str, str]], fits: int | None = None,
                replies: Callable[[str], list[int] | None] | None = None,
                media: Mapping[str, list[int]] | None = None, split_at: int = 0, ends_of: tuple[int, ...] = ()
                ) -> RenderedChat:
    """The conversation's ids and message boundaries; where it renders to more than `fits` tokens (it cannot
    run), no boundaries are computed: the caller refuses it. `replies`: the generated ids of an assistant
    message's content when it is a reply this node generated for the caller (`cache/replies.py`), else None.
    `media`: each attachment's ids by the marker standing for it in a message's content (`image_marker`): the
    marker's text is replaced by them, and `placed` says where each starts. `split_at`: a count of messages
    whose end is wanted (`RenderedChat.split`), however far from the conversation's end; `ends_of` more such
    counts (`RenderedChat.ends`: Anthropic's cache breakpoints)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model has no chat template; use /v1/completions")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - templates raise whatever jinja raises
        raise ChatTemplateError(f"the chat template rejected these messages: {type(exc).__name__}") from exc
    ids, offsets = _tokenize(tokenizer, text, messages, replies, media)
    starts = {offset: index for index, offset in enumerate(offsets)}
    placed = tuple(starts[text.index(marker)] for marker in media) if media else ()
    if fits is not None and len(ids) > fits:
        return RenderedChat(ids, (), placed)
    first = max(1, len(messages) - BOUNDARY_MESSAGES + 1)
    counts = sorted({count for count in (split_at, *ends_of) if 0 < count < first}) + list(range(first,
                                                                                               len(messages) + 1))
    try:
        prefixes = [tokenizer.apply_chat_template(messages[:count], add_generation_prompt=False, tokenize=False)
                    for count in counts]
    except Exception as exc:  # noqa: BLE001 - templates raise whatever jinja raises
        raise ChatTemplateError(f"the chat template rejected these messages: {type(exc).__name__}") from exc
    boundaries = set()
    ends: dict[int, int | None] = {}
    for count, prefix in zip(counts, prefixes, strict=True):
        position = None
        if text.startswith(prefix):
            offset = len(prefix)
            if offset == len(text):
                position = len(ids)
            elif offset in starts and starts[offset] > 0:
                position = starts[offset]
        if position is not None and count >= first:
            boundaries.add(position)
        ends[count] = position
    return RenderedChat(ids, tuple(sorted(boundaries)), placed, ends.get(split_at),
                        tuple(ends.get(count) for count in ends_of))


def image_marker(messages: list[dict[str, str]], count: int) -> list[str]:
    """`count` random markers found in no message, to stand for attachments in message contents while the
    template renders them (`render_chat`'s `media`)."""
    markers: list[str] = []
    while len(markers) < count:
        marker = _marker(messages, "") + "i"
        if marker not in markers:
            markers.append(marker)
    return markers
