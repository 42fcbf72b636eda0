"""Anthropic's Messages API and `/v1/cache` on a real node (issue 41): the official `anthropic` client, plain and
streaming, and the official `openai` client run one conversation on one caller's state; bad input is refused in
Anthropic's error body naming the field, and the node keeps serving; a caller sees and shreds only its own
cache."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.node.conftest import Node, start_node, stop_node

SYSTEM = "You are a careful assistant who answers questions about the sea in a few words. " * 4
GREEDY = {"temperature": 0}
"""Sent as an extra field: this `anthropic` client has no `temperature` parameter, which the API still takes."""
TURNS = ("Tell me about tides.", "And about waves?", "Why is the sea salty?")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, small_model_dir: Path) -> Iterator[Node]:
    """One node (reuse and sealing on, as served by default) for the module; each test uses callers of its own."""
    started = start_node(tmp_path_factory.mktemp("messages"), small_model_dir)
    yield started
    stop_node(started)


def call(node: Node, method: str, path: str, headers: dict[str, str], body: Any = None) -> tuple[int, Any]:
    """`method` `path` on the node with `headers` (and a JSON `body`): the status and the JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(node.url + path, data, {"Content-Type": "application/json", **headers},
                                     method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:  # loopback only
            return int(response.status), json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def events(node: Node, key: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A streamed Messages request's server-sent events, (event name, data), as sent."""
    request = urllib.request.Request(node.url + "/v1/messages", json.dumps({**body, "stream": True}).encode(),
                                     {"Content-Type": "application/json", "x-api-key": key,
                                      "anthropic-version": "2023-06-01"}, method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:  # loopback only
        raw = response.read().decode()
    out = []
    for block in raw.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def conversation(turn: int, replies: list[str]) -> list[dict[str, str]]:
    """Turns up to `turn` (from 0), each earlier one answered with its reply."""
    messages = []
    for index in range(turn + 1):
        messages.append({"role": "user", "content": TURNS[index]})
        if index < turn:
            messages.append({"role": "assistant", "content": replies[index]})
    return messages


def test_both_clients_run_one_conversation_on_one_callers_state(node: Node, small_model_dir: Path) -> None:
    model = small_model_dir.name
    key = node.add_key("dialects")
    claude = anthropic.Anthropic(base_url=node.url, api_key=key, max_retries=0)
    gpt = openai.OpenAI(base_url=node.base, api_key=key, max_retries=0)
    replies: list[str] = []
    # Turn 1, plain: nothing held yet, the whole prompt is written.
    first = claude.messages.create(model=model, max_tokens=6, system=SYSTEM, extra_body=GREEDY,
                                   messages=conversation(0, replies))  # type: ignore[arg-type]
    assert first.id.startswith("msg_") and first.type == "message" and first.role == "assistant"
    assert first.stop_reason == "max_tokens" and first.content[0].type == "text"
    usage = first.usage
    assert usage.cache_read_input_tokens == 0 and usage.output_tokens == 6
    assert usage.input_tokens == 0  # every prompt token computed was stored
    assert usage.cache_creation is not None
    assert usage.cache_creation.ephemeral_5m_input_tokens == usage.cache_creation_input_tokens
    assert usage.cache_creation.ephemeral_1h_input_tokens == 0
    replies.append(first.content[0].text)
    prompt_1 = usage.cache_creation_input_tokens
    # Turn 2, streamed: reads turn 1's prompt and reply back.
    with claude.messages.stream(model=model, max_tokens=6, system=SYSTEM, extra_body=GREEDY,
                                messages=conversation(1, replies)) as stream:  # type: ignore[arg-type]
        text = "".join(stream.text_stream)
        second = stream.get_final_message()
    assert second.content[0].type == "text" and second.content[0].text == text
    read_2 = second.usage.cache_read_input_tokens or 0
    assert read_2 >= prompt_1
    replies.append(text)
    # Turn 3, the OpenAI dialect's first request: it reads what the Messages dialect stored.
    third = gpt.chat.completions.create(
        model=model, max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, *conversation(2, replies)])  # type: ignore[list-item]
    assert third.usage is not None and third.usage.prompt_tokens_details is not None
    cached_3 = third.usage.prompt_tokens_details.cached_tokens or 0
    total_2 = second.usage.input_tokens + read_2 + (second.usage.cache_creation_input_tokens or 0)
    assert cached_3 >= total_2  # at least the whole of turn 2's prompt
    # The same conversation in the other dialect renders to the same prompt, token for token, and the same reply.
    again = claude.messages.create(model=model, max_tokens=6, system=SYSTEM, extra_body=GREEDY,
                                   messages=conversation(2, replies))  # type: ignore[arg-type]
    usage = again.usage
    assert (usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
            == third.usage.prompt_tokens)
    assert again.content[0].type == "text" and again.content[0].text == third.choices[0].message.content
    assert usage.cache_read_input_tokens == third.usage.prompt_tokens - 1  # all but the token that picks the first


def test_the_stream_is_anthropics_event_sequence_with_the_usage_at_its_end(node: Node, small_model_dir: Path) -> None:
    key = node.add_key("streamer")
    sent = events(node, key, {"model": small_model_dir.name, "max_tokens": 4, "temperature": 0,
                              "messages": [{"role": "user", "content": "Name a fish."}]})
    names = [name for name, _ in sent]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert all(name == data["type"] for name, data in sent)
    start, delta = sent[0][1]["message"], sent[-2][1]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 4 and delta["usage"]["cache_read_input_tokens"] == 0
    assert delta["usage"]["input_tokens"] + delta["usage"]["cache_creation_input_tokens"] > 0


BAD: list[tuple[dict[str, Any], str]] = [
    ({"tools": [{"name": "t", "input_schema": {"type": "object"}}]}, "tools"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                 "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}]},
     "messages[0].content[0].cache_control.ttl"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": str(i), "cache_control": {
        "type": "ephemeral"}} for i in range(5)]}]}, "messages[0].content[4].cache_control"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": None}, "max_tokens"),
    ({"model": "no-such-model"}, "no-such-model"),
]


