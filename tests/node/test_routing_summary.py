"""Routing summaries on the node: where prefix forms are recorded, what `GET /v1/cache/summary` holds and who may
read it, that it leaks no prompt and no unkeyed digest, and end to end through a node subprocess."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestClient

from cache.arena import Scope, new_prefix_cache
from cache.budget import CacheBudget
from cache.summary import (
    EPOCH_S,
    BloomFilter,
    chat_prefix_forms,
    completion_prefix_form,
    prefix_entry,
    summary_key,
)
from metering.signer import SignatureInvalid, verify_signed_object
from node.api.keys import IDENTITY, SERVICE
from node.config import Limits, add_key
from node.engine.chat_template import RenderedChat
from node.engine.loader import LoadedModel
from node.engine.runner import GenerationRequest, ModelRunner, PrefixForms
from node.engine.sampling import SamplingParams
from node.openai_schema import Message
from node.service import ModelService, chat_forms
from tests.node.conftest import Node
from tests.node.test_router_callers import bearer, serve, small_loaded  # noqa: F401 - a fixture

SYSTEM = {"role": "system", "content": "You answer questions about the harbour's tides."}
Chat = list[dict[str, str]]


def question(i: int) -> Chat:
    return [SYSTEM, {"role": "user", "content": f"Question {i}: when does the tide turn at pier {7 * i}?"}]


def follow_up(i: int) -> dict[str, str]:
    return {"role": "user", "content": f"And at pier {7 * i + 1}, an hour later?"}


def test_chat_forms_sit_where_each_message_ends(small_loaded: LoadedModel) -> None:  # noqa: F811
    service = ModelService.create(small_loaded, None, Limits(max_queue=1))
    chat = [*question(1), {"role": "assistant", "content": "Soon."}, follow_up(1)]
    prompt = service.chat_prompt(tuple(Message(m["role"], m["content"]) for m in chat), forms=True)
    forms = chat_prefix_forms(chat)
    assert [form for _, form in prompt.forms.at] == forms  # one boundary per message: all four are claimed
    tokenizer = small_loaded.tokenizer
    for count, (position, _) in enumerate(prompt.forms.at, start=1):
        ended = tokenizer.apply_chat_template(chat[:count], add_generation_prompt=False, tokenize=False)
        assert tokenizer.decode(prompt.ids[:position]) == ended
    assert prompt.forms.reply is not None
    assert prompt.forms.reply("Later.") == chat_prefix_forms([*chat, {"role": "assistant", "content": "Later."}])[-1]
    assert service.chat_prompt((Message("user", "hi"),)).forms == PrefixForms()  # not a router's caller: none
    text = service.text_prompt("The tide", forms=True)
    assert text.forms == PrefixForms(((len(text.ids), completion_prefix_form("The tide")),))
    ids = service.text_prompt((5, 6, 7), forms=True)
    assert ids.forms == PrefixForms(((3, completion_prefix_form([5, 6, 7])),))


def test_a_chat_whose_ends_cannot_be_told_apart_claims_no_boundary() -> None:
    chat = [*question(2), follow_up(2)]
    assert [position for position, _ in chat_forms(chat, RenderedChat(list(range(60)), (20, 40, 55))).at] == [
        20, 40, 55]
    # Two ends reported for three messages: which message ends where is unknown, so none is claimed.
    partial = chat_forms(chat, RenderedChat(list(range(60)), (20, 55)))
    assert partial.at == () and partial.reply is not None


def test_the_runner_remembers_forms_only_for_kept_state(small_loaded: LoadedModel) -> None:  # noqa: F811
    cache = new_prefix_cache(CacheBudget(1 << 30, 1 << 30), sealed=False)
    runner = ModelRunner(small_loaded, cache)
    scope, replies = Scope("r1/alice", small_loaded.model_id), []

    def reply_form(text: str) -> bytes:
        replies.append(text)
        return b"r" * 32

    prompt = list(range(300, 340))
    request = GenerationRequest(scope, prompt, SamplingParams(4, 0.0),
                                forms=PrefixForms(((20, b"p" * 32),), reply_form))
    result = runner.generate(request, emit=lambda _: None, cancelled=lambda: False)
    assert replies == [result.text]
    held = cache.digest(scope, prompt + result.output_ids)  # the index keeps digests, never the ids
    assert cache._forms[scope] == {b"p" * 32: (20, held), b"r" * 32: (len(prompt) + len(result.output_ids), held)}
    assert sorted(form for _, form in cache.warm_forms(lambda s: True, runner.reuse.resumes_anywhere)) == [b"p" * 32,
                                                                                                     b"r" * 32]
    unkept = Scope("r1/bob", small_loaded.model_id)
    runner.generate(GenerationRequest(unkept, prompt, SamplingParams(4, 0.0), retain=False,
                                      forms=PrefixForms(((20, b"q" * 32),), reply_form)),
                    emit=lambda _: None, cancelled=lambda: False)
    assert unkept not in cache._forms and len(replies) == 1


async def chat(client: TestClient, headers: dict[str, str], messages: Chat) -> dict[str, Any]:
    response = await client.post("/v1/chat/completions", headers=headers, json={
        "model": client.server.app[SERVICE].model_id, "messages": messages, "max_tokens": 3, "temperature": 0,
        "return_token_ids": True})
    body = await response.json()
    assert response.status == 200, body
    return dict(body)


async def two_turns(client: TestClient, headers: dict[str, str], i: int) -> tuple[Chat, list[list[int]]]:
    """A two-turn conversation; returns it with the last reply appended, and each request's prompt ids."""
    messages = question(i)
    first = await chat(client, headers, messages)
    messages = [*messages, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                follow_up(i)]
    second = await chat(client, headers, messages)
    messages = [*messages, {"role": "assistant", "content": second["choices"][0]["message"]["content"]}]
    return messages, [first["prompt_token_ids"], second["prompt_token_ids"]]


