"""Forwarding one request to one provider: until the provider's first byte the request can still go elsewhere,
after it nothing can.

The router holds back the client's response until the provider has sent its status, its headers and the first
bytes of its body. A provider that fails before then (no connection, a timeout, a status that is its own fault
rather than the request's) leaves nothing sent to the client, and the request moves to the next provider. Once
the first bytes go out the answer is this provider's: the rest is passed through as it arrives (an SSE stream
chunk by chunk), and if the provider breaks off, the client's connection is dropped too, so that a truncated
answer never looks complete and no request is answered twice.

What each failing status means for the provider (FAILURE_STATUSES): 500, 502 and 504 say it is broken, and
401 and 403 that it refuses the router's key (the providers file needs fixing), so it is marked down until a
poll finds it answering; 503 and 429 are load, and 412 says its offer changed since the last poll (the node
enforces the forwarded requirements itself), so it is polled again. Other statuses (400, 404, 413) are the
request's fault and pass to the client as they are.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from policies.requirements import CONFIDENTIAL_HEADER, JURISDICTIONS_HEADER, MAX_PRICE_HEADER, CallerRequirements
from router.providers import ProviderSpec, RouterSettings
from router.registry import Registry

PROVIDER_HEADER = "Tenzro-Provider"
CALLER_HEADER = "Tenzro-Caller"
PASSED_HEADERS = ("Content-Type", "Cache-Control", "Retry-After")
"""The provider's response headers a client receives; the rest describe the hop, not the answer."""
MAX_ERROR_BYTES = 64 * 1024
"""The most of a failed provider's error body kept, to pass on if no other provider answers."""


@dataclass(frozen=True, slots=True)
class Verdict:
    mark_down: bool
    refresh: bool


FAILURE_STATUSES = {
    500: Verdict(mark_down=True, refresh=False),
    502: Verdict(mark_down=True, refresh=False),
    504: Verdict(mark_down=True, refresh=False),
    401: Verdict(mark_down=True, refresh=False),
    403: Verdict(mark_down=True, refresh=False),
    503: Verdict(mark_down=False, refresh=False),
    429: Verdict(mark_down=False, refresh=False),
    412: Verdict(mark_down=False, refresh=True),
}


@dataclass(frozen=True, slots=True)
class ErrorAnswer:
    """A failed provider's own answer, passed to the client when no other provider answers instead."""

    status: int
    headers: Mapping[str, str]
    body: bytes


@dataclass(frozen=True, slots=True)
class Forwarded:
    """The request as it goes to every provider tried; each attempt adds that provider's key."""

    path: str
    body: bytes
    headers: Mapping[str, str]
    """Content-Type, Tenzro-Caller and the merged requirement headers; never the client's Authorization."""
    model: str


class ProviderFailed(Exception):
    """A provider failed before anything reached the client: the request may go elsewhere."""

    def __init__(self, provider: str, problem: str, answer: ErrorAnswer | None = None) -> None:
        super().__init__(f"{provider}: {problem}")
        self.provider = provider
        self.problem = problem
        self.answer = answer


class ProviderBroke(ConnectionError):
    """A provider broke off after its first bytes reached the client: the client's connection is dropped."""


def requirement_headers(requirements: CallerRequirements) -> dict[str, str]:
    """The merged requirements as the headers a node reads them from, so that the node enforces them with its
    real offer whatever the router last heard of it."""
    headers = {}
    if requirements.confidential_hardware:
        headers[CONFIDENTIAL_HEADER] = "true"
    if requirements.jurisdictions is not None:
        headers[JURISDICTIONS_HEADER] = ",".join(sorted(requirements.jurisdictions))
    if requirements.max_price_wei:
        headers[MAX_PRICE_HEADER] = ",".join(f"{name}={ceiling}" for name, ceiling in
                                             requirements.max_price_wei.items())
    return headers


def _passed_headers(upstream: aiohttp.ClientResponse, provider: str) -> dict[str, str]:
    headers = {name: upstream.headers[name] for name in PASSED_HEADERS if name in upstream.headers}
    headers[PROVIDER_HEADER] = provider
    return headers


