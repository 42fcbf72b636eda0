"""A chat's bounds are checked as its body is parsed: the count of messages first, before any is looked at."""

from __future__ import annotations

from typing import Any

import pytest

from node.errors import InvalidRequest
from node.openai_schema import ChatBounds, Message, parse_chat

BOUNDS = ChatBounds(max_messages=100, context_length=4096, token_bytes=23, message_tokens=2)


def chat(messages: list[Any]) -> dict[str, Any]:
    return {"model": "m", "messages": messages}


def refusal(body: dict[str, Any], bounds: ChatBounds = BOUNDS) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse_chat(body, bounds)
    return caught.value


def test_empty_messages_that_cannot_fit_are_refused_before_any_is_looked_at() -> None:
    # 289,255 empty messages of no valid role: the count alone refuses them, so no message is read.
    error = refusal(chat([None] * 289_255))
    assert (error.code, error.param) == ("context_length_exceeded", "messages")
    assert str(error) == ("the conversation is at least 578508 tokens (289255 messages, each after the first at "
                          "least 2 tokens of this model's chat template, and 0 bytes of content, no token more than "
                          "23 bytes); this model's context length is 4096 tokens")


def test_more_messages_than_the_limit_are_refused_where_they_could_fit() -> None:
    wide = ChatBounds(max_messages=100, context_length=1_000_000, token_bytes=23, message_tokens=2)
    error = refusal(chat([None] * 101), wide)
    assert (error.code, error.param) == ("array_above_max_length", "messages")
    assert str(error) == "'messages' holds 101 messages; this node takes at most 100 in one request"
    assert len(parse_chat(chat([{"role": "user", "content": ""}] * 100), wide).messages) == 100


def test_content_and_markup_together_are_bounded_by_the_context() -> None:
    # 2,048 messages of markup alone fit (4,094 tokens); 46 bytes of content are at least 2 tokens more.
    messages = [{"role": "user", "content": ""}] * 2048
    wide = ChatBounds(max_messages=4096, context_length=4096, token_bytes=23, message_tokens=2)
    assert parse_chat(chat(messages), wide).messages[0] == Message("user", "")
    error = refusal(chat([*messages[:-1], {"role": "user", "content": "\u00e9" * 23}]), wide)
    assert error.code == "context_length_exceeded" and "46 bytes of content" in str(error)
    assert wide.least_tokens(2048, 46) == 4096
