"""The benchmarks' one HTTP client against a fake server (aiohttp test server): what it sends, how it reads a
stream, and that every failure is a BenchError naming the request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from bench.client import BenchError, Client, api_base
from tests.node.conftest import free_port

KEY, OPERATOR_KEY = "tz-caller", "tz-operator"
ROLE_DELAY_S = 0.2
USAGE = {"prompt_tokens": 7, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 5}}

Events = list[dict[str, Any] | str]


def test_api_base_accepts_root_and_v1_urls() -> None:
    assert api_base("http://h:8000") == "http://h:8000/v1"
    assert api_base("http://h:8000/") == "http://h:8000/v1"
    assert api_base("http://h:8000/v1") == "http://h:8000/v1"
    assert api_base("http://h:8000/v1/") == "http://h:8000/v1"


async def _sse(request: web.Request, events: Events) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for event in events:
        if event == "pause":
            await asyncio.sleep(ROLE_DELAY_S)
            continue
        await response.write(f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode())
    return response


def _fake_server(streams: dict[str, Events]) -> tuple[web.Application, list[tuple[str, dict[str, str], Any]]]:
    """A server whose POST routes stream `streams[path]`; it records (path, headers, JSON body) per request."""
    seen: list[tuple[str, dict[str, str], Any]] = []

    async def record(request: web.Request) -> None:
        body = await request.json() if request.can_read_body else None
        seen.append((request.path, dict(request.headers), body))

    async def models(request: web.Request) -> web.Response:
        await record(request)
        return web.json_response({"data": [{"id": "m1"}, {"id": "m2"}]})

    async def streamed(request: web.Request) -> web.StreamResponse:
        await record(request)
        if (await request.json()).get("stream"):
            return await _sse(request, streams[request.path])
        return web.json_response({"choices": [{"token_ids": [4, 2]}], "prompt_token_ids": [1, 2]})

    async def refused(request: web.Request) -> web.Response:
        return web.Response(status=503, text="queue full")

    async def node_state(request: web.Request) -> web.Response:
        await record(request)
        if request.headers.get("Authorization") != f"Bearer {OPERATOR_KEY}":
            return web.Response(status=403, text="operators only")
        return web.json_response({"sealing": {"plaintext_bytes": 0}})

    async def metrics(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {OPERATOR_KEY}":
            return web.Response(status=403, text="operators only")
        return web.Response(text="# HELP x\ntenzro_cached_bytes 1024\ntenzro_requests{route=\"chat\"} 3.0\n")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", streamed)
    app.router.add_post("/v1/chat/completions", streamed)
    app.router.add_post("/v1/refused", refused)
    app.router.add_get("/v1/node/state", node_state)
    app.router.add_get("/metrics", metrics)
    return app, seen


Serve = Callable[[web.Application], Awaitable[TestClient]]


async def _client(aiohttp_client: Serve, streams: dict[str, Events]
                  ) -> tuple[Client, list[tuple[str, dict[str, str], Any]]]:
    app, seen = _fake_server(streams)
    server = await aiohttp_client(app)
    return await Client.connect(server.session, str(server.make_url("/")), KEY), seen


async def test_connect_picks_the_first_listed_model_and_sends_the_key(aiohttp_client: Serve) -> None:
    client, seen = await _client(aiohttp_client, {})
    assert client.model == "m1" and client.base.endswith("/v1")
    assert [(path, headers["Authorization"]) for path, headers, _ in seen] == [("/v1/models", f"Bearer {KEY}")]
    assert await client.models() == ["m1", "m2"]


async def test_complete_sends_one_greedy_streamed_token_and_reads_usage(aiohttp_client: Serve) -> None:
    events: Events = [{"choices": [{"text": "a", "finish_reason": None}]},
                      {"choices": [{"text": "", "finish_reason": "length"}]},
                      {"choices": [], "usage": USAGE}, "[DONE]"]
    client, seen = await _client(aiohttp_client, {"/v1/completions": events})
    timing = await client.complete([5, 6, 7])
    assert (timing.prompt_tokens, timing.cached_tokens) == (7, 5) and timing.ttft_s > 0
    assert seen[-1][2] == {"model": "m1", "max_tokens": 1, "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}, "prompt": [5, 6, 7]}


async def test_chat_times_the_first_content_not_the_role_chunk(aiohttp_client: Serve) -> None:
    events: Events = [{"choices": [{"delta": {"role": "assistant"}}]}, "pause",
                      {"choices": [{"delta": {"content": "he"}}]}, {"choices": [{"delta": {"content": "y"}}]},
                      {"choices": [], "usage": USAGE}, "[DONE]"]
    client, seen = await _client(aiohttp_client, {"/v1/chat/completions": events})
    messages = [{"role": "user", "content": "hi"}]
    streamed = await client.chat(messages, max_tokens=24)
    assert streamed.ttft_s >= ROLE_DELAY_S
    assert (streamed.text, streamed.usage) == ("hey", USAGE)
    assert seen[-1][2]["messages"] == messages and seen[-1][2]["max_tokens"] == 24


async def test_post_returns_the_answer_and_node_state_is_read_with_the_operator_key(aiohttp_client: Serve) -> None:
    client, seen = await _client(aiohttp_client, {})
    assert await client.post("/completions", {"prompt": [1, 2], "return_token_ids": True}) == {
        "choices": [{"token_ids": [4, 2]}], "prompt_token_ids": [1, 2]}
    assert await client.node_state(OPERATOR_KEY) == {"sealing": {"plaintext_bytes": 0}}
    assert (seen[-1][0], seen[-1][1]["Authorization"]) == ("/v1/node/state", f"Bearer {OPERATOR_KEY}")
    with pytest.raises(BenchError, match=r"^GET http://.+/v1/node/state answered 403: operators only$"):
        await client.node_state(KEY)


async def test_metrics_are_read_with_the_operator_key(aiohttp_client: Serve) -> None:
    client, _ = await _client(aiohttp_client, {})
    assert await client.metrics(OPERATOR_KEY) == {"tenzro_cached_bytes": 1024.0, 'tenzro_requests{route="chat"}': 3.0}
    with pytest.raises(BenchError, match=r"^GET http://.+/metrics answered 403: operators only$"):
        await client.metrics(KEY)


@pytest.mark.parametrize("events", [
    [{"choices": [{"delta": {"role": "assistant"}}], "prompt_token_ids": [3, 1, 4]},  # vLLM: on the first chunk
     {"choices": [{"delta": {"content": "x"}}], "prompt_token_ids": None}, "[DONE]"],
    [{"choices": [{"delta": {"content": "x"}}]},  # this node: on the finishing chunk
     {"choices": [{"delta": {}, "finish_reason": "length"}], "prompt_token_ids": [3, 1, 4]}, "[DONE]"],
])
async def test_chat_reads_the_prompts_token_ids_where_the_server_sends_them(aiohttp_client: Serve,
                                                                            events: Events) -> None:
    client, seen = await _client(aiohttp_client, {"/v1/chat/completions": events})
    streamed = await client.chat([{"role": "user", "content": "hi"}], token_ids=True)
    assert (streamed.text, streamed.prompt_ids) == ("x", (3, 1, 4))
    assert seen[-1][2]["return_token_ids"] is True


@pytest.mark.parametrize(("events", "message"), [
    ([{"error": {"message": "boom"}}], "the server failed a request mid-stream: {'message': 'boom'}"),
    (["not json"], "the server streamed a non-JSON event: 'not json'"),
    ([{"choices": [{"delta": {"role": "assistant"}}]}, "[DONE]"], "streamed no generated text"),
])
async def test_a_broken_stream_raises_bench_error(aiohttp_client: Serve, events: Events, message: str) -> None:
    client, _ = await _client(aiohttp_client, {"/v1/chat/completions": events})
    with pytest.raises(BenchError) as raised:
        await client.chat([{"role": "user", "content": "hi"}])
    assert str(raised.value).endswith(message)


async def test_a_refusal_names_the_request_and_the_answer(aiohttp_client: Serve) -> None:
    client, _ = await _client(aiohttp_client, {})
    with pytest.raises(BenchError, match=r"^POST http://.+/v1/refused answered 503: queue full$"):
        await client.post("/refused", {})


async def test_a_server_that_is_not_there_is_a_bench_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with aiohttp.ClientSession() as session:
        with pytest.raises(BenchError, match=rf"^GET {url}/v1/models: Cannot connect to host"):
            await Client.connect(session, url, KEY)
