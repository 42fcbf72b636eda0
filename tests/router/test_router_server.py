"""The router's HTTP front (router/app.py, router/forward.py, router/registry.py) over fake provider nodes.

Named test_router_server.py, not test_server.py: tests/node/test_server.py holds that module name (the test
directories are not packages).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from router.app import REGISTRY
from router.registry import Registry
from tests.router.conftest import ALICE_KEY, BOB_KEY, CAROL_KEY, Fleet, fake, router_key
from tests.router.fake_provider import MODEL, PRICES, stream_chunks

CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi."}]
NEXT_TURN = [*CONVERSATION, {"role": "user", "content": "And now?"}]


def priced(factor: float) -> dict[str, int]:
    return {name: int(price * factor) for name, price in PRICES.items()}


def registry(client: TestClient) -> Registry:
    return client.app[REGISTRY]


async def post(client: TestClient, body: dict[str, Any], key: str | None = ALICE_KEY,
               path: str = "/v1/chat/completions", headers: dict[str, str] | None = None) -> aiohttp.ClientResponse:
    sent = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
            **(headers or {})}
    return await client.post(path, data=json.dumps(body).encode(), headers=sent)


def chat(messages: list[dict[str, str]] = CONVERSATION, stream: bool = False) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "stream": stream}


async def answered_by(client: TestClient, body: dict[str, Any], key: str = ALICE_KEY) -> str:
    response = await post(client, body, key)
    assert response.status == 200, await response.text()
    assert (await response.json())["provider"] == response.headers["Tenzro-Provider"]
    return response.headers["Tenzro-Provider"]


async def eventually(condition: Any) -> None:
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


# Forwarding


async def test_a_request_goes_to_the_cheapest_node_with_the_routers_key_there_and_the_callers_id(fleet: Fleet) -> None:
    a, b = fake("a"), fake("b", prices=priced(3))
    client = await fleet.router([a, b])
    body = json.dumps(chat()).encode()
    response = await client.post("/v1/chat/completions", data=body, headers={
        "Authorization": f"Bearer {ALICE_KEY}", "Content-Type": "application/json"})
    assert response.status == 200
    assert response.headers["Tenzro-Provider"] == "a"
    assert await response.json() == {"object": "chat.completion", "provider": "a", "choices": [
        {"message": {"role": "assistant", "content": "hello"}}]}
    [received] = a.received
    assert (received.path, received.body) == ("/v1/chat/completions", body)
    assert received.headers["Authorization"] == f"Bearer {router_key('a')}"
    assert received.headers["Tenzro-Caller"] == "alice"
    assert not any(ALICE_KEY in value for value in received.headers.values())
    assert not any(name.lower().startswith("tenzro-") and name != "Tenzro-Caller" for name in received.headers)
    assert b.received == []


async def test_text_completions_are_routed_the_same_way(fleet: Fleet) -> None:
    a = fake("a")
    client = await fleet.router([a])
    response = await post(client, {"model": MODEL, "prompt": "Once upon"}, path="/v1/completions")
    assert (response.status, response.headers["Tenzro-Provider"]) == (200, "a")
    assert [received.path for received in a.received] == ["/v1/completions"]


async def test_requirements_are_merged_and_forwarded_for_the_node_to_enforce(fleet: Fleet) -> None:
    """bob's configured jurisdiction (DE) and his request's price ceiling both reach the node as headers."""
    a, b = fake("a"), fake("b", jurisdiction="DE", prices=priced(1.5))
    client = await fleet.router([a, b])
    response = await post(client, chat(), BOB_KEY, headers={"Tenzro-Max-Price-Wei": "input=2000000000"})
    assert (response.status, response.headers["Tenzro-Provider"]) == (200, "b")
    [received] = b.received
    assert received.headers["Tenzro-Caller"] == "bob"
    assert received.headers["Tenzro-Jurisdictions"] == "DE"
    assert received.headers["Tenzro-Max-Price-Wei"] == "input=2000000000"
    assert a.received == []


async def test_a_stream_passes_through_as_it_arrives(fleet: Fleet) -> None:
    """The client reads the node's first event while the node is still holding back the rest."""
    gate = asyncio.Event()
    a = fake("a", gate=gate)
    client = await fleet.router([a])
    response = await post(client, chat(stream=True))
    assert response.status == 200
    assert response.headers["Content-Type"] == "text/event-stream"
    assert response.headers["Tenzro-Provider"] == "a"
    chunks = stream_chunks("a")
    assert await asyncio.wait_for(response.content.readuntil(b"\n\n"), 5) == chunks[0]
    assert not gate.is_set()
    gate.set()
    assert await response.content.read() == b"".join(chunks[1:])
    assert chunks[-1] == b"data: [DONE]\n\n"


