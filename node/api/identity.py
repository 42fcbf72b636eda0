"""Who this node is, to anyone: the key that signs its records, its prices, policy, sealing and hygiene
(`GET /v1/node`), and attestation evidence binding that key, fresh under a verifier's nonce
(`GET /v1/attestation?nonce=HEX`); and, to operators only, how it is running (`GET /v1/node/state`).

What anyone reads is fixed for the node's start, whatever the key: counters, queue depth and byte totals would
let one caller watch others' traffic (bytes stored per turn, reply lengths), so they are the operator's."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from attestation.binding import NONCE_BYTES
from attestation.errors import EvidenceUnavailable
from metering.canonical import wei_to_json
from node.api.body import off_loop
from node.api.keys import CALLER, HYGIENE, IDENTITY, METER, POLICY, SERVICE, TLS
from node.auth import require_role
from node.errors import InvalidRequest, Unavailable
from node.identity import NodeIdentity

routes = web.RouteTableDef()


@routes.get("/v1/node")
async def node_identity(request: web.Request) -> web.Response:
    """Which key signs this node start's records and the digest of the evidence binding it, the digests of the
    code and models it runs (`node.code_identity`), the prices it charges now, its policy, which forward its
    model runs on (and why), where its stored state lives and which host copies it uses (and why), how its
    engine and sealing are set up,
    the process's hygiene and the TLS certificate it serves with; no key needed, and the same for every key."""
    service = request.app[SERVICE]
    forward = service.loaded.forward
    return web.json_response({
        **node_fields(request),
        "model": service.model_id,
        "forward": {"backend": forward.backend, "reason": forward.reason},
        "device": service.device.describe(),
        "engine": service.engine_config(),
        "sealing": service.sealing_config(),
        "attachments": service.media_config(),
    })


def node_fields(request: web.Request) -> dict[str, Any]:
    """`GET /v1/node`'s sections that every node has, whatever model it serves."""
    meter, identity = request.app[METER], request.app[IDENTITY]
    served = identity.served
    prices = meter.pricing.current()
    return {
        "object": "node",
        "boot_id": meter.boot_id,
        "key_id": meter.signer.key_id,
        "public_key": meter.signer.public_key_hex,
        "evidence": {"type": identity.evidence.evidence_type, "trusted": identity.evidence.trusted,
                     "digest": identity.evidence_digest},
        "code": None if served is None else served.code.describe(),
        "models": [] if served is None else [model.describe() for model in served.models],
        "policy": request.app[POLICY].as_json(),
        "ledger_segment": meter.ledger.path.name,
        "prices": {name: wei_to_json(value) for name, value in prices.to_mapping().items()},
        "pricing_error": meter.pricing.reload_error,
        "hygiene": request.app[HYGIENE],
        "tls": request.app[TLS],
    }


@routes.get("/v1/node/state")
async def node_state(request: web.Request) -> web.Response:
    """Operators only: `GET /v1/node`'s engine and sealing sections with what moves with traffic: decode steps
    and batches so far, the queue and running requests, and what the stored state's tiers hold now."""
    require_role(request[CALLER], "GET /v1/node/state", "operator")
    service = request.app[SERVICE]
    return web.json_response({
        "object": "node.state",
        "boot_id": request.app[METER].boot_id,
        "engine": service.engine_state(),
        "sealing": service.sealing_state(),
        "attachments": service.media_state(),
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
