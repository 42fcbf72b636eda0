"""The hostile side of `tenzro bench hostile`: the exact bytes each case sends, and that an exchange hears an
early answer, ends by its deadline, and names what happened when no answer came (against raw asyncio servers)."""

from __future__ import annotations

import asyncio
import json
import zlib
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import pytest

from bench.hostile_load import (
    BIG_INT_DIGITS,
    CASES,
    EMPTY_MESSAGES,
    GZIP_INFLATED_BYTES,
    MAX_BODY_BYTES,
    Exchange,
    Plan,
    Request,
    Tally,
    exchange,
    gzip_bomb,
    hostile_load,
)
from tests.node.conftest import free_port

KEY = "tz-hostile"
PLAN = Plan("rpc", "127.0.0.1", 8000, 1, 1.0, (KEY,), "small")


def _split(request: Request) -> tuple[list[str], bytes]:
    """The head's lines (no blank line at its end) and the body."""
    return request.head.decode().removesuffix("\r\n\r\n").split("\r\n"), request.body


def test_the_gzip_bomb_inflates_to_its_size_from_about_a_thousandth_of_it() -> None:
    bomb = gzip_bomb(16 * 1024 * 1024)
    inflated = zlib.decompress(bomb, 16 + zlib.MAX_WBITS)
    assert inflated == bytes(16 * 1024 * 1024)
    assert len(bomb) < len(inflated) // 1000
    assert GZIP_INFLATED_BYTES == 1024**3