async def _open(session: aiohttp.ClientSession, spec: ProviderSpec, forwarded: Forwarded,
                settings: RouterSettings, pin: aiohttp.Fingerprint | bool) -> tuple[aiohttp.ClientResponse, bytes]:
    """The provider's response and its first body bytes (empty for an empty body); raises ProviderFailed."""
    headers = {**forwarded.headers, "Authorization": f"Bearer {spec.api_key}", "Accept-Encoding": "identity"}
    timeout = aiohttp.ClientTimeout(sock_connect=settings.connect_timeout_s, sock_read=settings.first_byte_timeout_s)
    upstream = None
    try:
        async with asyncio.timeout(settings.first_byte_timeout_s):
            upstream = await session.post(spec.url + forwarded.path, data=forwarded.body, headers=headers,
                                          timeout=timeout, ssl=pin)
            if upstream.status in FAILURE_STATUSES:
                body = b""
                while len(body) < MAX_ERROR_BYTES and (chunk := await upstream.content.read(MAX_ERROR_BYTES
                                                                                            - len(body))):
                    body += chunk
                raise ProviderFailed(spec.name, f"answered {upstream.status}",
                                     ErrorAnswer(upstream.status, _passed_headers(upstream, spec.name), body))
            return upstream, await upstream.content.readany()
    except BaseException as exc:  # a client gone away (cancelled) too: the provider's connection closes with it
        if upstream is not None:
            upstream.close()
        if isinstance(exc, aiohttp.ClientError | TimeoutError | OSError):
            raise ProviderFailed(spec.name, f"no answer: {type(exc).__name__}") from exc
        raise


def _last(chunk: bytes, relayed: int, upstream: aiohttp.ClientResponse) -> bool:
    """Whether `chunk` ends the answer: a stream's `[DONE]` event, or a whole answer's last bytes."""
    if upstream.content_length is not None:
        return relayed + len(chunk) >= upstream.content_length
    return b"data: [DONE]" in chunk


async def forward(registry: Registry, session: aiohttp.ClientSession, spec: ProviderSpec, forwarded: Forwarded,
                  settings: RouterSettings, client: web.Request) -> web.StreamResponse:
    """Send the request to one provider and relay its answer to the client. Raises ProviderFailed (nothing sent
    to the client; the provider marked down or polled again as its failure says), or ProviderBroke. The request
    counts as the provider's load until this returns or raises (`Registry.in_flight`)."""
    with registry.in_flight(spec.name):
        return await _relay(registry, session, spec, forwarded, settings, client)


async def _relay(registry: Registry, session: aiohttp.ClientSession, spec: ProviderSpec, forwarded: Forwarded,
                 settings: RouterSettings, client: web.Request) -> web.StreamResponse:
    started = time.monotonic()
    try:
        upstream, first = await _open(session, spec, forwarded, settings, registry.pin(spec.name))
    except ProviderFailed as failure:
        verdict = FAILURE_STATUSES.get(failure.answer.status if failure.answer else 0, Verdict(True, False))
        if verdict.mark_down:
            registry.mark_down(spec.name, failure.problem)
        if verdict.refresh:
            registry.refresh(spec.name)
        raise
    registry.observe_latency(spec.name, time.monotonic() - started)
    try:
        response = web.StreamResponse(status=upstream.status, headers=_passed_headers(upstream, spec.name))
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        await response.prepare(client)
        chunk, relayed = first, 0
        while chunk:
            if upstream.status == 200 and _last(chunk, relayed, upstream):
                # The node stored this answer's state before sending its end: the summary that says so reaches
                # this router before the caller, whose next turn then finds it warm.
                await registry.refresh_summary(spec.name, forwarded.model)
            await response.write(chunk)
            relayed += len(chunk)
            try:
                chunk = await upstream.content.readany()
            except (aiohttp.ClientError, TimeoutError) as exc:
                registry.mark_down(spec.name, f"broke off mid-answer: {type(exc).__name__}")
                raise ProviderBroke(f"provider {spec.name} broke off mid-answer; the client's connection is "
                                    f"dropped") from exc
        await response.write_eof()
        return response
    finally:
        upstream.close()
