"""Anthropic's dialect at the node's HTTP edge, in process: its key header, and its error body on its route only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from node.config import add_key
from node.engine.loader import LoadedModel
from tests.node.api.test_middleware import node
from tests.node.test_router_callers import small_loaded  # noqa: F401 - a fixture


async def test_x_api_key_is_a_key_and_a_second_key_header_is_refused(aiohttp_client: Any, tmp_path: Path,
                                                                     small_loaded: LoadedModel) -> None:  # noqa: F811
    client, key = await node(aiohttp_client, tmp_path, small_loaded)
    body = {"model": small_loaded.model_id, "prompt": [5, 6], "max_tokens": 1}
    response = await client.post("/v1/completions", json=body, headers={"x-api-key": key})
    assert response.status == 200
    other = add_key(tmp_path / "node.yaml", "bob")
    response = await client.post("/v1/completions", json=body,
                                 headers={"x-api-key": key, "Authorization": f"Bearer {other}"})
    assert (response.status, await response.json()) == (401, {"error": {
        "message": "the request has 1 Authorization and 1 x-api-key headers: send one, 'Authorization: Bearer "
                   "<key>' or 'x-api-key: <key>'",
        "type": "invalid_request_error", "param": None, "code": "duplicate_authorization"}})


async def test_errors_on_the_messages_route_are_anthropics_and_elsewhere_openais(
        aiohttp_client: Any, tmp_path: Path, small_loaded: LoadedModel) -> None:  # noqa: F811
    client, key = await node(aiohttp_client, tmp_path, small_loaded)
    body = {"model": small_loaded.model_id, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
            "tools": []}
    response = await client.post("/v1/messages", json=body, headers={"x-api-key": key})
    assert (response.status, await response.json()) == (400, {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "tool use is not supported by this node yet; remove 'tools' from the request"}})
    response = await client.post("/v1/messages", json=body)
    assert (response.status, await response.json()) == (401, {"type": "error", "error": {
        "type": "authentication_error",
        "message": "missing API key: send the header 'Authorization: Bearer <key>'"}})
    response = await client.post("/v1/chat/completions", json={**body, "tools": [{"type": "function"}]},
                                 headers={"x-api-key": key})
    assert response.status == 400 and (await response.json())["error"]["param"] == "tools"
