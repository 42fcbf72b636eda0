"""Routers in-process (aiohttp_client) over fake provider nodes (aiohttp test servers)."""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from router.app import create_app
from router.callers import hash_key
from router.providers import RouterConfig, parse_router_config
from tests.router.fake_provider import MODEL, FakeProvider

ALICE_KEY = "tz-alice-key"
BOB_KEY = "tz-bob-key"
CAROL_KEY = "tz-carol-key"
CALLERS = {
    "alice": {"key_sha256": hash_key(ALICE_KEY)},
    "bob": {"key_sha256": hash_key(BOB_KEY), "requirements": {"jurisdictions": ["DE"]}},
    "carol": {"key_sha256": hash_key(CAROL_KEY)},
}
SETTINGS = {"poll_interval_s": 3600, "connect_timeout_s": 2, "first_byte_timeout_s": 0.5}
"""Polls happen only when a test asks for them; a provider silent for half a second is given up on."""


def router_key(name: str) -> str:
    return f"router-key-at-{name}"


def fake(name: str, **fields: Any) -> FakeProvider:
    return FakeProvider(name, router_key(name), **fields)


def closed_url() -> str:
    """A URL nothing listens on: connections are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def config_for(urls: dict[str, str], **settings: Any) -> RouterConfig:
    return parse_router_config({
        "settings": {**SETTINGS, **settings},
        "providers": [{"name": name, "url": url, "api_key": router_key(name), "models": [MODEL]}
                      for name, url in urls.items()],
        "callers": CALLERS,
    }, {})


class Fleet:
    """Fake providers served once each, and routers over them."""

    def __init__(self, serve: Callable[..., Awaitable[TestServer]],
                 connect: Callable[..., Awaitable[TestClient]]) -> None:
        self._serve, self._connect = serve, connect
        self.servers: dict[str, TestServer] = {}

    async def router(self, providers: list[FakeProvider], dead: tuple[str, ...] = (), routing: str = "warm",
                     **settings: Any) -> TestClient:
        """A router over the providers (plus one at a closed port per dead name), after its first poll."""
        for provider in providers:
            if provider.name not in self.servers:
                self.servers[provider.name] = await self._serve(provider.app())
        urls = {provider.name: str(self.servers[provider.name].make_url("")).rstrip("/") for provider in providers}
        urls.update({name: closed_url() for name in dead})
        return await self._connect(create_app(config_for(urls, **settings), routing=routing))


@pytest.fixture
def fleet(aiohttp_server: Callable[..., Awaitable[TestServer]],
          aiohttp_client: Callable[..., Awaitable[TestClient]]) -> Fleet:
    return Fleet(aiohttp_server, aiohttp_client)


from tests.node.conftest import node_factory  # noqa: E402, F401 - real nodes for tests/router/test_verified_providers.py
