"""JSON-RPC 2.0 at `POST /rpc`: the network API's names for what the HTTP routes serve.

    tenzro_getGeneration  {"id": "chatcmpl-..."} or ["chatcmpl-..."]: a caller's own signed record, under
                          `GET /v1/generation`'s access rule (its caller or an auditor; anyone else gets the
                          one not-found answer every unknown id gets); needs the API key as for HTTP
    tenzro_getAttestation {"nonce": HEX} or [HEX] or none: `GET /v1/attestation`'s evidence document

The envelope (batches, notifications, error objects, what is an HTTP error instead) is the router's too:
`router/jsonrpc.py`.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from node.api.body import read_body
from node.api.identity import evidence_document, parse_nonce
from node.api.keys import CALLER, METER
from node.api.middleware import authenticate
from node.api.records import visible_record
from node.errors import (
    InvalidRequest,
    NodeError,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    UnsupportedMediaType,
)
from router.jsonrpc import INVALID_PARAMS, MAX_BATCH, MAX_BODY_BYTES, PARSE_ERROR, Envelope, Params, error_response

__all__ = ["MAX_BATCH", "MAX_BODY_BYTES", "routes"]

routes = web.RouteTableDef()

CODES: dict[type[Exception], int] = {
    InvalidRequest: INVALID_PARAMS,
    Unauthenticated: -32001,
    PermissionDenied: -32003,
    NotFound: -32004,
    Unavailable: -32005,
}
"""One server error code per kind of refusal; the router's refusals of the same kinds have the same codes."""


async def get_generation(request: web.Request, params: Params) -> Any:
    caller = request.get(CALLER)
    if caller is None:
        raise Unauthenticated("missing API key: send the header 'Authorization: Bearer <key>'")
    record_id = params.get("id")
    if not isinstance(record_id, str):
        raise InvalidRequest("'id' must be a completion id (chatcmpl-... or cmpl-...)", param="id")
    return visible_record(request.app[METER].ledger, {"id": record_id}, caller).to_json()


async def get_attestation(request: web.Request, params: Params) -> Any:
    nonce = params.get("nonce")
    if nonce is not None and not isinstance(nonce, str):
        raise InvalidRequest("'nonce' must be a string of hex characters", param="nonce")
    return await evidence_document(request, parse_nonce(nonce))


@routes.post("/rpc")
async def rpc(request: web.Request) -> web.Response:
    if request.content_type != "application/json":
        raise UnsupportedMediaType("JSON-RPC requests are sent with 'Content-Type: application/json'",
                                   code="unsupported_content_type")
    try:
        authenticate(request, required=False)  # first: a large body is parsed in its caller's share
        refused: NodeError | None = None
    except NodeError as exc:
        refused = exc
    try:
        body = await read_body(request, lambda parsed: parsed, MAX_BODY_BYTES)
    except InvalidRequest as exc:
        return error_response(PARSE_ERROR, exc.message)
    methods = {"tenzro_getGeneration": (lambda params: get_generation(request, params), ("id",)),
               "tenzro_getAttestation": (lambda params: get_attestation(request, params), ("nonce",))}
    return await Envelope(methods, CODES, NodeError).answer(body, refused)