def test_bad_input_is_refused_in_anthropics_error_body_naming_the_field(node: Node, small_model_dir: Path) -> None:
    key = node.add_key("clumsy")
    claude = anthropic.Anthropic(base_url=node.url, api_key=key, max_retries=0)
    good: dict[str, Any] = {"model": small_model_dir.name, "max_tokens": 2,
                            "messages": [{"role": "user", "content": "hi"}]}
    for fields, named in BAD:
        status, body = call(node, "POST", "/v1/messages", {"x-api-key": key}, {**good, **fields})
        assert status == (404 if named == "no-such-model" else 400), body
        assert body["type"] == "error" and named in body["error"]["message"], body
        assert body["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(**good, extra_body={"top_k": 0})  # type: ignore[call-overload]
    assert "top_k" in str(refused.value)
    status, body = call(node, "POST", "/v1/messages", {"x-api-key": "sk-wrong"}, good)
    assert (status, body["type"], body["error"]["type"]) == (401, "error", "authentication_error")
    # A bearer key works as well as x-api-key, and the node keeps serving after every refusal.
    bearer = anthropic.Anthropic(base_url=node.url, auth_token=key, max_retries=0)
    assert bearer.messages.create(**good).usage.output_tokens == 2  # type: ignore[call-overload]


def test_a_caller_sees_and_shreds_only_its_own_cache(node: Node, small_model_dir: Path) -> None:
    model = small_model_dir.name
    alice, bob = node.add_key("cache-alice"), node.add_key("cache-bob")
    gpt = {name: openai.OpenAI(base_url=node.base, api_key=key, max_retries=0)
           for name, key in (("alice", alice), ("bob", bob))}
    request = {"model": model, "max_tokens": 4, "temperature": 0,
               "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]}

    def cached(name: str) -> int:
        usage = gpt[name].chat.completions.create(**request).usage  # type: ignore[call-overload]
        return int(usage.prompt_tokens_details.cached_tokens)

    def view(key: str, query: str = "") -> dict[str, Any]:
        status, body = call(node, "GET", "/v1/cache" + query, {"Authorization": f"Bearer {key}"})
        assert status == 200, body
        return dict(body)

    assert view(alice)["entries"] == 0 and view(alice)["hits"] == view(alice)["misses"] == 0
    assert cached("alice") == 0 and cached("bob") == 0
    warm = cached("alice")
    assert warm > 0
    shown = view(alice, f"?model={model}")
    assert shown["model"] == model and shown["entries"] > 0 and shown["tokens"] > warm
    assert shown["bytes"]["total"] == shown["bytes"]["hot"] + shown["bytes"]["sealed"] > 0
    assert (shown["hits"], shown["misses"]) == (1, 1)
    bob_before = view(bob)
    status, deleted = call(node, "DELETE", "/v1/cache", {"Authorization": f"Bearer {alice}"})
    assert status == 200 and deleted["object"] == "cache.deleted"
    assert {name: deleted["deleted"][name] for name in ("entries", "tokens", "bytes")} == {
        name: shown[name] for name in ("entries", "tokens", "bytes")}
    after = view(alice)
    assert (after["entries"], after["tokens"], after["bytes"]["total"], after["replies"]) == (0, 0, 0, 0)
    assert after["encodings"] == {"entries": 0, "bytes": 0}  # a text model's caller holds none
    assert (after["hits"], after["misses"]) == (1, 1)  # counts since the node started
    assert cached("alice") == 0  # the same request after the shredding: nothing to read
    assert view(bob) == bob_before  # another caller's cache is untouched, and its view unchanged
    assert cached("bob") > 0
    status, body = call(node, "GET", "/v1/cache?model=other", {"Authorization": f"Bearer {alice}"})
    assert status == 404 and body["error"]["param"] == "model"
    status, body = call(node, "DELETE", "/v1/cache", {})
    assert status == 401


def test_a_request_running_while_its_caller_shreds_ends_whole_and_stores_nothing(node: Node,
                                                                                 small_model_dir: Path) -> None:
    key = node.add_key("midstream")
    claude = anthropic.Anthropic(base_url=node.url, api_key=key, max_retries=0)
    shredded = None
    with claude.messages.stream(model=small_model_dir.name, max_tokens=120, system=SYSTEM, extra_body=GREEDY,
                                messages=[{"role": "user", "content": TURNS[1]}]) as stream:
        for _ in stream.text_stream:
            if shredded is None:  # the request is decoding: its working memory is in its lane
                shredded = call(node, "DELETE", "/v1/cache", {"x-api-key": key})
        final = stream.get_final_message()
    assert shredded is not None and shredded[0] == 200
    assert shredded[1]["deleted"]["entries"] == 0  # shredded before the request ended: it had stored nothing yet
    assert final.usage.output_tokens == 120 and final.stop_reason == "max_tokens"
    assert final.usage.cache_creation_input_tokens == 0  # billed no cached write: nothing was stored
    status, view = call(node, "GET", "/v1/cache", {"x-api-key": key})
    assert status == 200 and (view["entries"], view["tokens"], view["bytes"]["total"], view["replies"]) == (0, 0, 0, 0)
    after = claude.messages.create(model=small_model_dir.name, max_tokens=2, system=SYSTEM, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": TURNS[1]}])
    assert after.usage.cache_read_input_tokens == 0 and (after.usage.cache_creation_input_tokens or 0) > 0  # stores
