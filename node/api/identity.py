"""Who this node is, to anyone: the key that signs its records, its prices, policy, sealing and hygiene
(`GET /v1/node`), and attestation evidence binding that key, fresh under a verifier's nonce
(`GET /v1/attestation?nonce=HEX`)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from attestation.binding import NONCE_BYTES
from attestation.errors import EvidenceUnavailable
from metering.canonical import wei_to_json
from node.api.body import off_loop
from node.api.keys import HYGIENE, IDENTITY, METER, POLICY, SERVICE
from node.errors import InvalidRequest, Unavailable
from node.identity import NodeIdentity

routes = web.RouteTableDef()


@routes.get("/v1/node")
async def node_identity(request: web.Request) -> web.Response:
    """Which key signs this node start's records and the digest of the evidence binding it, the prices it
    charges now, its policy, which forward its model runs on (and why), whether stored state is sealed and
    the process's hygiene; no key needed."""
    meter, identity = request.app[METER], request.app[IDENTITY]
    prices = meter.pricing.current()
    forward = request.app[SERVICE].loaded.forward_path
    return web.json_response({
        "object": "node",
        "model": request.app[SERVICE].model_id,
        "boot_id": meter.boot_id,
        "key_id": meter.signer.key_id,
        "public_key": meter.signer.public_key_hex,
        "evidence": {"type": identity.evidence.evidence_type, "trusted": identity.evidence.trusted,
                     "digest": identity.evidence_digest},
        "policy": request.app[POLICY].as_json(),
        "ledger_segment": meter.ledger.path.name,
        "prices": {name: wei_to_json(value) for name, value in prices.to_mapping().items()},
        "pricing_error": meter.pricing.reload_error,
        "forward": {"path": forward.name, "reason": forward.reason},
        "engine": {**request.app[SERVICE].runner.engine_state(), **request.app[SERVICE].scheduler.describe()},
        "sealing": request.app[SERVICE].runner.sealing_state(),
        "hygiene": request.app[HYGIENE],
    })


def parse_nonce(text: str | None) -> bytes | None:
    """A verifier's nonce: exactly 64 hex characters (32 bytes); None when not given."""
    if text is None:
        return None
    try:
        nonce = bytes.fromhex(text)
    except ValueError:
        nonce = b""
    if len(nonce) != NONCE_BYTES or len(text) != 2 * NONCE_BYTES:
        raise InvalidRequest(f"'nonce' must be {2 * NONCE_BYTES} hex characters ({NONCE_BYTES} bytes)",
                             param="nonce", code="invalid_nonce")
    return nonce


async def evidence_document(request: web.Request, nonce: bytes | None) -> dict[str, Any]:
    """The boot's evidence (its records name its digest), or fresh evidence under `nonce`."""
    identity: NodeIdentity = request.app[IDENTITY]
    if nonce is None:
        return identity.evidence.document()
    try:
        return (await off_loop(request, identity.evidence_for, nonce)).document()
    except EvidenceUnavailable as exc:
        raise Unavailable(f"the TEE interface failed: {exc}", code="evidence_unavailable") from exc


@routes.get("/v1/attestation")
async def attestation(request: web.Request) -> web.Response:
    """Evidence binding the node key: `report_data` = SHA-256(domain, key, nonce), then 32 zero bytes. On a
    machine without a TEE its type is `none`, which no verifier trusts."""
    return web.json_response(await evidence_document(request, parse_nonce(request.query.get("nonce"))))
