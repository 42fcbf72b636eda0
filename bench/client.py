"""The HTTP client every benchmark and audit drives a server with: one pooled session, the caller's key,
streamed completions timed to their first token, plain JSON requests. Every failure is a BenchError that
names the request."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp

REQUEST_TIMEOUT_S = 900.0
"""One whole request, stream included: long enough for a cold prefill of the longest prompt on one thread."""

Messages = list[dict[str, str]]


class BenchError(RuntimeError):
    """The benchmark cannot run as asked, or a server answered wrongly; the message says which."""


def api_base(url: str) -> str:
    """The base that `/completions` and `/models` hang from, whether or not `url` ends in /v1."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def add_server_arguments(parser: argparse.ArgumentParser, model_default: str | None, model_help: str) -> None:
    """The server a benchmark measures (--url, --api-key) or the local node it starts instead (--threads,
    --device), and the model (--model)."""
    parser.add_argument("--url", help="an OpenAI-compatible base URL to measure instead of a local node")
    parser.add_argument("--model", default=model_default, help=model_help)
    parser.add_argument("--api-key", default=os.environ.get("TENZRO_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                        help="the caller's key at --url (default: $TENZRO_API_KEY, else $OPENAI_API_KEY)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the local node")
    parser.add_argument("--device", help="device of the local node (default: cuda when present)")


KEEPALIVE_S = 4.0
"""How long an idle pooled connection is reused: under uvicorn's 5 s (vLLM, SGLang), which closes it then, and a
request sent on a connection the server is closing fails with "Server disconnected"."""


def open_session() -> aiohttp.ClientSession:
    """The one session a run pools its connections in."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
                                 connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S))


@dataclass(frozen=True, slots=True)
class Timing:
    ttft_s: float
    prompt_tokens: int | None
    cached_tokens: int | None
    """usage.prompt_tokens_details.cached_tokens; None when the server reports no usage."""


@dataclass(frozen=True, slots=True)
class Streamed:
    """One streamed completion as the client saw it."""

    ttft_s: float
    text: str
    usage: dict[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)
    """The response's headers (a router's `Tenzro-Provider` says which node served)."""
    arrivals_s: tuple[float, ...] = ()
    """When each event carrying text arrived, in seconds from sending the request."""
    prompt_ids: tuple[int, ...] | None = None
    """The prompt's token ids as the server computed them, when asked for (`return_token_ids`)."""

    def timing(self) -> Timing:
        details = self.usage.get("prompt_tokens_details") or {}
        return Timing(self.ttft_s, self.usage.get("prompt_tokens"), details.get("cached_tokens"))


class Client:
    """One caller of one model at an OpenAI-compatible server; greedy requests over a shared session."""

    def __init__(self, session: aiohttp.ClientSession, base: str, api_key: str | None, model: str = "",
                 pin: aiohttp.Fingerprint | None = None) -> None:
        self.session = session
        self.base = base
        """Ends in /v1."""
        self.headers = _bearer(api_key)
        self.model = model
        self.ssl: aiohttp.Fingerprint | bool = pin or True
        """An https server's certificate, pinned (a node's `--tls`), or the default verification."""

    @classmethod
    async def connect(cls, session: aiohttp.ClientSession, url: str, api_key: str | None,
                      model: str | None = None, pin: aiohttp.Fingerprint | None = None) -> Client:
        """A client of `model`, or of the first model the server lists."""
        client = cls(session, api_base(url), api_key, pin=pin)
        client.model = model or (await client.models())[0]
        return client

    @asynccontextmanager
    async def _request(self, method: str, url: str, headers: dict[str, str] | None = None,
                       **kwargs: Any) -> AsyncIterator[aiohttp.ClientResponse]:
        """A response with status 200; a transport failure (while reading it too) or any other status raises."""
        try:
            async with self.session.request(method, url, headers=self.headers if headers is None else headers,
                                            ssl=self.ssl, **kwargs) as response:
                if response.status != 200:
                    raise BenchError(f"{method} {url} answered {response.status}: {await response.text()}")
                yield response
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BenchError(f"{method} {url}: {str(exc) or type(exc).__name__}") from exc

    async def models(self) -> list[str]:
        """The model ids the server lists, in its order; at least one."""
        async with self._request("GET", self.base + "/models") as response:
            models = [str(model["id"]) for model in (await response.json()).get("data") or []]
        if not models:
            raise BenchError(f"GET {self.base}/models lists no model; pass --model")
        return models

    async def node_state(self, operator_key: str) -> dict[str, Any]:
        """`GET /v1/node/state` (an operator's key): how a tenzro node runs now, its engine counters, queue and
        what its stored state's tiers hold."""
        async with self._request("GET", self.base + "/node/state", headers=_bearer(operator_key)) as response:
            return dict(await response.json())

    async def metrics(self, operator_key: str) -> dict[str, float]:
        """`GET /metrics` (Prometheus text, an operator's key) as {series: value}."""
        async with self._request("GET", self.base.removesuffix("/v1") + "/metrics",
                                 headers=_bearer(operator_key)) as response:
            text = await response.text()
        series = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        return {name: float(value) for name, value in series}

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A request that is not streamed: the answer's JSON."""
        async with self._request("POST", self.base + path, json=body) as response:
            return dict(await response.json())

    async def stream(self, path: str, body: dict[str, Any]) -> Streamed:
        """POST a streamed request to `path`. TTFT: to the first event carrying generated text or a finish
        reason (a chat stream opens with a role chunk sent before anything is computed). A stream that ends
        without [DONE] raises."""
        ttft: float | None = None
        parts: list[str] = []
        arrivals: list[float] = []
        usage: dict[str, Any] = {}
        prompt_ids: tuple[int, ...] | None = None
        done = False
        started = time.perf_counter()
        async with self._request("POST", self.base + path, json=body) as response:
            headers = dict(response.headers)
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                arrived = time.perf_counter() - started
                data = line[len(b"data:"):].strip().decode()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    event = json.loads(data)
                except ValueError as exc:
                    raise BenchError(f"the server streamed a non-JSON event: {data[:200]!r}") from exc
                if "error" in event:
                    raise BenchError(f"the server failed a request mid-stream: {event['error']}")
                for choice in event.get("choices") or []:
                    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if ttft is None and (text or choice.get("finish_reason") or "text" in choice):
                        ttft = arrived
                    if text:
                        parts.append(text)
                        arrivals.append(arrived)
                usage = event.get("usage") or usage
                # vLLM sends the prompt's ids on its first chunk and null on the rest; this node on its last.
                if event.get("prompt_token_ids") is not None:
                    prompt_ids = tuple(int(t) for t in event["prompt_token_ids"])
        if not done:
            raise BenchError(f"POST {self.base}{path}: the stream ended before [DONE]")
        if ttft is None:
            raise BenchError(f"POST {self.base}{path} streamed no generated text")
        return Streamed(ttft, "".join(parts), usage, headers, tuple(arrivals), prompt_ids)

    def _greedy(self, max_tokens: int) -> dict[str, Any]:
        return {"model": self.model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}

    async def complete(self, prompt: list[int]) -> Timing:
        """A text completion of one token on token ids: its TTFT and usage."""
        return (await self.stream("/completions", {**self._greedy(1), "prompt": prompt})).timing()

    async def chat(self, messages: Messages, max_tokens: int = 1, token_ids: bool = False) -> Streamed:
        """A streamed chat completion; `token_ids`: ask for the prompt's ids as the server computed them (this
        node's and vLLM's `return_token_ids`)."""
        body = {**self._greedy(max_tokens), "messages": messages}
        return await self.stream("/chat/completions", {**body, "return_token_ids": True} if token_ids else body)


def _bearer(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
