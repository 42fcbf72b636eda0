"""`tenzro proxy`: an OpenAI-compatible endpoint on localhost that forwards only to a node it has verified.

An application keeps its official OpenAI client and points it at the proxy (`base_url=http://127.0.0.1:8089/v1`);
the proxy verifies the node first (`client.verify`: hardware, code, model and the channel, under the caller's trust
policy) and forwards each request over a connection pinned to the certificate it verified, streaming the answer
back as it comes. It fails closed: a node that does not verify, or a request it cannot send over the verified
channel, gets the application a 503 with the reason (`node_not_verified`), never an answer from an unverified node.

It verifies again every `reverify_s`, and at once when the pinned connection fails: a node that restarted has a
new TLS key, so the handshake to it fails the pin before a byte of the request is sent; the proxy then verifies
the new node and, if it passes, sends the request to it (once). The caller's API key passes through to the node; the
proxy holds none of its own and logs no request content.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from attestation.trust_policy import TrustPolicy
from client.verify import NodeRefused, VerifiedNode, verify_node

log = logging.getLogger("tenzro.proxy")
REVERIFY_S = 300.0
FORWARDED_HEADERS = ("Authorization", "Content-Type", "Accept")
"""What of the application's request the node sees, besides the node's own `Tenzro-*` requirement headers."""
HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"})


@dataclass
class Verifier:
    """The node's verification, shared by every request; one verification runs at a time."""

    url: str
    policy: TrustPolicy
    allow_none: bool
    reverify_s: float = REVERIFY_S
    verify: Callable[[str, TrustPolicy, bool], Awaitable[VerifiedNode]] = field(
        default=lambda url, policy, allow_none: verify_node(url, policy, allow_none))
    node: VerifiedNode | None = None
    verified_at: float = 0.0
    refused: list[str] = field(default_factory=list)
    """Why the last verification failed (empty when it passed)."""
    verifications: int = 0
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def current(self, stale: VerifiedNode | None = None) -> VerifiedNode:
        """The verified node, verifying again when there is none, it is older than `reverify_s`, or it is `stale`
        (its pinned channel failed); raises NodeRefused."""
        async with self._lock:
            node = self.node
            if node is None or node is stale or time.monotonic() - self.verified_at > self.reverify_s:
                self.node = None
                self.verifications += 1
                try:
                    node = await self.verify(self.url, self.policy, self.allow_none)
                except NodeRefused as exc:
                    self.refused = exc.lines
                    log.warning("the node at %s did not verify: %s", self.url, "; ".join(exc.lines))
                    raise
                self.node, self.verified_at, self.refused = node, time.monotonic(), []
                log.info("verified the node at %s: key %s, tls spki %s", self.url, node.result.public_key_hex,
                         node.channel.spki_sha256.hex())
            return node


VERIFIER = web.AppKey("verifier", Verifier)
SESSION = web.AppKey("session", aiohttp.ClientSession)


def _refusal(lines: list[str]) -> web.Response:
    message = "the node did not verify, so nothing was sent to it: " + " ".join(line.strip() for line in lines)
    return web.json_response({"error": {"message": message, "type": "service_unavailable",
                                        "param": None, "code": "node_not_verified"}}, status=503)


async def forward(request: web.Request) -> web.StreamResponse:
    verifier, session = request.app[VERIFIER], request.app[SESSION]
    body = await request.read()
    headers = {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}
    headers.update({name: value for name, value in request.headers.items() if name.lower().startswith("tenzro-")})
    stale: VerifiedNode | None = None
    for _ in range(2):  # the second time after verifying a node whose pinned channel failed the first
        try:
            node = await verifier.current(stale)
        except NodeRefused as exc:
            return _refusal(exc.lines)
        try:
            upstream = await session.request(request.method, node.channel.url + request.rel_url.path_qs,
                                             data=body, headers=headers, ssl=node.channel.pin())
        except (aiohttp.ServerFingerprintMismatch, aiohttp.ClientConnectorError) as exc:
            # Nothing of the request was sent: the handshake failed the pin, or there was no connection.
            log.warning("the pinned channel to %s failed (%s); verifying again", verifier.url, type(exc).__name__)
            stale = node
            continue
        except aiohttp.ClientError as exc:
            return _refusal([f"the request to the verified node failed: {type(exc).__name__}"])
        try:
            response = web.StreamResponse(status=upstream.status, headers={
                name: value for name, value in upstream.headers.items() if name.lower() not in HOP_BY_HOP})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
        finally:
            upstream.release()
    return _refusal(verifier.refused or ["the node's channel failed again after it verified"])


async def health(request: web.Request) -> web.Response:
    """Whether the proxy holds a verified node now (it does not verify to answer)."""
    verifier = request.app[VERIFIER]
    verified = verifier.node is not None
    return web.json_response({"status": "ok" if verified else "unverified", "node": verifier.url,
                              "refused": verifier.refused}, status=200 if verified else 503)


def create_app(verifier: Verifier) -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    app[VERIFIER] = verifier

    async def session_context(app: web.Application) -> AsyncIterator[None]:
        app[SESSION] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        try:
            await verifier.current()  # at start: a refusal is logged and answered per request
        except NodeRefused:
            pass
        yield
        await app[SESSION].close()

    app.cleanup_ctx.append(session_context)
    app.router.add_get("/proxy/health", health)
    app.router.add_route("*", "/v1/{tail:.*}", forward)
    return app
