"""Preparation against a live node: a chat of empty messages too many to fit is refused before it is rendered,
and callers flooding preparation with expensive bodies do not hold another caller's chat behind their work."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp

from tests.node.conftest import Node

EMPTY_MESSAGES = 289_255
"""The probe's body: 8 MB of empty messages, under the 8 MiB body limit."""


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


async def post(session: aiohttp.ClientSession, node: Node, key: str, body: bytes) -> tuple[int, dict[str, Any]]:
    async with session.post(node.base + "/chat/completions", data=body, headers=auth(key)) as response:
        return response.status, await response.json()


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def test_a_body_of_empty_messages_is_refused_for_its_count(node_factory, small_model_dir: Path) -> None:
    node = node_factory(small_model_dir)
    key = node.add_key("alice")
    body = encode({"model": small_model_dir.name, "messages": [{"role": "user", "content": ""}] * EMPTY_MESSAGES})
    assert len(body) < 8 * 1024 * 1024

    async def run() -> tuple[int, dict[str, Any]]:
        async with aiohttp.ClientSession() as session:
            return await post(session, node, key, body)

    fewer = encode({"model": small_model_dir.name, "messages": [{"role": "user", "content": ""}] * 3000})

    async def run_fewer() -> tuple[int, dict[str, Any]]:
        async with aiohttp.ClientSession() as session:
            return await post(session, node, key, fewer)

    # Past 32,768 objects the parse itself stops (node/api/body.py MAX_JSON_OBJECTS).
    status, answer = asyncio.run(run())
    assert status == 400, answer
    assert answer["error"] == {"message": "the request body holds more than 32768 JSON objects",
                               "type": "invalid_request_error", "param": None, "code": "too_many_objects"}
    # Fewer, parsed whole: refused by their count before anything is rendered.
    status, answer = asyncio.run(run_fewer())
    assert status == 400, answer
    assert answer["error"] == {
        "message": "the conversation is at least 5998 tokens (3000 messages, each after the first at least 2 "
                   "tokens of this model's chat template, and 0 bytes of content, no token more than 23 bytes); "
                   "this model's context length is 4096 tokens",
        "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}


def test_the_message_limit_is_configurable(node_factory, small_model_dir: Path) -> None:
    node = node_factory(small_model_dir, config_text="limits:\n  max_messages: 3\n")
    key = node.add_key("alice")
    chat = {"model": small_model_dir.name, "max_tokens": 1}

    async def run() -> list[tuple[int, dict[str, Any]]]:
        async with aiohttp.ClientSession() as session:
            hi = {"role": "user", "content": "hi"}
            return [await post(session, node, key, encode({**chat, "messages": [hi] * n})) for n in (3, 4)]

    (three, _), (four, answer) = asyncio.run(run())
    assert (three, four) == (200, 400)
    assert (answer["error"]["code"], answer["error"]["param"]) == ("array_above_max_length", "messages")


def test_callers_flooding_preparation_leave_a_third_callers_chat_its_own_thread(
        node_factory, small_model_dir: Path) -> None:
    """Two callers each send twelve expensive chats at once (each renders and tokenizes about 20,000 tokens
    before it is refused as too long). Once their first answers are back (all of them are in the node), a third
    caller sends a short chat: it is prepared beside them, and answered before more than a few of theirs, where
    a first-come pool answered it after all of them."""
    node = node_factory(small_model_dir)
    keys = {name: node.add_key(name) for name in ("mallory", "trudy", "alice")}
    model = small_model_dir.name
    content = " ".join("abcdefghijklmnopqrs")  # 37 bytes, a token a letter: the bounds let 1,000 of them through
    expensive = encode({"model": model, "max_tokens": 1,
                        "messages": [{"role": "user", "content": content}] * 1000})
    short = encode({"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    order: list[str] = []

    async def send(session: aiohttp.ClientSession, name: str, body: bytes) -> int:
        status, _ = await post(session, node, keys[name], body)
        order.append(name)
        return status

    async def run() -> tuple[list[int], int]:
        async with aiohttp.ClientSession() as session:
            flood = [asyncio.create_task(send(session, name, expensive))
                     for _ in range(12) for name in ("mallory", "trudy")]
            while len(order) < 2:
                await asyncio.sleep(0.005)
            sent_after = len(order)
            statuses = [await send(session, "alice", short)]
            return statuses + list(await asyncio.gather(*flood)), sent_after

    statuses, sent_after = asyncio.run(run())
    assert statuses == [200] + [400] * 24
    assert order.index("alice") - sent_after <= 4, order
