"""The proxy forwards only over the channel it verified, fails closed, and verifies again when the node changes."""

from __future__ import annotations

import ssl
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from attestation.trust_policy import Presented, TrustPolicy, Verdict
from attestation.verify import VerificationResult
from client.channel import PinnedChannel, open_channel
from client.proxy import Verifier, create_app
from client.verify import NodeRefused, VerifiedNode
from tests.client.tls_server import self_signed

POLICY = TrustPolicy.parse({"tee_types": ["none"], "allow_none": True, "roots": None, "measurements": "any",
                            "rtmrs": "any", "min_tcb": "any", "code_digests": "any", "model_digests": "any",
                            "gpu": "optional"}, Path("."))


class Node:
    """A TLS 'node' on a fixed port that counts what reached it."""

    def __init__(self, context: ssl.SSLContext, name: str, port: int = 0) -> None:
        self.context, self.name, self.port, self.seen = context, name, port, 0
        self.runner: web.AppRunner | None = None

    async def start(self) -> Node:
        async def chat(request: web.Request) -> web.StreamResponse:
            self.seen += 1
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for part in (self.name, request.headers.get("Authorization", ""), (await request.text())):
                await response.write(f"data: {part}\n\n".encode())
            await response.write_eof()
            return response

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port, ssl_context=self.context)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"


def verified(channel: PinnedChannel) -> VerifiedNode:
    result = VerificationResult("none", False, "00" * 32, "boot", "00" * 32, True, None, "digest", (), 2,
                                channel.spki_sha256.hex(), "c0" * 32, (("m", "d1" * 32),))
    return VerifiedNode(channel, result, Presented("none"), Verdict((), Presented("none"), untrusted=True))


async def test_a_node_that_does_not_verify_gets_nothing(tmp_path: Path) -> None:
    node = await Node(self_signed(tmp_path)[0], "genuine").start()

    async def refuse(url: str, policy: TrustPolicy, allow_none: bool) -> VerifiedNode:
        raise NodeRefused(["REFUSED", "  code_digests: the node runs code c1, which the policy does not accept"])

    try:
        async with TestClient(TestServer(create_app(Verifier(node.url, POLICY, True, verify=refuse)))) as proxy:
            response = await proxy.post("/v1/chat/completions", data="{}")
            assert response.status == 503
            error = (await response.json())["error"]
            assert error["code"] == "node_not_verified"
            assert "code_digests: the node runs code c1" in error["message"]
            assert (await proxy.get("/proxy/health")).status == 503
        assert node.seen == 0
    finally:
        await node.stop()


async def test_a_restarted_node_with_a_new_key_is_verified_again_before_the_request_goes_to_it(
        tmp_path: Path) -> None:
    first = await Node(self_signed(tmp_path, "first")[0], "first").start()
    calls: list[str] = []

    async def verify(url: str, policy: TrustPolicy, allow_none: bool) -> VerifiedNode:
        calls.append(url)
        return verified(await open_channel(url))

    verifier = Verifier(first.url, POLICY, True, verify=verify)
    async with TestClient(TestServer(create_app(verifier))) as proxy:
        response = await proxy.post("/v1/chat/completions", data="hello", headers={"Authorization": "Bearer k"})
        assert await response.text() == "data: first\n\ndata: Bearer k\n\ndata: hello\n\n"
        await first.stop()
        second = await Node(self_signed(tmp_path, "second")[0], "second", port=first.port).start()  # a new key
        try:
            response = await proxy.post("/v1/chat/completions", data="again")
            assert (await response.text()).startswith("data: second\n\n")
            assert calls == [first.url, first.url] and verifier.verifications == 2
            assert (first.seen, second.seen) == (1, 1)
        finally:
            await second.stop()