async def read_summary(client: TestClient, headers: dict[str, str], model: str | None = None) -> Any:
    query = {"model": client.server.app[SERVICE].model_id if model is None else model}
    response = await client.get("/v1/cache/summary", params=query, headers=headers)
    return response.status, await response.json()


def holds(doc: dict[str, Any], router_key: str, caller: str, forms: list[bytes]) -> list[bool]:
    bloom, key = BloomFilter.from_json(doc["bloom"]), summary_key(router_key, caller, doc["epoch"])
    return [prefix_entry(key, form) in bloom for form in forms]


async def test_only_a_router_reads_its_signed_summary(aiohttp_client: Any, tmp_path: Path,
                                                      small_loaded: LoadedModel) -> None:  # noqa: F811
    client = await serve(aiohttp_client, tmp_path, small_loaded)
    path = tmp_path / "node.yaml"
    router = add_key(path, "r1", role="router")
    others = {role: add_key(path, role, role=role) for role in ("caller", "operator", "auditor")}
    for headers in [bearer(key) for key in others.values()] + [bearer(router, "alice")]:
        status, body = await read_summary(client, headers)
        assert (status, body["error"]["code"]) == (403, "router_role_required")
    assert (await read_summary(client, {}))[0] == 401
    status, body = await read_summary(client, bearer(router), model="nope")
    assert (status, body["error"]["code"]) == (404, "model_not_found")
    missing = await client.get("/v1/cache/summary", headers=bearer(router))
    assert missing.status == 400 and (await missing.json())["error"]["param"] == "model"

    conversation, _ = await two_turns(client, bearer(router, "alice"), 1)
    status, doc = await read_summary(client, bearer(router))
    identity = client.server.app[IDENTITY]
    assert status == 200 and set(doc) == {"object", "model", "epoch", "epoch_s", "bloom", "entries", "boot_id",
                                          "key_id", "signature"}
    assert (doc["object"], doc["model"], doc["epoch_s"], doc["entries"]) == (
        "cache.summary", small_loaded.model_id, EPOCH_S, 5)  # 4 message ends and the last reply's end
    assert (doc["boot_id"], doc["key_id"]) == (identity.boot_id, identity.signer.key_id)
    verify_signed_object(identity.signer.public_key_hex, doc)
    with pytest.raises(SignatureInvalid):
        verify_signed_object(identity.signer.public_key_hex, {**doc, "entries": 6})
    assert holds(doc, router, "alice", chat_prefix_forms(conversation)) == [True] * 5

    # More state: the same filter grows. State gone: the filter is rebuilt without it.
    second, _ = await two_turns(client, bearer(router, "bob"), 2)
    _, grown = await read_summary(client, bearer(router))
    before, after = (base64.b64decode(d["bloom"]["data"]) for d in (doc, grown))
    assert grown["entries"] == 10 and all(a & b == a for a, b in zip(before, after, strict=True))
    service = client.server.app[SERVICE]
    cache = service.runner.reuse.prefix_cache
    assert cache is not None
    await asyncio.wrap_future(service.scheduler.ask(lambda: cache.drop_scope(Scope("r1/alice",
                                                                                   small_loaded.model_id))))
    _, shrunk = await read_summary(client, bearer(router))
    assert shrunk["entries"] == 5
    assert holds(shrunk, router, "alice", chat_prefix_forms(conversation)) == [False] * 5
    assert holds(shrunk, router, "bob", chat_prefix_forms(second)) == [True] * 5


def packed(ids: list[int]) -> list[bytes]:
    """Every 3 consecutive ids as little- and big-endian 4-byte integers."""
    return [struct.pack(f"{order}3I", *ids[i:i + 3]) for i in range(len(ids) - 2) for order in "<>"]