async def test_a_busy_node_loses_to_an_idle_one_that_costs_a_little_more(fleet: Fleet) -> None:
    """a: three requests waiting (wait 4x, base 2.0); b: 50% pricier and idle (base 1.22)."""
    a, b = fake("a", waiting=3), fake("b", prices=priced(1.5))
    client = await fleet.router([a, b])
    assert await answered_by(client, chat()) == "b"
    a.waiting = 0
    await registry(client).poll()
    registry(client).state("b").latency_s = None  # as measured by nobody: the two differ in price alone
    assert await answered_by(client, chat()) == "a"


async def test_latency_is_an_ewma_of_the_time_to_first_byte(fleet: Fleet) -> None:
    client = await fleet.router([fake("a")])
    registry(client).observe_latency("a", 1.0)
    registry(client).observe_latency("a", 2.0)
    assert registry(client).state("a").latency_s == 0.3 * 2.0 + 0.7 * 1.0


def loads(client: TestClient) -> dict[str, int]:
    return {candidate.name: candidate.load for candidate in registry(client).candidates(MODEL, "alice")}


async def test_a_request_counts_as_load_once_while_in_flight_and_not_after(fleet: Fleet) -> None:
    """a has two requests of others waiting. Alice's open stream counts once more, also after a poll in which a
    reports it running (the node's count less the router's own); the moment it ends it counts no more, with no
    poll in between (counted until the next poll, it sent an agent's next turn to a cold node)."""
    gate = asyncio.Event()
    a = fake("a", gate=gate, waiting=2)
    client = await fleet.router([a])
    assert loads(client) == {"a": 2}
    response = await post(client, chat(stream=True))
    await asyncio.wait_for(response.content.readuntil(b"\n\n"), 5)
    assert loads(client) == {"a": 3}
    await registry(client).poll()
    assert (a.waiting, a.running, loads(client)) == (2, 1, {"a": 3})
    gate.set()
    await response.content.read()
    await eventually(lambda: loads(client) == {"a": 2})


async def test_idle_comparable_nodes_take_turns_at_cold_requests(fleet: Fleet) -> None:
    """Each answered before the next is sent, so no load tells them apart: the one sent to longest ago wins."""
    client = await fleet.router([fake("a"), fake("b"), fake("c")])
    assert [await answered_by(client, chat()) for _ in range(4)] == ["a", "b", "c", "a"]


async def test_a_request_stops_counting_however_it_ends(fleet: Fleet) -> None:
    """A node failing before its first byte (the request answered elsewhere), one breaking off mid-stream, and a
    client going away mid-stream each leave nothing counted in flight at any node."""
    failing, fallback = fake("failing", mode="500"), fake("fallback", prices=priced(3))
    client = await fleet.router([failing, fallback])
    assert await answered_by(client, chat()) == "fallback"
    assert [registry(client).state(name).in_flight for name in ("failing", "fallback")] == [0, 0]

    client = await fleet.router([fake("breaking", mode="break")])
    response = await post(client, chat(stream=True))
    with pytest.raises(aiohttp.ClientPayloadError):
        await asyncio.wait_for(response.content.read(), 5)
    await eventually(lambda: registry(client).state("breaking").in_flight == 0)

    gate = asyncio.Event()
    held = fake("held", gate=gate)
    client = await fleet.router([held])
    response = await post(client, chat(stream=True))
    await asyncio.wait_for(response.content.readuntil(b"\n\n"), 5)
    assert registry(client).state("held").in_flight == 1
    response.close()  # the client goes away: its handler is cancelled, and the node's connection closed
    await eventually(lambda: registry(client).state("held").in_flight == 0)
    await eventually(lambda: held.running == 0)


