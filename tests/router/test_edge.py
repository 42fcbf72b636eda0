"""The HTTP edge both servers listen through (`router/edge.py`), and the router's refusals at it: compressed bodies,
late heads, slow bodies, two Authorization headers."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml
from aiohttp import ClientSession, web
from multidict import CIMultiDict, CIMultiDictProxy

from bench.local_node import TENZRO
from router.edge import EdgeRunner, coding_refusal
from tests.node.conftest import free_port
from tests.router.conftest import ALICE_KEY, BOB_KEY, CALLERS, Fleet, closed_url, fake
from tests.router.test_router_server import chat

HEAD_S = 0.5
SLACK_S = 1.5
"""Time past a deadline a close may take on a loaded test machine."""


def headers(*pairs: tuple[str, str]) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict(pairs))


@pytest.mark.parametrize(("values", "refused"), [
    ((), None),
    (("identity",), None),
    (("Identity , identity",), None),
    (("gzip",), (True, "compressed_body_refused")),
    (("x-gzip",), (True, "compressed_body_refused")),
    (("identity", "BR"), (True, "compressed_body_refused")),
    (("deflate, zstd",), (True, "compressed_body_refused")),
    (("compress",), (True, "compressed_body_refused")),
    (("gzip, rot13",), (True, "compressed_body_refused")),
    (("rot13",), (False, "invalid_content_encoding")),
    (("",), (False, "invalid_content_encoding")),
    (("gzip;q=1",), (False, "invalid_content_encoding")),
])
def test_a_body_coding_other_than_identity_is_refused(values: tuple[str, ...],
                                                       refused: tuple[bool, str] | None) -> None:
    refusal = coding_refusal(headers(*(("Content-Encoding", value) for value in values)))
    assert (None if refusal is None else (refusal.compressed, refusal.code)) == refused


def test_a_refusal_never_quotes_the_senders_bytes() -> None:
    refusal = coding_refusal(headers(("Content-Encoding", "secret-words")))
    assert refusal is not None and "secret" not in refusal.message


# The server: a small application behind EdgeRunner.

async def echo(request: web.Request) -> web.Response:
    """The body as the handler receives it: its length and digest."""
    body = await request.read()
    return web.json_response({"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()})


async def ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def slow(request: web.Request) -> web.Response:
    await asyncio.sleep(HEAD_S * 2)
    return web.Response(text="done")


@pytest.fixture
async def edge() -> AsyncIterator[int]:
    """The port of an EdgeRunner with a head deadline of HEAD_S."""
    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_get("/slow", slow)
    app.router.add_get("/ok", ok)
    runner = EdgeRunner(app, HEAD_S)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield runner.addresses[0][1]
    await runner.cleanup()


GET = b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n"
HALF_A_HEAD = b"GET /ok HTTP/1.1\r\nHo"


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response: status, headers (lower-case names), body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status_line, *lines = head.decode().split("\r\n")
    fields = dict((name.strip().lower(), value.strip()) for name, _, value in
                  (line.partition(":") for line in lines if line))
    body = await asyncio.wait_for(reader.readexactly(int(fields.get("content-length", "0"))), 10)
    return int(status_line.split()[1]), fields, body


async def seconds_until_closed(reader: asyncio.StreamReader, limit_s: float) -> float:
    """How long until the server closes the connection (without a byte); fails if it is still open at limit_s."""
    started = time.monotonic()
    assert await asyncio.wait_for(reader.read(), limit_s) == b""
    return time.monotonic() - started


async def test_a_stalled_head_is_closed_at_the_deadline(edge: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", edge)
    writer.write(HALF_A_HEAD)
    assert HEAD_S * 0.9 <= await seconds_until_closed(reader, HEAD_S + SLACK_S)
    writer.close()


async def test_a_head_trickled_a_byte_at_a_time_is_as_late(edge: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", edge)

    async def trickle() -> None:
        for byte in GET[:-2]:
            writer.write(bytes([byte]))
            await asyncio.sleep(HEAD_S / 5)

    trickling = asyncio.create_task(trickle())
    try:
        assert HEAD_S * 0.9 <= await seconds_until_closed(reader, HEAD_S + SLACK_S)
    finally:
        trickling.cancel()
        writer.close()


async def test_a_connection_sending_nothing_is_closed_at_the_deadline(edge: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", edge)
    assert HEAD_S * 0.9 <= await seconds_until_closed(reader, HEAD_S + SLACK_S)
    writer.close()


async def test_an_idle_keep_alive_connection_stays_and_its_next_head_has_the_deadline(edge: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", edge)
    writer.write(GET)
    assert (await answer(reader))[0] == 200
    await asyncio.sleep(HEAD_S * 3)  # idle between requests: the keep-alive timeout's, not the head deadline's
    writer.write(GET)
    assert (await answer(reader))[0] == 200
    await asyncio.sleep(HEAD_S * 3)
    writer.write(HALF_A_HEAD)
    assert HEAD_S * 0.9 <= await seconds_until_closed(reader, HEAD_S + SLACK_S)
    writer.close()


async def test_a_request_taking_longer_than_the_deadline_is_answered(edge: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", edge)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    status, _, body = await answer(reader)
    assert (status, body) == (200, b"done")
    writer.close()


async def test_a_compressed_body_reaches_the_application_as_sent(edge: int) -> None:
    compressed = gzip.compress(b"\0" * 10_000_000)
    async with ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{edge}/echo", data=compressed,
                                headers={"Content-Encoding": "gzip"}) as response:
            assert await response.json() == {"bytes": len(compressed),
                                             "sha256": hashlib.sha256(compressed).hexdigest()}


# The router's application.

async def test_a_compressed_body_is_refused_before_the_key_is_checked(fleet: Fleet) -> None:
    a = fake("a")
    client = await fleet.router([a])
    bomb = gzip.compress(b"\0" * 10_000_000)
    response = await client.post("/v1/chat/completions", data=bomb, headers={"Content-Encoding": "gzip"})
    assert (response.status, await response.json()) == (415, {"error": {
        "message": "compressed request bodies are not accepted (Content-Encoding: gzip): send the body "
                   "uncompressed, without Content-Encoding",
        "type": "invalid_request_error", "param": None, "code": "compressed_body_refused"}})
    response = await client.post("/v1/chat/completions", data=b"{", headers={"Content-Encoding": "rot13"})
    assert (response.status, (await response.json())["error"]["code"]) == (400, "invalid_content_encoding")
    response = await client.post("/v1/chat/completions", data=json.dumps(chat()).encode(), headers={
        "Content-Encoding": "identity", "Authorization": f"Bearer {ALICE_KEY}"})
    assert response.status == 200
    assert len(a.received) == 1


async def test_two_authorization_headers_are_refused(fleet: Fleet) -> None:
    a = fake("a")
    client = await fleet.router([a])
    for pair in ((ALICE_KEY, BOB_KEY), (ALICE_KEY, ALICE_KEY)):
        sent = CIMultiDict([("Authorization", f"Bearer {key}") for key in pair])
        response = await client.post("/v1/chat/completions", data=json.dumps(chat()).encode(), headers=sent)
        body = await response.json()
        assert (response.status, body["error"]["code"]) == (401, "duplicate_authorization")
        assert body["error"]["message"] == ("the request has 2 Authorization headers: send one, "
                                            "'Authorization: Bearer <key>'")
    assert a.received == []


async def test_a_body_slower_than_its_deadline_is_a_408_and_the_connection_closes(fleet: Fleet) -> None:
    a = fake("a")
    client = await fleet.router([a], body_timeout_s=HEAD_S)
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + ALICE_KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"mod")
    started = time.monotonic()
    status, fields, body = await answer(reader)
    assert HEAD_S * 0.9 <= time.monotonic() - started <= HEAD_S + SLACK_S
    assert (status, fields["connection"], json.loads(body)["error"]["code"]) == (408, "close", "body_timeout")
    writer.close()
    assert a.received == []


async def test_the_router_command_listens_through_the_edge(tmp_path: Path) -> None:
    """`tenzro router serve`: the head deadline from its settings, compressed bodies refused, and a clean exit on
    SIGTERM."""
    providers = tmp_path / "providers.yaml"
    providers.write_text(yaml.safe_dump({
        "settings": {"header_timeout_s": HEAD_S, "poll_interval_s": 3600},
        "providers": [{"name": "a", "url": closed_url(), "api_key": "k", "models": ["m"]}],
        "callers": CALLERS}))
    port = free_port()
    process = subprocess.Popen([*TENZRO, "router", "serve", "--providers", str(providers), "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert process.stdout is not None
        while "serving" not in (line := await asyncio.to_thread(process.stdout.readline)):
            assert line, "the router exited"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HALF_A_HEAD)
        assert HEAD_S * 0.9 <= await seconds_until_closed(reader, HEAD_S + SLACK_S)
        writer.close()
        async with ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", data=gzip.compress(b"{}"),
                                    headers={"Content-Encoding": "gzip"}) as response:
                assert response.status == 415
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 10) == 0
    finally:
        process.kill()
        process.wait()