async def test_a_summary_holds_no_prompt_and_answers_only_the_routers_key(aiohttp_client: Any, tmp_path: Path,
                                                                         small_loaded: LoadedModel  # noqa: F811
                                                                         ) -> None:
    client = await serve(aiohttp_client, tmp_path, small_loaded)
    router = add_key(tmp_path / "node.yaml", "r1", role="router")
    true: dict[str, list[Chat]] = {"alice": [], "bob": []}
    prompt_ids = []
    for caller, start in (("alice", 0), ("bob", 100)):
        for i in range(start, start + 20):
            conversation, ids = await two_turns(client, bearer(router, caller), i)
            true[caller].append(conversation)
            prompt_ids += ids
    status, doc = await read_summary(client, bearer(router))
    assert status == 200 and doc["entries"] == 2 * (1 + 20 * 4)  # per caller: the system message, 4 more per chat

    # No text, no token ids, no unkeyed form, in the document or in the filter's bytes.
    text, raw = json.dumps(doc).encode(), base64.b64decode(doc["bloom"]["data"])
    contents = {m["content"].encode() for chats in true.values() for c in chats for m in c}
    forms = [form for chats in true.values() for c in chats for form in chat_prefix_forms(c)]
    needles = ([content for content in contents if len(content) >= 8] + [i for ids in prompt_ids for i in packed(ids)]
               + forms + [form.hex().encode() for form in forms] + [base64.b64encode(form) for form in forms])
    assert [needle for needle in needles if needle in text or needle in raw] == []

    # A dictionary of 10,000 conversations, the 40 true ones among them: without the router's key (another
    # router's key, or the forms unkeyed) hits are Bloom false positives only; with it, the true ones are found.
    bloom = BloomFilter.from_json(doc["bloom"])
    fake = [[{"role": "system", "content": f"You answer questions about ferry {j}."},
             *question(j)[1:], {"role": "assistant", "content": "Soon."}, follow_up(j),
             {"role": "assistant", "content": "Later."}] for j in range(1000, 1000 + 10_000 - 40)]
    candidates = [c for chats in true.values() for c in chats] + fake
    candidate_forms = [form for c in candidates for form in chat_prefix_forms(c)]
    rate = (sum(bin(byte).count("1") for byte in raw) / bloom.bits) ** bloom.hashes  # this filter's own rate
    other = [summary_key("tz-another-router", caller, doc["epoch"]) for caller in ("alice", "bob")]
    tests = [form for form in candidate_forms] + [prefix_entry(key, form) for key in other for form in candidate_forms]
    hits = sum(entry in bloom for entry in tests)
    assert hits <= 3 * rate * len(tests)
    assert rate * len(tests) >= 10  # a bound that means something: tens of expected false positives

    for caller, chats in true.items():
        assert all(all(holds(doc, router, caller, chat_prefix_forms(c))) for c in chats)
    fake_forms = [form for c in fake for form in chat_prefix_forms(c)]
    keyed = [found for caller in true for found in holds(doc, router, caller, fake_forms)]
    assert sum(keyed) <= 3 * rate * len(keyed)


def http_json(node: Node, path: str, key: str | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(node.url + path, headers=bearer(key) if key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def test_a_router_reads_which_of_its_callers_prefixes_a_node_holds(node_factory, small_model_dir: Path) -> None:
    node = node_factory(small_model_dir)
    model = small_model_dir.name
    r1, r2, carol = node.add_key("r1", role="router"), node.add_key("r2", role="router"), node.add_key("carol")

    def client(key: str, caller: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=node.base, api_key=key, max_retries=0,
                             default_headers={"Tenzro-Caller": caller} if caller else None)

    def talk(chat_client: openai.OpenAI, i: int) -> tuple[Chat, int]:
        messages = question(i)
        for _ in range(2):
            reply = chat_client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
            messages = [*messages, {"role": "assistant", "content": reply.choices[0].message.content}, follow_up(i)]
        return messages, reply.usage.prompt_tokens_details.cached_tokens

    alice, reused = talk(client(r1, "alice"), 1)
    assert reused > 0
    bob, _ = talk(client(r1, "bob"), 2)
    # Another router's alice shares nothing with r1's.
    assert client(r2, "alice").chat.completions.create(model=model, messages=alice[:-1], max_tokens=1).usage \
        .prompt_tokens_details.cached_tokens == 0

    status, doc = http_json(node, f"/v1/cache/summary?model={model}", r1)
    assert status == 200
    verify_signed_object(http_json(node, "/v1/node")[1]["public_key"], doc)
    # alice's next request: her messages so far and a new question. Every prefix up to the last reply is warm
    # (message ends and the reply's end), for alice and under r1's key only.
    forms = chat_prefix_forms(alice)
    assert holds(doc, r1, "alice", forms) == [True] * 5 + [False]
    assert holds(doc, r1, "bob", forms) == [True] + [False] * 5  # bob sent the same system message, nothing more
    assert holds(doc, r2, "alice", forms) == [False] * 6
    assert holds(doc, r1, "bob", chat_prefix_forms(bob)) == [True] * 5 + [False]

    assert http_json(node, f"/v1/cache/summary?model={model}", carol)[0] == 403
    with pytest.raises(openai.PermissionDeniedError):
        client(carol, "alice").chat.completions.create(model=model, messages=alice[:2], max_tokens=1)