# Failures before and after the first byte


async def test_a_node_that_refuses_connections_is_passed_over_before_the_first_byte(fleet: Fleet) -> None:
    a, b = fake("a"), fake("b", prices=priced(3))
    client = await fleet.router([a, b])
    await fleet.servers["a"].close()
    assert await answered_by(client, chat()) == "b"
    state = registry(client).state("a")
    assert (state.up, state.problem) == (False, "no answer: ClientConnectorError")
    assert len(b.received) == 1


async def test_a_failing_node_is_tried_once_then_skipped_until_it_comes_back(fleet: Fleet) -> None:
    a, b = fake("a", mode="500"), fake("b", prices=priced(3))
    client = await fleet.router([a, b])
    assert await answered_by(client, chat()) == "b"
    assert (len(a.received), len(b.received)) == (1, 1)
    assert registry(client).state("a").problem == "answered 500"

    assert await answered_by(client, chat()) == "b"
    assert len(a.received) == 1  # down: not tried again

    a.mode, a.healthy = "ok", False
    await registry(client).poll()
    assert registry(client).state("a").up is False  # its /health does not answer ok yet
    a.healthy = True
    await registry(client).poll()
    assert registry(client).state("a").up is True
    assert await answered_by(client, chat()) == "a"


async def test_a_silent_node_is_given_up_on_before_its_first_byte(fleet: Fleet) -> None:
    a, b = fake("a", mode="hang"), fake("b", prices=priced(3))
    client = await fleet.router([a, b])
    started = time.monotonic()
    assert await answered_by(client, chat()) == "b"
    assert time.monotonic() - started < 5  # the 0.5 s first-byte timeout, not the fake's 30 s
    assert registry(client).state("a").problem == "no answer: TimeoutError"


async def test_a_node_breaking_off_mid_stream_is_not_retried_and_the_client_sees_the_break(fleet: Fleet) -> None:
    """After the first byte the answer is that node's: the client's connection drops rather than a second node
    answering the same request, or a truncated stream looking complete."""
    a, b = fake("a", mode="break"), fake("b", prices=priced(3))
    client = await fleet.router([a, b])
    response = await post(client, chat(stream=True))
    assert (response.status, response.headers["Tenzro-Provider"]) == (200, "a")
    with pytest.raises(aiohttp.ClientPayloadError):
        await asyncio.wait_for(response.content.read(), 5)
    assert b.received == []
    assert registry(client).state("a").up is False


async def test_when_every_node_fails_the_last_nodes_own_answer_is_passed_on(fleet: Fleet) -> None:
    a, b = fake("a", mode="500"), fake("b", prices=priced(3), mode="500")
    client = await fleet.router([a, b])
    response = await post(client, chat())
    assert (response.status, response.headers["Tenzro-Provider"]) == (500, "b")
    assert await response.json() == {"error": {"message": "model failure", "type": "server_error"}}

    response = await post(client, chat())  # both are down now
    body = await response.json()
    assert (response.status, body["error"]["code"]) == (503, "no_provider_available")


async def test_nodes_that_never_answered_are_down_from_the_start(fleet: Fleet) -> None:
    client = await fleet.router([fake("a")], dead=("z",))
    assert await (await client.get("/health")).json() == {"status": "ok", "providers": 2, "providers_up": 1}
    assert registry(client).state("z").problem == "poll failed: ClientConnectorError"
    assert await answered_by(client, chat()) == "a"


async def test_when_no_node_answers_at_all_the_router_says_so(fleet: Fleet) -> None:
    a = fake("a")
    client = await fleet.router([a])
    await fleet.servers["a"].close()
    response = await post(client, chat())
    body = await response.json()
    assert (response.status, body["error"]["code"]) == (502, "provider_failed")
    assert body["error"]["message"] == "no provider answered: a: no answer: ClientConnectorError"


# Warm state