def test_the_gzip_bomb_and_the_false_gzip_are_marked_gzip_and_only_the_false_one_carries_a_key() -> None:
    bomb_lines, bomb_body = _split(CASES["gzip-bomb"].build(Plan("gzip-bomb", "127.0.0.1", 8000, 1, 1.0, (KEY,),
                                                                 "small", b"\x1f\x8bbomb"), KEY))
    assert bomb_lines == ["POST /v1/chat/completions HTTP/1.1", "Host: 127.0.0.1:8000", "Connection: close",
                          "Content-Type: application/json", "Content-Encoding: gzip", "Content-Length: 6"]
    assert bomb_body == b"\x1f\x8bbomb"
    lines, body = _split(CASES["false-gzip"].build(PLAN, KEY))
    assert lines[3:] == ["Content-Type: application/json", "Content-Encoding: gzip", f"Authorization: Bearer {KEY}",
                         f"Content-Length: {len(body)}"]
    assert json.loads(body) == {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_the_empty_messages_body_holds_the_issues_count_within_8_mib() -> None:
    lines, body = _split(CASES["empty-messages"].build(PLAN, KEY))
    assert f"Authorization: Bearer {KEY}" in lines and f"Content-Length: {len(body)}" in lines
    assert len(body) <= MAX_BODY_BYTES
    parsed = json.loads(body)
    assert (len(parsed["messages"]), parsed["max_tokens"]) == (EMPTY_MESSAGES, 4) == (289_255, 4)
    assert set(map(json.dumps, parsed["messages"])) == {'{"role": "user", "content": ""}'}


def test_the_rpc_call_is_exactly_8_mib_of_zeros_with_no_key() -> None:
    lines, body = _split(CASES["rpc"].build(PLAN, KEY))
    assert lines[0] == "POST /rpc HTTP/1.1" and not any(line.startswith("Authorization") for line in lines)
    assert len(body) == MAX_BODY_BYTES == 8 * 1024 * 1024
    call = json.loads(body)
    assert (call["method"], call["id"], set(call["params"][0])) == ("tenzro_getAttestation", 1, {0})
    assert len(call["params"][0]) > 4_000_000


def test_the_big_int_body_is_over_a_mib_and_the_standard_json_refuses_it() -> None:
    lines, body = _split(CASES["big-ints"].build(PLAN, KEY))
    assert f"Authorization: Bearer {KEY}" in lines
    assert 1024 * 1024 < len(body) and body.endswith(b'"max_tokens":' + b"9" * BIG_INT_DIGITS + b"}")
    with pytest.raises(ValueError, match="4300 digits"):
        json.loads(body)


def test_two_authorizations_slowloris_and_the_slow_body_heads() -> None:
    assert _split(CASES["two-auth"].build(PLAN, KEY))[0] == [
        "GET /v1/models HTTP/1.1", "Host: 127.0.0.1:8000", "Connection: close", f"Authorization: Bearer {KEY}",
        "Authorization: Bearer sk-not-this-one"]
    assert CASES["slowloris"].build(PLAN, KEY) == Request(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nX-Slow: ")
    slow = CASES["slow-body"].build(PLAN, KEY)
    assert (len(slow.body), slow.trickle) == (1024 * 1024, 64)
    assert slow.head.endswith(f"Authorization: Bearer {KEY}\r\nContent-Length: {1024 * 1024}\r\n\r\n".encode())
    ipv6 = CASES["slowloris"].build(Plan("slowloris", "::1", 8000, 1, 1.0, (), "small"), "")
    assert ipv6.head == b"GET /health HTTP/1.1\r\nHost: [::1]:8000\r\nX-Slow: "


Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextmanager
def _no_warning_of_unretrieved_tasks(loop: asyncio.AbstractEventLoop) -> Iterator[list[str]]:
    errors: list[str] = []
    loop.set_exception_handler(lambda _, context: errors.append(str(context.get("message"))))
    yield errors
    loop.set_exception_handler(None)


async def _exchange_with(serve: Serve, request: Request, within_s: float) -> Exchange:
    """An exchange with a server that runs `serve` on each connection and then aborts it."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await serve(reader, writer)
        finally:
            writer.transport.abort()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    with _no_warning_of_unretrieved_tasks(loop) as errors:
        async with server:
            done = await exchange("127.0.0.1", port, request, loop.time() + within_s)
    assert errors == []
    return done


BIG = Request(b"POST / HTTP/1.1\r\nContent-Length: 67108864\r\n\r\n", bytes(64 * 1024 * 1024))


async def _answer_early(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 415 Unsupported Media Type\r\nContent-Length: 0\r\n\r\n")
    await writer.drain()


async def _stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(30)


async def _close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")


async def _garble(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"SSH-2.0-OpenSSH\r\n")
    await writer.drain()


async def test_an_answer_before_the_body_is_read_is_heard_and_the_rest_is_not_sent() -> None:
    done = await _exchange_with(_answer_early, BIG, 10.0)
    assert done.outcome == "415" and done.seconds < 5.0


async def test_an_exchange_the_server_holds_is_open_at_the_deadline() -> None:
    done = await _exchange_with(_stall, Request(b"GET / HTTP/1.1\r\nX-Slow: "), 0.3)
    assert done.outcome == "open" and 0.3 <= done.seconds < 2.0


async def test_a_close_without_an_answer_and_a_line_that_is_not_http_are_named() -> None:
    assert (await _exchange_with(_close, Request(b"GET / HTTP/1.1\r\n\r\n"), 5.0)).outcome == "closed"
    assert (await _exchange_with(_garble, Request(b"GET / HTTP/1.1\r\n\r\n"), 5.0)).outcome == "garbled"


async def test_a_trickled_body_goes_a_piece_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("bench.hostile_load.TRICKLE_S", 0.05)

    received = 0

    async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal received
        await reader.readuntil(b"\r\n\r\n")
        while chunk := await reader.read(1000):
            received += len(chunk)

    done = await _exchange_with(count, Request(b"POST / HTTP/1.1\r\n\r\n", bytes(1000), 10), 0.3)
    assert done.outcome == "open"
    assert 10 <= received <= 80  # a piece every 0.05 s for 0.3 s, not the 1000 bytes


async def test_nothing_listening_is_refused_and_the_load_stops_by_itself() -> None:
    port = free_port()
    assert (await exchange("127.0.0.1", port, Request(b"GET / HTTP/1.1\r\n\r\n"), 1e12)).outcome == "refused"
    loop = asyncio.get_running_loop()
    started = loop.time()
    tally = await hostile_load(Plan("two-auth", "127.0.0.1", port, 2, 0.35, (KEY,), "small"))
    assert 0.35 <= loop.time() - started < 2.0
    assert set(tally.outcomes) == {"refused"} and 2 * 2 <= tally.outcomes["refused"] <= 2 * 5
    assert tally.answer_ms == []


def test_a_tally_times_the_answered_exchanges_only() -> None:
    tally = Tally()
    for outcome, seconds in (("400", 0.01), ("open", 5.0), ("400", 0.03), ("reset", 0.2)):
        tally.add(Exchange(outcome, seconds))
    assert tally.outcomes == {"400": 2, "open": 1, "reset": 1}
    assert tally.answer_ms == [10.0, 30.0]
