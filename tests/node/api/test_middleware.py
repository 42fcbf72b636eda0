"""The node's HTTP edge in process: compressed bodies refused before any key is checked, two Authorization headers
refused, a late body answered 408, a body past the parsers' limits answered 400 (each was a silent pick, an
inflation or a 500 before issue 33)."""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient
from multidict import CIMultiDict

from node.api.body import ORJSON_MAX_BYTES
from node.config import Limits, NodeConfig, add_key, save_config
from node.engine.loader import LoadedModel
from tests.node.test_router_callers import bearer, serve, small_loaded  # noqa: F401 - a fixture

COMPRESSED = {"error": {"message": "compressed request bodies are not accepted (Content-Encoding: gzip): send the "
                                   "body uncompressed, without Content-Encoding",
                        "type": "invalid_request_error", "param": None, "code": "compressed_body_refused"}}


async def node(aiohttp_client: Any, tmp_path: Path, loaded: LoadedModel, limits: Limits | None = None
               ) -> tuple[TestClient, str]:
    save_config(tmp_path / "node.yaml", NodeConfig(limits=limits or Limits()))
    client = await serve(aiohttp_client, tmp_path, loaded)
    return client, add_key(tmp_path / "node.yaml", "alice")


async def test_a_compressed_body_is_refused_before_any_key_is_checked(aiohttp_client: Any, tmp_path: Path,
                                                                      small_loaded: LoadedModel) -> None:  # noqa: F811
    client, key = await node(aiohttp_client, tmp_path, small_loaded)
    bomb = gzip.compress(b"\0" * 10_000_000)
    for path in ("/v1/chat/completions", "/v1/completions", "/rpc", "/v1/node"):
        for headers in ({}, bearer("tz-wrong"), bearer(key)):
            response = await client.post(path, data=bomb, headers={"Content-Encoding": "gzip", **headers})
            assert (response.status, await response.json()) == (415, COMPRESSED), (path, headers)
    response = await client.post("/v1/completions", data=b"{}", headers={"Content-Encoding": "x-rot13",
                                                                         **bearer(key)})
    assert (response.status, (await response.json())["error"]["code"]) == (400, "invalid_content_encoding")
    body = {"model": small_loaded.model_id, "prompt": [5, 6], "max_tokens": 1}
    response = await client.post("/v1/completions", json=body, headers={"Content-Encoding": "identity", **bearer(key)})
    assert response.status == 200


async def test_two_authorization_headers_are_refused_not_picked(aiohttp_client: Any, tmp_path: Path,
                                                                 small_loaded: LoadedModel) -> None:  # noqa: F811
    client, key = await node(aiohttp_client, tmp_path, small_loaded)
    other = add_key(tmp_path / "node.yaml", "bob")
    body = {"model": small_loaded.model_id, "prompt": [5, 6], "max_tokens": 1}
    for pair in ((key, other), (key, key), ("tz-wrong", key)):
        sent = CIMultiDict([("Authorization", f"Bearer {value}") for value in pair])
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/node"), ("GET", "/health")):
            response = await client.request(method, path, json=body if method == "POST" else None, headers=sent)
            assert (response.status, await response.json()) == (401, {"error": {
                "message": "the request has 2 Authorization headers: send one, 'Authorization: Bearer <key>'",
                "type": "invalid_request_error", "param": None, "code": "duplicate_authorization"}}), path


async def test_a_body_slower_than_its_deadline_is_a_408_and_the_connection_closes(
        aiohttp_client: Any, tmp_path: Path, small_loaded: LoadedModel) -> None:  # noqa: F811
    client, key = await node(aiohttp_client, tmp_path, small_loaded, Limits(body_timeout_s=1))
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"mod")
    started = time.monotonic()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert 0.9 <= time.monotonic() - started <= 2.5
    assert head.startswith(b"HTTP/1.1 408 ") and b"Connection: close\r\n" in head
    length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
    assert json.loads(await reader.readexactly(length)) == {"error": {
        "message": "the request body did not arrive within 1 s", "type": "invalid_request_error", "param": None,
        "code": "body_timeout"}}
    writer.close()


async def test_an_integer_too_long_to_convert_in_a_large_body_is_a_400(aiohttp_client: Any, tmp_path: Path,
                                                                       small_loaded: LoadedModel) -> None:  # noqa: F811
    """Past a megabyte the body is parsed by json, whose int() refuses over 4,300 digits: that was a 500."""
    client, key = await node(aiohttp_client, tmp_path, small_loaded)
    raw = (b'{"model": "m", "prompt": [1], "seed": ' + b"9" * 5000 + b"}").ljust(ORJSON_MAX_BYTES + 1)
    response = await client.post("/v1/completions", data=raw, headers={"Content-Type": "application/json",
                                                                       **bearer(key)})
    assert (response.status, await response.json()) == (400, {"error": {
        "message": "the request body is not valid JSON: an integer has more than 4300 digits",
        "type": "invalid_request_error", "param": None, "code": "invalid_json"}})
