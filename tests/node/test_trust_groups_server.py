"""Trust groups on a real node (issue 41): members A and B share a system prompt of about 2,000 tokens (B's first
request, in the other dialect, reads A's write of it and nothing of A's turn), a non-member C is cold and is
refused the group's scope naming the field with nothing stored, a member removed from the group is refused from
its next request, and a removed group's state is gone."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
from transformers import AutoTokenizer

from node.config import Group, load_config, save_config
from tests.node.conftest import Node, NodeFactory

SYSTEM = " ".join(f"Rule {index}: answer about the sea, tides and waves in a few plain words." for index in range(66))
GROUP_SYSTEM = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "scope": "group"}}]
QUESTION = [{"role": "user", "content": "Tell me about tides."}]


def call(node: Node, path: str, key: str, body: Any = None, headers: dict[str, str] | None = None,
         method: str = "POST") -> tuple[int, Any]:
    """`method` `path` with `key` (and a JSON `body`): the status and the JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(node.url + path, data, {"Content-Type": "application/json",
                                                             "Authorization": f"Bearer {key}", **(headers or {})},
                                     method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:  # loopback only
            return int(response.status), json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def set_groups(node: Node, **groups: list[str]) -> None:
    config = load_config(node.config)
    save_config(node.config, replace(config, groups=tuple(Group(name, tuple(m)) for name, m in groups.items())))


def test_members_share_the_system_prompt_and_nothing_else(node_factory: NodeFactory, small_model_dir: Path) -> None:
    node = node_factory(small_model_dir)
    model = small_model_dir.name
    a, b, c, d = (node.add_key(name) for name in ("a", "b", "c", "d"))
    set_groups(node, team=["a", "b", "d"])
    tokenizer = AutoTokenizer.from_pretrained(small_model_dir)
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}], tokenize=False)
    shared = len(tokenizer.encode(rendered, add_special_tokens=False))
    assert 1900 < shared < 2100  # about 2,000 tokens of system prompt

    def messages(key: str, system: Any = GROUP_SYSTEM, question: Any = QUESTION) -> tuple[int, Any]:
        return call(node, "/v1/messages", key, {"model": model, "max_tokens": 4, "temperature": 0, "system": system,
                                                "messages": question})

    # A non-member asking for the group's scope is refused naming the field, and nothing is stored for it.
    status, body = messages(c)
    assert status == 400 and "system[0].cache_control.scope" in body["error"]["message"], body
    status, body = call(node, "/v1/chat/completions", c, {"model": model, "max_tokens": 2, "prompt_cache_key": "k",
                                                          "messages": [{"role": "system", "content": SYSTEM}]},
                        {"Tenzro-Cache-Scope": "group"})
    assert status == 400 and body["error"]["param"] == "Tenzro-Cache-Scope", body
    assert call(node, "/v1/cache", c, method="GET")[1]["entries"] == 0
    # A member's ask the node cannot serve is refused naming the field too.
    split = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "scope": "group"}},
             {"type": "text", "text": " Be brief."}]
    status, body = messages(a, system=split)
    assert status == 400 and "system[0].cache_control" in body["error"]["message"], body
    asks: tuple[tuple[dict[str, Any], str], ...] = (
        ({}, "prompt_cache_key"), ({"prompt_cache_key": "k", "messages": QUESTION}, "messages[0].role"))
    for fields, param in asks:
        body = {"model": model, "max_tokens": 2, "messages": [{"role": "system", "content": SYSTEM}, *QUESTION]}
        status, body = call(node, "/v1/chat/completions", a, {**body, **fields}, {"Tenzro-Cache-Scope": "group"})
        assert status == 400 and body["error"]["param"] == param, body
    assert call(node, "/v1/cache", a, method="GET")[1]["entries"] == 0
    # A writes the group's prefix (up to its breakpoint, no further), billed to A.
    status, first = messages(a)
    assert status == 200, first
    usage = first["usage"]
    prompt = usage["input_tokens"] + usage["cache_creation_input_tokens"]
    assert (usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]) == (0, shared)
    # A, then B, in OpenAI's dialect, send that conversation: A stores its turn in its own scope, and B reads the
    # group's prefix and nothing of A's turn.
    chat = [{"role": "system", "content": SYSTEM}, *QUESTION]
    for key in (a, b):
        gpt = openai.OpenAI(base_url=node.base, api_key=key, max_retries=0)
        reply = gpt.chat.completions.create(model=model, max_tokens=4, temperature=0, messages=chat,  # type: ignore
                                            prompt_cache_key="team-rules",
                                            extra_headers={"Tenzro-Cache-Scope": "group"})
        assert reply.usage is not None and reply.usage.prompt_tokens == prompt
        details = reply.usage.model_dump()
        assert (details["cached_read_tokens"], details["cached_write_tokens"]) == (shared, prompt - shared)
        assert reply.choices[0].message.content == first["content"][0]["text"]  # as computed cold
    # C, with the same conversation in its own scope, is cold.
    status, cold = messages(c, system=SYSTEM)
    assert status == 200 and cold["usage"]["cache_read_input_tokens"] == 0, cold
    # B removed from the group: refused from its next request; the group removed: its state is shredded.
    set_groups(node, team=["a", "d"])
    assert messages(b)[0] == 400
    set_groups(node)
    assert messages(a)[0] == 400
    set_groups(node, team=["a", "d"])
    status, after = messages(d)
    assert status == 200 and after["usage"]["cache_read_input_tokens"] == 0, after