async def test_the_warm_bias_picks_the_comparable_node_holding_the_conversation(fleet: Fleet) -> None:
    """a is cheapest and cold; b costs 10% more (base 1.049) and holds alice's conversation; c costs twice as much
    (base 1.414, past the 20% margin) and holds it one turn deeper. b wins; with the bias off, a does."""
    a = fake("a")
    b = fake("b", prices=priced(1.1), held={"alice": [CONVERSATION]})
    c = fake("c", prices=priced(2), held={"alice": [NEXT_TURN]})
    warm = await fleet.router([a, b, c])
    assert await answered_by(warm, chat(NEXT_TURN)) == "b"
    cold = await fleet.router([a, b, c], routing="least-loaded")
    assert await answered_by(cold, chat(NEXT_TURN)) == "a"


async def test_warm_state_is_per_caller(fleet: Fleet) -> None:
    """b holds alice's conversation; carol sending the same messages finds nothing of hers there."""
    a, b = fake("a"), fake("b", prices=priced(1.1), held={"alice": [CONVERSATION]})
    client = await fleet.router([a, b])
    assert await answered_by(client, chat(NEXT_TURN), CAROL_KEY) == "a"
    assert await answered_by(client, chat(NEXT_TURN), ALICE_KEY) == "b"


async def test_a_summary_that_does_not_verify_is_ignored(fleet: Fleet) -> None:
    a, b = fake("a"), fake("b", prices=priced(1.1), held={"alice": [CONVERSATION]}, tamper=True)
    client = await fleet.router([a, b])
    assert registry(client).state("b").up is True
    assert registry(client).state("b").summaries == {}
    assert await answered_by(client, chat(NEXT_TURN)) == "a"


async def test_two_routers_over_the_same_nodes_choose_alike(fleet: Fleet) -> None:
    """Routers share nothing but the providers file: the nodes see one router identity, so a conversation one
    router sent to b is warm there for the other router too."""
    a, b = fake("a"), fake("b", prices=priced(1.1), held={"alice": [CONVERSATION]})
    first, second = await fleet.router([a, b]), await fleet.router([a, b])
    assert [await answered_by(router, chat(NEXT_TURN)) for router in (first, second)] == ["b", "b"]
    cold = [{"role": "user", "content": "Something else"}]
    assert [await answered_by(router, chat(cold)) for router in (first, second)] == ["a", "a"]
    assert {received.headers["Authorization"] for received in b.received} == {f"Bearer {router_key('b')}"}


# Refusals


async def test_no_node_meeting_a_requirement_is_a_412_naming_it(fleet: Fleet) -> None:
    a, b = fake("a", jurisdiction="FR"), fake("b", prices=priced(3))
    client = await fleet.router([a, b])
    response = await post(client, chat(), BOB_KEY)
    assert response.status == 412
    assert await response.json() == {"error": {
        "message": "no provider of this model meets the requirement jurisdiction (a: jurisdiction DE required; this "
                   "node declares FR; b: jurisdiction DE required; this node declares no jurisdiction (unset))",
        "type": "invalid_request_error", "param": "jurisdiction", "code": "requirement_not_met"}}
    response = await post(client, chat(), headers={"Tenzro-Require-Confidential": "true"})
    assert (response.status, (await response.json())["error"]["param"]) == (412, "confidential_hardware")
    response = await post(client, chat(), headers={"Tenzro-Max-Price-Wei": "output=1"})
    assert (response.status, (await response.json())["error"]["param"]) == (412, "max_price_wei.output")
    assert a.received == b.received == []


async def test_a_node_refusing_what_its_last_poll_offered_is_passed_over_and_polled_again(fleet: Fleet) -> None:
    a, b = fake("a", jurisdiction="DE"), fake("b", jurisdiction="DE", prices=priced(3))
    client = await fleet.router([a, b])
    a.jurisdiction = "FR"  # moved since the poll: the node itself refuses bob's forwarded requirement
    assert await answered_by(client, chat(), BOB_KEY) == "b"
    assert len(a.received) == 1
    await eventually(lambda: registry(client).state("a").node.offer.jurisdiction == "FR")
    assert await answered_by(client, chat(), BOB_KEY) == "b"
    assert len(a.received) == 1


