"""The HTTP edge the router and the node both listen through: request bodies are never inflated, and a connection
must send each request's head in time.

Here because the router may not import the node (tests/test_layering.py) while the node may import the router:
`node/cli.py` serves the node with `serve`, and `node/api/middleware.py` refuses compressed bodies with
`coding_refusal`, as `router/app.py` does.

- **No inflation.** aiohttp inflates a gzip, deflate or brotli body as it arrives, on the event loop, before any
  handler or key check runs: a 1 MB body can inflate to a gigabyte. No route of either server needs a compressed
  body, so the server is built without it (`auto_decompress=False`) and each application refuses any
  `Content-Encoding` other than `identity` before reading the body or checking a key (`coding_refusal`).
- **Head deadline.** aiohttp has a keep-alive timeout but no limit on how long a request's head (its request line
  and headers) may take to arrive: a client sending half a line held its connection until the keep-alive timeout
  (slowloris). `HeadDeadline` closes a connection whose head is late; the body's deadline is kept where bodies
  are read (`node/api/body.py`, `router/app.py`), since only the handler knows whether it reads one.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from multidict import CIMultiDictProxy

log = logging.getLogger(__name__)

COMPRESSIONS = frozenset({"gzip", "x-gzip", "deflate", "br", "zstd", "compress", "x-compress"})
"""The registered content codings that compress (RFC 9110 section 8.4.1, IANA's registry): refused with 415, as a
body the servers could read but will not inflate. Any other coding but `identity` is not one at all: 400."""
KEEPALIVE_TIMEOUT_S = 75.0
"""How long an idle keep-alive connection stays open: `web.run_app`'s default, which both servers ran with before.
Longer than the idle expiry of the clients' pools (aiohttp's 15 s, httpx's 5 s), so that a server never closes a
pooled connection just as a request is sent on it; a stalled head is `HeadDeadline`'s to close, not this."""


@dataclass(frozen=True, slots=True)
class CodingRefusal:
    """Why a request's `Content-Encoding` is refused; each server maps `compressed` to its own error (415, else
    400)."""

    compressed: bool
    """The body names a compression (`COMPRESSIONS`); otherwise it names no coding this server knows."""
    message: str
    code: str


def coding_refusal(headers: CIMultiDictProxy[str]) -> CodingRefusal | None:
    """None when the body comes as is (no `Content-Encoding`, or only `identity`). The header's value is never
    quoted back: it is the sender's bytes."""
    values = headers.getall("Content-Encoding", [])
    if not values:
        return None
    codings = [coding.strip().lower() for value in values for coding in value.split(",")]
    compressed = sorted(set(codings) & COMPRESSIONS)
    if compressed:
        return CodingRefusal(True, f"compressed request bodies are not accepted (Content-Encoding: "
                                   f"{', '.join(compressed)}): send the body uncompressed, without Content-Encoding",
                             "compressed_body_refused")
    if any(coding != "identity" for coding in codings):
        return CodingRefusal(False, "Content-Encoding names no coding this server knows: send the body as is, "
                                    "without Content-Encoding", "invalid_content_encoding")
    return None


class HeadDeadline(web.RequestHandler):
    """A connection that must send each request's head within `head_timeout_s`: counted from the connection's
    opening for its first request, and from the first byte of each later one, so that an idle keep-alive
    connection is the keep-alive timeout's to close. Bytes arriving do not move the deadline (a head trickled a
    byte at a time is as late as one never sent); a late head's connection is closed without an answer, as there
    is no request to answer yet. A partial head sent right behind a whole request (pipelined) arrives before its
    predecessor is answered and is left to the keep-alive timeout."""

    __slots__ = ("_head_timeout_s", "_head_timer")

    def __init__(self, manager: web.Server, *, head_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        heads = self._request_count  # aiohttp counts each request whose head the parser completed
        super().data_received(data)
        if self._request_count != heads:
            self._disarm()
        elif data and self._head_timer is None and self._waiting():
            self._arm()

    def _waiting(self) -> bool:
        """No request is being handled: bytes arriving now begin the next one's head."""
        return self._waiter is not None and not self._waiter.done()

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self._loop.call_later(self._head_timeout_s, self._head_late, self._request_count)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self, heads: int) -> None:
        self._head_timer = None
        if self._request_count == heads and not self._force_close:
            log.info("closed a connection whose request head did not arrive within %.0f s", self._head_timeout_s)
            self.force_close()


class _HeadDeadlineServer(web.Server):
    """The application's server, with a `HeadDeadline` for each connection."""

    def __init__(self, plain: web.Server, head_timeout_s: float) -> None:
        super().__init__(plain.request_handler, request_factory=plain.request_factory,
                         handler_cancellation=plain.handler_cancellation, loop=plain._loop, **plain._kwargs)
        self._head_timeout_s = head_timeout_s

    def __call__(self) -> HeadDeadline:
        return HeadDeadline(self, loop=self._loop, head_timeout_s=self._head_timeout_s, **self._kwargs)


class EdgeRunner(web.AppRunner):
    """An AppRunner whose server inflates nothing and gives each connection a head deadline. A client that goes
    away cancels its handler (`handler_cancellation`), which stops the generation it waits for; no access log
    (a path can carry a record id)."""

    __slots__ = ("_head_timeout_s",)

    def __init__(self, app: web.Application, head_timeout_s: float, *, handle_signals: bool = False) -> None:
        super().__init__(app, handle_signals=handle_signals, access_log=None, handler_cancellation=True,
                         keepalive_timeout=KEEPALIVE_TIMEOUT_S, auto_decompress=False)
        self._head_timeout_s = head_timeout_s

    async def _make_server(self) -> web.Server:
        return _HeadDeadlineServer(await super()._make_server(), self._head_timeout_s)


async def _serve(app: web.Application, host: str, port: int, head_timeout_s: float,
                 started: Callable[[], None], ssl_context: ssl.SSLContext | None) -> None:
    runner = EdgeRunner(app, head_timeout_s, handle_signals=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
        started()
        await asyncio.Event().wait()  # until SIGINT or SIGTERM
    finally:
        await runner.cleanup()


async def read_within(request: web.Request, seconds: float) -> bytes:
    """The request's body, or TimeoutError when it has not all arrived within `seconds`: a client trickling its
    body would otherwise hold its connection and its buffer for as long as it liked."""
    async with asyncio.timeout(seconds):
        return await request.read()


def serve(app: web.Application, host: str, port: int, head_timeout_s: float, started: Callable[[], None],
          ssl_context: ssl.SSLContext | None = None) -> None:
    """Serve `app` on host:port (HTTPS with `ssl_context`: the node's `--tls`) until SIGINT or SIGTERM, calling
    `started` once it listens; `web.run_app`'s life cycle (which cannot be given a runner): on a signal the
    runner's cleanup runs first (requests in flight end, then the application's cleanup contexts), then whatever
    tasks are left are cancelled. An error at start (the port taken, a cleanup context failing) is raised."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    main = loop.create_task(_serve(app, host, port, head_timeout_s, started, ssl_context))
    try:
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        try:
            if not main.done():
                main.cancel()
                with suppress(asyncio.CancelledError):
                    loop.run_until_complete(main)
        finally:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
