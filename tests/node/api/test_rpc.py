"""JSON-RPC at `POST /rpc` in process: refused keys answered as error objects per call, notifications never
answered, JSON required, and a large body parsed off the event loop (issue 33)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from multidict import CIMultiDict

from node.api import body as body_module
from node.api.body import INLINE_JSON_BYTES
from node.api.rpc import MAX_BATCH, MAX_BODY_BYTES
from node.config import add_key
from node.engine.loader import LoadedModel
from tests.node.test_router_callers import bearer, serve, small_loaded  # noqa: F401 - a fixture

ATTEST = {"jsonrpc": "2.0", "method": "tenzro_getAttestation"}
GENERATION = {"jsonrpc": "2.0", "method": "tenzro_getGeneration", "params": {"id": "chatcmpl-none"}}


async def rpc(client: TestClient, body: Any, headers: Any = None, content_type: str | None = "application/json"
              ) -> tuple[int, Any]:
    sent = CIMultiDict(headers or {})
    if content_type is not None:
        sent["Content-Type"] = content_type
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = await client.post("/rpc", data=raw, headers=sent)
    text = await response.text()
    return response.status, json.loads(text) if text else None


def codes(answer: Any) -> list[tuple[Any, int | None]]:
    """(id, error code or None) of each response in an answer."""
    return [(item["id"], item.get("error", {}).get("code")) for item in (answer if isinstance(answer, list)
                                                                          else [answer])]


async def test_a_refused_key_is_an_error_object_for_each_call(aiohttp_client: Any, tmp_path: Path,
                                                               small_loaded: LoadedModel) -> None:  # noqa: F811
    client = await serve(aiohttp_client, tmp_path, small_loaded)
    key = add_key(tmp_path / "node.yaml", "alice")
    status, answer = await rpc(client, [{**ATTEST, "id": 1}, {**GENERATION, "id": "g"}], bearer("tz-wrong"))
    assert status == 200 and codes(answer) == [(1, -32001), ("g", -32001)]
    assert answer[0]["error"]["data"] == {"message": "invalid API key", "type": "invalid_request_error",
                                          "param": None, "code": "invalid_api_key"}
    # No key: the evidence is public, a record needs the key.
    status, answer = await rpc(client, [{**ATTEST, "id": 1}, {**GENERATION, "id": 2}])
    assert status == 200 and codes(answer) == [(1, None), (2, -32001)]
    # A caller key naming a caller to act for, and two keys at once, are refused the same way.
    _, answer = await rpc(client, {**ATTEST, "id": 3}, bearer(key, "bob"))
    assert codes(answer) == [(3, -32003)] and answer["error"]["data"]["code"] == "router_role_required"
    two = CIMultiDict([("Authorization", f"Bearer {key}"), ("Authorization", f"Bearer {key}")])
    status, answer = await rpc(client, {**ATTEST, "id": 4}, two)
    assert status == 200 and codes(answer) == [(4, -32001)]
    assert answer["error"]["data"]["code"] == "duplicate_authorization"
    status, answer = await rpc(client, {**GENERATION, "id": 5}, bearer(key))
    assert status == 200 and codes(answer) == [(5, -32004)]  # past the key: the record is not found


async def test_notifications_are_never_answered(aiohttp_client: Any, tmp_path: Path,
                                                 small_loaded: LoadedModel) -> None:  # noqa: F811
    client = await serve(aiohttp_client, tmp_path, small_loaded)
    failing = [{"jsonrpc": "2.0", "method": "tenzro_nope"}, {**GENERATION}, {**ATTEST, "params": {"nonce": "zz"}},
               {**ATTEST, "params": 7}]
    for notification in failing:
        assert await rpc(client, notification) == (204, None)
        assert await rpc(client, notification, bearer("tz-wrong")) == (204, None)
    assert await rpc(client, [*failing, ATTEST]) == (204, None)
    status, answer = await rpc(client, [*failing, {**ATTEST, "id": 9}, {"jsonrpc": "2.0", "method": "tenzro_nope",
                                                                          "id": 10}])
    assert status == 200 and codes(answer) == [(9, None), (10, -32601)]
    # What is not a call at all is answered, with the id where one can be read (JSON-RPC 2.0 section 5).
    _, answer = await rpc(client, [{"foo": "boo"}, 1, {"jsonrpc": "1.0", "method": "m", "id": 11},
                                   {"jsonrpc": "2.0", "method": "m", "id": {"a": 1}},
                                   {"jsonrpc": "2.0", "method": "m", "id": True}])
    assert codes(answer) == [(None, -32600), (None, -32600), (11, -32600), (None, -32600), (None, -32600)]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
async def test_a_body_not_sent_as_json_is_a_415(aiohttp_client: Any, tmp_path: Path, small_loaded: LoadedModel,  # noqa: F811
                                                content_type: str | None) -> None:
    client = await serve(aiohttp_client, tmp_path, small_loaded)
    assert await rpc(client, {**ATTEST, "id": 1}, content_type=content_type) == (415, {"error": {
        "message": "JSON-RPC requests are sent with 'Content-Type: application/json'",
        "type": "invalid_request_error", "param": None, "code": "unsupported_content_type"}})
    status, answer = await rpc(client, {**ATTEST, "id": 1}, content_type="application/json; charset=utf-8")
    assert status == 200 and codes(answer) == [(1, None)]


async def test_a_large_body_is_parsed_off_the_event_loop(aiohttp_client: Any, tmp_path: Path,
                                                          small_loaded: LoadedModel,  # noqa: F811
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    client = await serve(aiohttp_client, tmp_path, small_loaded)
    parsed_on: list[threading.Thread] = []
    parse = body_module.parse_json

    def recording(raw: bytes) -> object:
        parsed_on.append(threading.current_thread())
        return parse(raw)

    monkeypatch.setattr(body_module, "parse_json", recording)
    raw = json.dumps([{**ATTEST, "id": 1}]).encode().ljust(INLINE_JSON_BYTES + 1)
    status, answer = await rpc(client, raw)
    assert status == 200 and codes(answer) == [(1, None)]
    assert len(parsed_on) == 1 and parsed_on[0] is not threading.current_thread()
    _, answer = await rpc(client, b"{not json".ljust(INLINE_JSON_BYTES + 1))
    assert codes(answer) == [(None, -32700)]


async def test_a_body_larger_than_a_full_batch_is_refused_before_it_is_read(aiohttp_client: Any, tmp_path: Path,
                                                                             small_loaded: LoadedModel,  # noqa: F811
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    client = await serve(aiohttp_client, tmp_path, small_loaded)
    parsed: list[bytes] = []
    parse = body_module.parse_json
    monkeypatch.setattr(body_module, "parse_json", lambda raw: parsed.append(raw) or parse(raw))
    full = [{**GENERATION, "id": f"call-{i}"} for i in range(MAX_BATCH)]
    assert len(json.dumps(full)) < MAX_BODY_BYTES
    status, answer = await rpc(client, full)
    assert status == 200 and len(answer) == MAX_BATCH and len(parsed) == 1
    status, answer = await rpc(client, b"[" + b"0," * (MAX_BODY_BYTES // 2) + b"0]")
    assert (status, answer["error"]["code"]) == (413, "request_too_large") and len(parsed) == 1
