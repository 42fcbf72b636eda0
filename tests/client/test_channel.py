"""The pinned channel: the certificate the first handshake presents, then only peers presenting it."""

from __future__ import annotations

import hashlib
import ssl
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from client.channel import ChannelError, open_channel, spki_sha256
from tests.client.tls_server import self_signed


async def serve(context: ssl.SSLContext, body: str) -> tuple[web.AppRunner, int]:
    async def hello(_: web.Request) -> web.Response:
        return web.Response(text=body)

    app = web.Application()
    app.router.add_get("/hello", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    return runner, runner.addresses[0][1]


async def test_the_channel_pins_the_first_certificate_and_refuses_any_other(tmp_path: Path) -> None:
    genuine, genuine_der = self_signed(tmp_path, "genuine")
    other, _ = self_signed(tmp_path, "other")
    first, port = await serve(genuine, "genuine")
    second, other_port = await serve(other, "other")
    try:
        channel = await open_channel(f"https://127.0.0.1:{port}")
        assert channel.certificate_der == genuine_der and channel.url == f"https://127.0.0.1:{port}"
        spki = x509.load_der_x509_certificate(genuine_der).public_key().public_bytes(
            Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
        assert channel.spki_sha256 == spki_sha256(genuine_der) == hashlib.sha256(spki).digest()
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{channel.url}/hello", ssl=channel.pin()) as response:
                assert await response.text() == "genuine"
            with pytest.raises(aiohttp.ServerFingerprintMismatch):
                await session.get(f"https://127.0.0.1:{other_port}/hello", ssl=channel.pin())
    finally:
        await first.cleanup()
        await second.cleanup()


async def test_plain_http_and_no_listener_are_refused() -> None:
    with pytest.raises(ChannelError, match="over https only"):
        await open_channel("http://127.0.0.1:1")
    with pytest.raises(ChannelError, match="no TLS handshake"):
        await open_channel("https://127.0.0.1:1")
