"""Anthropic Messages bodies parsed into the node's chat records: the exact records, and every refusal naming its
field."""

from __future__ import annotations

from typing import Any

import pytest

from node.anthropic_schema import Breakpoint, parse_messages
from node.errors import InvalidRequest
from node.openai_schema import ChatBounds, CommonParams, Message

BOUNDS = ChatBounds(max_messages=64, context_length=4096, token_bytes=16, message_tokens=4)
EPHEMERAL = {"type": "ephemeral"}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}


def test_a_request_becomes_the_equivalent_chat_system_first_blocks_joined() -> None:
    parsed = parse_messages(body(
        system=[{"type": "text", "text": "You are "}, {"type": "text", "text": "terse.", "cache_control": EPHEMERAL}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                  {"role": "assistant", "content": "c"},
                  {"role": "user", "content": [{"type": "text", "text": "d",
                                                "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}],
        temperature=0, top_p=0.5, top_k=40, stop_sequences=["\n\n"], stream=True, metadata={"user_id": "u-1"}),
        BOUNDS)
    assert parsed.chat.messages == (Message("system", "You are terse."), Message("user", "ab"),
                                    Message("assistant", "c"), Message("user", "d"))
    assert parsed.chat.params == CommonParams(model="m", max_tokens=8, temperature=0.0, top_p=0.5, seed=None,
                                              stop=("\n\n",), stream=True, include_usage=True, top_k=40)
    assert parsed.breakpoints == (Breakpoint(0, True, "5m", "system[1].cache_control"),
                                  Breakpoint(3, True, "1h", "messages[2].content[0].cache_control"))


def test_a_breakpoint_with_group_scope_marks_its_prefix_the_trust_groups() -> None:
    parsed = parse_messages(body(system=[{"type": "text", "text": "x", "cache_control": {
        "type": "ephemeral", "scope": "group"}}], cache_control={"type": "ephemeral", "scope": "caller"}), BOUNDS)
    assert parsed.breakpoints == (Breakpoint(0, True, "5m", "system[0].cache_control", group=True),
                                  Breakpoint(1, True, "5m", "cache_control", group=False))


def test_a_top_level_cache_control_is_a_breakpoint_at_the_end_of_the_last_message() -> None:
    parsed = parse_messages(body(system="s", cache_control={"type": "ephemeral", "ttl": "1h"}), BOUNDS)
    assert parsed.breakpoints == (Breakpoint(1, True, "1h", "cache_control"),)


def test_a_breakpoint_before_its_messages_last_block_is_marked_as_inside_it() -> None:
    parsed = parse_messages(body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a", "cache_control": EPHEMERAL}, {"type": "text", "text": "b"}]}]), BOUNDS)
    assert parsed.breakpoints == (Breakpoint(0, False, "5m", "messages[0].content[0].cache_control"),)


FIVE_BREAKPOINTS = [{"role": "user" if i % 2 == 0 else "assistant",
                     "content": [{"type": "text", "text": str(i), "cache_control": EPHEMERAL}]} for i in range(5)]


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": []}, "tools"),
    ({"tool_choice": {"type": "auto"}}, "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"top_k": 0}, "top_k"),
    ({"max_token": 8}, "max_token"),
    ({"max_tokens": None}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"metadata": {"user_id": "u", "tag": 1}}, "metadata.tag"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "pre"}]}, "messages[1].role"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {
        "type": "ephemeral", "ttl": "10m"}}]}]}, "messages[0].content[0].cache_control.ttl"),
    ({"system": [{"type": "text", "text": "x", "cache_control": {"type": "persistent"}}]}, "system[0].cache_control"),
    ({"system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "scope": "team"}}]},
     "system[0].cache_control.scope"),
    ({"messages": [*FIVE_BREAKPOINTS, {"role": "user", "content": "x"}]}, "messages[4].content[0].cache_control"),
    ({"messages": [*FIVE_BREAKPOINTS[:4], {"role": "user", "content": "x"}], "cache_control": EPHEMERAL},
     "cache_control"),
    ({"output_config": {}}, "output_config"),
])
def test_bad_input_is_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_messages(body(**fields), BOUNDS)
    assert refused.value.param == param