@pytest.mark.parametrize(("headers", "param"), [
    ({"Tenzro-Jurisdictions": "de"}, "Tenzro-Jurisdictions"),
    ({"Tenzro-Require-Confidentail": "true"}, "Tenzro-Require-Confidentail"),
])
async def test_a_malformed_requirement_header_is_a_400_naming_it(fleet: Fleet, headers: dict[str, str],
                                                                  param: str) -> None:
    client = await fleet.router([fake("a")])
    response = await post(client, chat(), headers=headers)
    body = await response.json()
    assert (response.status, body["error"]["param"], body["error"]["code"]) == (400, param,
                                                                                 "invalid_requirement_header")


@pytest.mark.parametrize("authorization", [None, "Bearer tz-wrong", "Basic dXNlcjpwYXNz", "Bearer ", "Bearer tz-é"])
async def test_requests_without_a_routers_key_are_401(fleet: Fleet, authorization: str | None) -> None:
    a = fake("a")
    client = await fleet.router([a])
    headers = {} if authorization is None else {"Authorization": authorization}
    for path in ("/v1/chat/completions", "/v1/completions"):
        response = await client.post(path, data=json.dumps(chat()).encode(), headers=headers)
        body = await response.json()
        assert (response.status, body["error"]["code"]) == (401, "invalid_api_key")
    assert (await client.get("/v1/models", headers=headers)).status == 401
    assert a.received == []


async def test_models_lists_what_the_providers_serve(fleet: Fleet) -> None:
    client = await fleet.router([fake("a")])
    response = await client.get("/v1/models", headers={"Authorization": f"Bearer {ALICE_KEY}"})
    assert await response.json() == {"object": "list", "data": [
        {"id": MODEL, "object": "model", "created": 0, "owned_by": "tenzro"}]}


@pytest.mark.parametrize(("body", "status", "code"), [
    (b"not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_json"),
    (json.dumps({"messages": []}).encode(), 400, None),
    (json.dumps({"model": "other", "messages": []}).encode(), 404, "model_not_found"),
])
async def test_a_body_the_router_cannot_route_is_refused(fleet: Fleet, body: bytes, status: int,
                                                        code: str | None) -> None:
    a = fake("a")
    client = await fleet.router([a])
    response = await client.post("/v1/chat/completions", data=body,
                                 headers={"Authorization": f"Bearer {ALICE_KEY}"})
    assert (response.status, (await response.json())["error"]["code"]) == (status, code)
    assert a.received == []


async def test_an_oversized_body_is_a_413_in_openai_shape(fleet: Fleet) -> None:
    client = await fleet.router([fake("a")], max_body_bytes=1024)
    response = await post(client, chat([{"role": "user", "content": "x" * 2000}]))
    body = await response.json()
    assert (response.status, body["error"]["type"]) == (413, "invalid_request_error")



# A caller's own records


RECORD = {"object": "generation", "record_id": "chatcmpl-1", "caller_id": "router/alice", "signature": "00" * 64}
GENERATION_CALL = {"jsonrpc": "2.0", "method": "tenzro_getGeneration", "params": {"id": "chatcmpl-1"}, "id": 1}


async def read_generation(client: TestClient, record_id: str, key: str = ALICE_KEY) -> tuple[int, str | None, Any]:
    response = await client.get("/v1/generation", params={"id": record_id},
                                headers={"Authorization": f"Bearer {key}"})
    return response.status, response.headers.get("Tenzro-Provider"), await response.json()


async def rpc(client: TestClient, body: Any, key: str | None = ALICE_KEY,
              content_type: str = "application/json") -> tuple[int, Any]:
    headers = {"Content-Type": content_type, **({"Authorization": f"Bearer {key}"} if key else {})}
    response = await client.post("/rpc", data=json.dumps(body).encode(), headers=headers)
    text = await response.text()
    return response.status, json.loads(text) if text else None


