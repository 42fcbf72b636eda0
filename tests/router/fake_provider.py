"""A provider node as the router sees it over HTTP (the node side's contract), small enough to script: it records
what it receives, serves signed summaries built with cache.summary, and fails on demand."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from cache.summary import BloomFilter, chat_prefix_forms, prefix_entry, summary_key
from metering.canonical import canonical_json
from metering.signer import key_id_for
from policies.requirements import Offer, RequirementHeaderError, requirements_from_headers, unmet

MODEL = "m"
PRICES = {"input": 1_000_000_000, "output": 4_000_000_000, "cached_read": 100_000_000,
          "cached_write": 1_250_000_000}
EPOCH = 7


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class FakeProvider:
    """One node. `mode` scripts its completions: `ok`, `500`, `hang` (nothing before the router's timeout),
    `break` (one SSE chunk, then the connection drops)."""

    name: str
    router_key: str
    prices: dict[str, int] = field(default_factory=lambda: dict(PRICES))
    jurisdiction: str | None = None
    trust_tier: str = "standard"
    evidence_type: str = "none"
    trusted: bool = False
    waiting: int = 0
    running: int = 0
    """Completions it is answering now, as its `/health` reports them to the router."""
    healthy: bool = True
    mode: str = "ok"
    boot_id: str = "boot-1"
    held: dict[str, list[list[dict[str, str]]]] = field(default_factory=dict)
    """Per caller id, the conversations (message lists) whose every prefix this node holds warm."""
    tamper: bool = False
    """Serve summaries whose bytes no longer match their signature."""
    received: list[Received] = field(default_factory=list)
    gate: asyncio.Event | None = None
    """When set, a stream waits on it after its first chunk: the test sees that chunk arrive before the rest."""
    key: Ed25519PrivateKey = field(default_factory=lambda: Ed25519PrivateKey.from_private_bytes(bytes(32)))
    records: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    """(Tenzro-Caller id, completion id) to the record `GET /v1/generation` shows that caller of the router."""

    @property
    def public_key(self) -> bytes:
        return self.key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def node_document(self) -> dict[str, Any]:
        return {"object": "node", "model": MODEL, "boot_id": self.boot_id, "key_id": key_id_for(self.public_key),
                "public_key": self.public_key.hex(),
                "prices": {f"{name}_price_wei": str(value) for name, value in self.prices.items()},
                "policy": {"name": "standard", "jurisdiction": self.jurisdiction, "trust_tier": self.trust_tier},
                "evidence": {"type": self.evidence_type, "trusted": self.trusted, "digest": "00" * 32}}

    def summary_document(self, model: str) -> dict[str, Any]:
        bloom = BloomFilter.sized(64)
        entries = 0
        for caller, conversations in self.held.items():
            key = summary_key(self.router_key, caller, EPOCH)
            for messages in conversations:
                for form in chat_prefix_forms(messages):
                    bloom.add(prefix_entry(key, form))
                    entries += 1
        doc: dict[str, Any] = {"object": "cache.summary", "model": model, "epoch": EPOCH, "epoch_s": 60,
                               "bloom": bloom.to_json(), "entries": entries, "boot_id": self.boot_id,
                               "key_id": key_id_for(self.public_key)}
        doc["signature"] = self.key.sign(canonical_json(doc)).hex()
        if self.tamper:
            doc["entries"] += 1
        return doc

    def offer(self) -> Offer:
        return Offer(self.evidence_type, self.trusted, self.jurisdiction, self.prices)

    def _router_only(self, request: web.Request) -> None:
        if request.headers.get("Authorization") != f"Bearer {self.router_key}":
            raise web.HTTPUnauthorized()

    async def health(self, request: web.Request) -> web.Response:
        if not self.healthy:
            return web.json_response({"status": "unavailable"}, status=503)
        body: dict[str, Any] = {"status": "ok", "model": MODEL}
        if "Authorization" in request.headers:
            self._router_only(request)
            body.update({"waiting": self.waiting, "max_queue": 64, "running": self.running})
        return web.json_response(body)

    async def node(self, request: web.Request) -> web.Response:
        return web.json_response(self.node_document())

    async def summary(self, request: web.Request) -> web.Response:
        self._router_only(request)
        return web.json_response(self.summary_document(request.query["model"]))

    async def generation(self, request: web.Request) -> web.Response:
        self.received.append(Received(request.path_qs, dict(request.headers), b""))
        self._router_only(request)
        record = self.records.get((request.headers.get("Tenzro-Caller", ""), request.query.get("id", "")))
        if record is None:
            return web.json_response({"error": {"message": "no generation with this id for this API key",
                                                "type": "not_found_error", "param": "id",
                                                "code": "generation_not_found"}}, status=404)
        return web.json_response(record)

    async def complete(self, request: web.Request) -> web.StreamResponse:
        self.running += 1
        try:
            return await self._complete(request)
        finally:
            self.running -= 1

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.received.append(Received(request.path, dict(request.headers), await request.read()))
        self._router_only(request)
        try:
            problems = unmet(requirements_from_headers(request.headers), self.offer())
        except RequirementHeaderError as exc:
            return web.json_response({"error": {"message": str(exc), "param": exc.header}}, status=400)
        if problems:
            return web.json_response({"error": {"message": problems[0].message, "type": "invalid_request_error",
                                                "param": problems[0].requirement,
                                                "code": "requirement_not_met"}}, status=412)
        if self.mode == "500":
            return web.json_response({"error": {"message": "model failure", "type": "server_error"}}, status=500)
        if self.mode == "hang":
            await asyncio.sleep(30)
        body = json.loads(self.received[-1].body)
        if not body.get("stream") and self.mode != "break":
            return web.json_response({"object": "chat.completion", "provider": self.name,
                                      "choices": [{"message": {"role": "assistant", "content": "hello"}}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for index, chunk in enumerate(stream_chunks(self.name)):
            await response.write(chunk)
            if index == 0 and self.mode == "break":
                raise ConnectionResetError("the fake node dies mid-answer")
            if index == 0 and self.gate is not None:
                await self.gate.wait()
        await response.write_eof()
        return response

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/node", self.node)
        app.router.add_get("/v1/cache/summary", self.summary)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_get("/v1/generation", self.generation)
        return app


def stream_chunks(name: str) -> list[bytes]:
    """What a fake node streams: three SSE events, then the end."""
    return [f"data: {json.dumps({'provider': name, 'index': index})}\n\n".encode() for index in range(3)] + [
        b"data: [DONE]\n\n"]
