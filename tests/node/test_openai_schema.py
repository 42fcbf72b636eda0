"""Request bodies parsed: a chat's bounds checked before its messages are read, and every field the node does not
know or does not implement refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from node.errors import InvalidRequest
from node.openai_schema import ChatBounds, Message, parse_chat, parse_completion

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


def completion_refusal(body: dict[str, Any]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse_completion(body)
    return caught.value


def test_unknown_fields_are_refused_each_named() -> None:
    """A misspelt or newer field is refused, not served as if absent (issue 34): every unknown name in one
    message, the first as `param`, as OpenAI answers."""
    error = refusal({**chat([{"role": "user", "content": "x"}]), "max_token": 5, "made_up": True})
    assert (error.param, error.code) == ("max_token", "unknown_parameter")
    assert str(error) == ("unknown parameters 'max_token', 'made_up': remove them (this node refuses the fields "
                          "it does not know rather than ignore them)")
    # Each route takes its own fields: a chat's `messages` is unknown to a text completion, `echo` to a chat.
    assert completion_refusal({"model": "m", "prompt": "x", "messages": []}).param == "messages"
    assert refusal({**chat([{"role": "user", "content": "x"}]), "echo": False}).code == "unknown_parameter"
    error = refusal(chat([{"role": "user", "content": "x", "weight": 1}]))
    assert (error.param, error.code) == ("messages[0].weight", "unknown_parameter")
    error = refusal({**chat([{"role": "user", "content": "x"}]), "stream_options": {"include_usage": True,
                                                                                    "every": 2}})
    assert (error.param, error.code) == ("stream_options.every", "unknown_parameter")


@pytest.mark.parametrize(("field", "value"), [
    ("modalities", ["audio"]), ("modalities", ["text", "audio"]), ("web_search_options", {}), ("store", True),
    ("metadata", {"team": "a"}), ("reasoning_effort", "low"), ("service_tier", "flex"), ("tool_choice", "auto"),
    ("top_logprobs", False), ("messages[0].name", "bob"),
])
def test_fields_the_node_does_not_implement_are_refused(field: str, value: Any) -> None:
    body = chat([{"role": "user", "content": "x"}])
    if field.startswith("messages[0]."):
        body["messages"][0][field.removeprefix("messages[0].")] = value
    else:
        body[field] = value
    error = refusal(body)
    assert (error.param, error.code) == (field, "unsupported_parameter")
    assert str(error).endswith(f"; remove '{field}' from the request")


def test_no_op_values_and_ignored_fields_are_accepted() -> None:
    """Values that ask for nothing the node lacks are served; `user` and its kin are taken as strings and
    ignored (neither the reply nor what is kept depends on them)."""
    body = {**chat([{"role": "user", "content": "x"}]), "store": False, "modalities": ["text"], "tools": [],
            "tool_choice": "none", "parallel_tool_calls": True, "service_tier": "auto", "metadata": {},
            "user": "u-1", "safety_identifier": "s", "prompt_cache_key": "k",
            "stream_options": {"include_usage": True, "include_obfuscation": False}}
    assert parse_chat(body, BOUNDS).messages == (Message("user", "x"),)
    assert parse_completion({"model": "m", "prompt": "x", "user": "u-1", "echo": False, "suffix": ""}).prompt == "x"
    error = refusal({**chat([{"role": "user", "content": "x"}]), "user": 7})
    assert (error.param, str(error)) == ("user", "'user' must be a string")


@pytest.mark.parametrize(("value", "retain", "retention"), [
    (None, True, "in_memory"), ("in_memory", True, "in_memory"), ("24h", True, "24h"), ("none", False, "none")])
def test_prompt_cache_retention_is_carried_and_none_keeps_nothing(value: str | None, retain: bool,
                                                                   retention: str) -> None:
    params = parse_chat({**chat([{"role": "user", "content": "x"}]), "prompt_cache_retention": value,
                         "prompt_cache_key": "team-a"}, BOUNDS).params
    assert (params.retain, params.retention) == (retain, retention)
    assert "team-a" not in repr(params)  # the key is accepted and kept nowhere
    error = refusal({**chat([{"role": "user", "content": "x"}]), "prompt_cache_retention": "1h"})
    assert error.param == "prompt_cache_retention"