async def test_a_record_is_read_from_the_node_that_holds_it_as_the_routers_caller(fleet: Fleet) -> None:
    """Every node up is asked, with the router's key there and the caller's id; the one holding the record
    answers, and the router passes its bytes on naming it. Bob asking for alice's record is told what an unknown
    id gets, in the node's words."""
    a, b = fake("a"), fake("b", records={("alice", "chatcmpl-1"): RECORD})
    client = await fleet.router([a, b])
    assert await read_generation(client, "chatcmpl-1") == (200, "b", RECORD)
    for node in (a, b):
        [received] = node.received
        assert received.path == "/v1/generation?id=chatcmpl-1"
        assert (received.headers["Authorization"], received.headers["Tenzro-Caller"]) == (
            f"Bearer {router_key(node.name)}", "alice")
    not_found = {"error": {"message": "no generation with this id for this API key", "type": "not_found_error",
                           "param": "id", "code": "generation_not_found"}}
    assert await read_generation(client, "chatcmpl-1", BOB_KEY) == (404, None, not_found)
    assert await read_generation(client, "chatcmpl-2") == (404, None, not_found)
    assert await rpc(client, GENERATION_CALL) == (200, {"jsonrpc": "2.0", "result": RECORD, "id": 1})
    assert await rpc(client, GENERATION_CALL, BOB_KEY) == (200, {"jsonrpc": "2.0", "id": 1, "error": {
        "code": -32004, "message": not_found["error"]["message"], "data": not_found["error"]}})


async def test_a_record_that_may_be_on_a_node_down_is_not_called_missing(fleet: Fleet) -> None:
    """z is down: a record no node up holds may be its, so the caller is told to retry (503), not that it does not
    exist; a record a node up holds is read as ever."""
    client = await fleet.router([fake("a", records={("alice", "chatcmpl-1"): RECORD})], dead=("z",))
    assert await read_generation(client, "chatcmpl-1") == (200, "a", RECORD)
    status, _, body = await read_generation(client, "chatcmpl-2")
    assert (status, body["error"]["code"], body["error"]["type"]) == (503, "generation_unavailable", "server_error")
    assert "z: down" in body["error"]["message"]
    _, answer = await rpc(client, {**GENERATION_CALL, "params": ["chatcmpl-2"]})
    assert answer["error"]["code"] == -32005


async def test_json_rpc_at_the_router_answers_as_a_node_does(fleet: Fleet) -> None:
    client = await fleet.router([fake("a", records={("alice", "chatcmpl-1"): RECORD})])
    refused = await rpc(client, [GENERATION_CALL, {**GENERATION_CALL, "id": 2}], key="tz-wrong")
    assert [(item["id"], item["error"]["code"], item["error"]["data"]["code"]) for item in refused[1]] == [
        (1, -32001, "invalid_api_key"), (2, -32001, "invalid_api_key")]
    notification = {key: value for key, value in GENERATION_CALL.items() if key != "id"}
    assert await rpc(client, notification) == (204, None)
    _, answers = await rpc(client, [notification, {**GENERATION_CALL, "method": "tenzro_getAttestation"},
                                    {**GENERATION_CALL, "params": {"id": 7}}, {**GENERATION_CALL, "params": 7},
                                    {"jsonrpc": "1.0", "method": "m", "id": 5}])
    assert [(item["id"], item["error"]["code"]) for item in answers] == [(1, -32601), (1, -32602), (1, -32602),
                                                                         (5, -32600)]
    assert answers[0]["error"]["message"] == "no method 'tenzro_getAttestation'; methods: tenzro_getGeneration"
    assert await rpc(client, [GENERATION_CALL] * 101) == (200, {"jsonrpc": "2.0", "id": None, "error": {
        "code": -32600, "message": "a batch holds 1 to 100 calls"}})
    status, body = await rpc(client, GENERATION_CALL, content_type="text/plain")
    assert (status, body["error"]["code"]) == (415, "unsupported_content_type")
    for raw, status, code in ((b"{", 200, -32700), (b" " * (256 * 1024 + 1), 413, None)):
        response = await client.post("/rpc", data=raw, headers={"Content-Type": "application/json"})
        body = await response.json()
        assert (response.status, body["error"].get("code")) == (status, code)
