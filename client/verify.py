"""Verify a node before a prompt is sent: its hardware, its code, its model and the channel (issue 35).

1. Open a TLS connection and take the certificate the node presents, untrusted (`client.channel`).
2. Over a connection pinned to that certificate, ask `GET /v1/attestation?nonce=HEX` under a fresh random nonce.
3. Verify the evidence offline (`attestation.verify`): the hardware's signature and chain, the nonce, and the
   binding of report_data to the node's metering key, TLS key, code and model digests; TCB status and revocation
   against the vendor collateral the policy names (`collateral:`), never fetched here.
4. Compare the pinned certificate's SPKI with the one the evidence binds: a man in the middle with a key of its own
   fails here, however faithfully it relays the evidence.
5. Judge what the node presents against the caller's trust policy (`attestation.trust_policy`).

Only a node that passes all five is `ok`; whoever then sends prompts sends them over the same pinned certificate.
"""

from __future__ import annotations

import asyncio
import hmac
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from attestation.errors import AttestationError
from attestation.trust_policy import Presented, TrustPolicy, Verdict, presented_by
from attestation.verify import VerificationResult, verify_evidence
from client.channel import ChannelError, PinnedChannel, open_channel

EVIDENCE_TIMEOUT_S = 30.0
NO_ROOTS = Path("/nonexistent/tenzro-trust-roots")
"""Where a policy that accepts only `none` evidence names no roots: hardware evidence then fails to load them."""


class NodeRefused(Exception):
    """The node did not verify: nothing may be sent to it. `lines` say why, for people."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("; ".join(lines))
        self.lines = lines


@dataclass(frozen=True, slots=True)
class VerifiedNode:
    channel: PinnedChannel
    result: VerificationResult
    presented: Presented
    verdict: Verdict

    def lines(self) -> list[str]:
        """One verdict (what the hardware vouched for, what was pinned, what was not checked), then what was
        checked."""
        return [*self.verdict.lines(), f"  node key {self.result.public_key_hex}",
                f"  tls spki sha256 {self.channel.spki_sha256.hex()} (bound by the evidence)",
                *(f"  {check}" for check in self.result.checks)]


async def verify_node(url: str, policy: TrustPolicy, allow_none: bool = False,
                      session: aiohttp.ClientSession | None = None) -> VerifiedNode:
    """Verify the node at `url` (https); raises `NodeRefused` (with the verdict's lines) unless it passes."""
    try:
        channel = await open_channel(url)
    except ChannelError as exc:
        raise NodeRefused(["REFUSED", f"  {exc}"]) from exc
    nonce = os.urandom(32)
    document = await _evidence(channel, nonce, session)
    try:
        result = verify_evidence(document, policy.roots or NO_ROOTS, expected_nonce=nonce, allow_none=allow_none,
                                 collateral=policy.collateral)
    except (AttestationError, OSError, ValueError) as exc:
        raise NodeRefused(["REFUSED", f"  evidence: {exc}"]) from exc
    spki = bound_spki(result)
    presented = presented_by(result)
    verdict = policy.judge(presented)
    if spki is None:
        verdict = verdict.refused("channel-not-attested", "the evidence binds no TLS key (a v1 document): the "
                                  "channel is not attested")
    elif not hmac.compare_digest(spki, channel.spki_sha256):
        verdict = verdict.refused("channel-not-attested", f"the TLS key presented ({channel.spki_sha256.hex()}) is "
                                  f"not the one the evidence binds ({spki.hex()}): a man in the middle, or another "
                                  "node")
    node = VerifiedNode(channel, result, presented, verdict)
    if not verdict.ok:
        raise NodeRefused(node.lines())
    return node


def bound_spki(result: VerificationResult) -> bytes | None:
    """The TLS SPKI SHA-256 the verified binding vouches for (a v1 document, or a plain-HTTP node, binds none); the
    code and model digests it binds are judged by the policy, through `presented_by`."""
    return None if result.tls_spki_sha256_hex is None else bytes.fromhex(result.tls_spki_sha256_hex)


async def _evidence(channel: PinnedChannel, nonce: bytes, session: aiohttp.ClientSession | None) -> dict[str, Any]:
    own = session is None
    session = session or aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=EVIDENCE_TIMEOUT_S))
    try:
        async with session.get(f"{channel.url}/v1/attestation", params={"nonce": nonce.hex()},
                               ssl=channel.pin()) as response:
            if response.status != 200:
                raise NodeRefused(["REFUSED", f"  evidence: GET /v1/attestation answered {response.status}"])
            document = await response.json()
    except aiohttp.ServerFingerprintMismatch as exc:
        raise NodeRefused(["REFUSED", "  channel: the node's certificate changed between the handshake and the "
                                      "evidence request"]) from exc
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise NodeRefused(["REFUSED", f"  evidence: {exc}"]) from exc
    finally:
        if own:
            await session.close()
    if not isinstance(document, dict):
        raise NodeRefused(["REFUSED", "  evidence: not a JSON object"])
    return document


def verify(url: str, policy: TrustPolicy | str | os.PathLike[str], allow_none: bool = False) -> VerifiedNode:
    """`verify_node` for code without an event loop: the Python API. Talk to the node afterwards only through the
    pinned channel, e.g. with the official openai client:

        node = verify("https://node:8080", "trust.yaml")
        client = openai.OpenAI(base_url=node.channel.url + "/v1", api_key=KEY,
                               http_client=openai.DefaultHttpxClient(verify=node.channel.ssl_context()))

    Raises `NodeRefused`, whose `lines` say why."""
    loaded = policy if isinstance(policy, TrustPolicy) else TrustPolicy.load(Path(policy))
    return asyncio.run(verify_node(url, loaded, allow_none))
